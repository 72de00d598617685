"""Every byte a stage holds: its parameters, gradients and optimizer state, and its activations' peak.

A stage's :class:`MemoryMeter` (the executor's ``memory``) answers two questions.

- **State bytes** (:func:`state_bytes`), read when asked: the parameters' bytes, their gradients'
  (those allocated now: after a step, until the next one zeroes them) and every optimizer's state
  (Adam: ``exp_avg`` and ``exp_avg_sq`` per parameter, and its ``step``). A tensor counts its
  bytes once however many names it has (a tied weight), and a DTensor counts its *local* part
  (``to_local()``): a tensor-parallel shard, or a sharded replica, reports what it holds.
- **Activation bytes**, measured over a training step: what the stage holds for its backward.
  While a measured step runs, every forward of the stage (its recomputation in the backward too)
  runs under ``torch.autograd.graph.saved_tensors_hooks``: each tensor autograd saves is counted by
  its storage, until autograd lets it go (the graph is freed by the backward, or by a split
  backward's ``W``); so are the tensors the executor keeps for the backward (the input it received,
  its output, the weight gradients' inputs a split backward's ``I`` keeps), until they are freed.
  Distinct storages count once (a tensor saved by two nodes, a view of another); the parameters and
  buffers (and any parameter or view of one autograd saves: FSDP2's gathered weights too), and the
  batch itself (held through the step whatever the schedule), do not count. The
  peak of that sum over the step is the stage's activation peak; it is the same on CPU and CUDA
  (no allocator involved). Each forward's growth is its microbatch's bytes (the largest over the
  step is reported); what a backward adds on top while it runs (a recomputed forward) is the
  step's ``transient`` bytes.

The stages of one process (virtual stages) share a :class:`Tally`: the sum of their chunks' held
bytes at each moment and its peak, the process's activation peak.

Measuring costs a Python call per saved tensor (pack and unpack) and a few per microbatch: about
1 % of a step of two GPT blocks on CPU (d_model 64 to 256, 128 tokens, one thread), more where
the kernels are fast beside Python (a GPU). So a stage measures only the training step after each
:meth:`MemoryMeter.ask`: a run's stages ask for their first (:func:`pipeq.runtime.executors.make_executor`),
and ``runner.memory()`` asks for the next after reading the last; the other steps run without
hooks (one attribute test per forward).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from pipeq.tree import tensors_of

__all__ = ["FIGURES", "local", "nbytes", "state_bytes", "Tally", "MemoryMeter"]

#: the names of a stage's memory figures (:meth:`MemoryMeter.figures`; a measured step's may be absent)
FIGURES = ("param_bytes", "grad_bytes", "optimizer_bytes", "measured_step", "microbatches", "activation_peak_bytes",
           "activation_bytes_per_microbatch", "activation_bytes_waiting_w", "activation_bytes_in_backward",
           "activation_bytes_in_input_grad", "process_activation_peak_bytes")


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (what this process holds), any other tensor itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of ``tensors``' local parts, each tensor once."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        x = local(t)
        total += x.numel() * x.element_size()
    return total


def _state_tensors(state: Any) -> Iterator[torch.Tensor]:
    """The tensors of an optimizer's per-parameter state (nested dicts and lists too)."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from _state_tensors(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from _state_tensors(v)


def state_bytes(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, int]:
    """``param_bytes``, ``grad_bytes`` (allocated gradients) and ``optimizer_bytes`` of a stage:
    each tensor once, a DTensor's local part (see the module)."""
    params = list(module.parameters())
    for opt in optimizers:  # what an optimizer covers beyond the module (an auxiliary head)
        params += [p for g in opt.param_groups for p in g["params"]]
    return {"param_bytes": nbytes(params),
            "grad_bytes": nbytes(p.grad for p in params if p.grad is not None),
            "optimizer_bytes": nbytes(t for opt in optimizers for st in opt.state.values()
                                      for t in _state_tensors(st))}


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(key, bytes) of the storage behind ``t``'s local part."""
    x = local(t)
    try:
        s = x.untyped_storage()
        return s.data_ptr() ^ (hash(x.device) << 1), s.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, a subclass without storage
        return id(x), x.numel() * x.element_size()


class Tally:
    """The held bytes of a process's stages together, and their peak since :meth:`reset`."""

    __slots__ = ("current", "peak")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def add(self, n: int) -> None:
        self.current += n
        if self.current > self.peak:
            self.peak = self.current

    def reset(self) -> None:
        self.peak = self.current


class _Saved:
    """What autograd keeps for a saved tensor while the hooks are on: the tensor, counted until
    this wrapper is freed (with the graph)."""

    __slots__ = ("t", "key", "meter")

    def __init__(self, t: torch.Tensor, key: int, meter: "MemoryMeter") -> None:
        self.t, self.key, self.meter = t, key, meter

    def __del__(self) -> None:
        self.meter._drop(self.key)


def _unpack(saved: Any) -> torch.Tensor:
    return saved.t if type(saved) is _Saved else saved


class MemoryMeter:
    """One stage's memory figures (see the module): its state bytes when asked (``module``'s and
    ``optimizers()``'), and its activations over the steps it measures. ``tally``: shared by the
    stages of one process (:meth:`share`)."""

    def __init__(self, module: nn.Module, optimizers: Callable[[], Sequence[torch.optim.Optimizer]]) -> None:
        self.module = module
        self.optimizers = optimizers
        self.tally = Tally()
        #: measuring the step under way (the executor tests it before each forward)
        self.on = False
        self._asked = False  # measure the next training step
        self._held: dict[int, list[int]] = {}  # storage key -> [holders, bytes, microbatch]
        self._by_mb: dict[int, int] = {}  # microbatch -> the bytes it holds now
        self._after_f: dict[int, int] = {}  # microbatch -> the bytes it held after its forward
        self._skip: set[int] = set()
        self._j = 0  # the microbatch whose forward runs (what it saves is its)
        self.current = 0  # this stage's held bytes now
        self._step = self._m = self._peak = self._fwd = self._wait = self._in_b = self._in_i = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        #: the last measured step's figures (None before one): see :meth:`figures`
        self.last: dict[str, Any] | None = None

    @staticmethod
    def share(meters: Sequence["MemoryMeter"]) -> None:
        """The stages of one process count into one tally (their process's peak)."""
        tally = Tally()
        for m in meters:
            m.tally = tally

    def ask(self) -> None:
        """Measure the next training step (a run asks for its first; ``runner.memory()`` for the
        next after reading the last)."""
        self._asked = True

    # -- a step ---------------------------------------------------------------------------------
    def begin(self, step: int, n_microbatches: int, training: bool, batch: Any) -> None:
        """Start a step of ``n_microbatches``, measured if it is a training step asked for (see
        :meth:`ask`). ``batch``: the step's own data (its microbatches of x, target and stage
        inputs, as trees), which does not count."""
        self._finish()
        if not (training and self._asked):
            return
        self._asked, self.on = False, True
        try:
            data = tensors_of(batch)
        except ValueError:  # (split by the executor: always a tree)
            data = []
        self._skip = {_storage(t)[0] for t in [*self.module.parameters(), *self.module.buffers(), *data]}
        self._step, self._m, self._peak = step, n_microbatches, self.current
        self._fwd = self._wait = self._in_b = self._in_i = 0
        self._after_f.clear()
        self.tally.reset()

    def _finish(self) -> None:
        """The measured step is over (the next begins): its figures kept as :attr:`last`."""
        if not self.on:
            return
        self.on = False
        self.last = {"measured_step": self._step, "microbatches": self._m, "activation_peak_bytes": self._peak,
                     "activation_bytes_per_microbatch": self._fwd, "activation_bytes_waiting_w": self._wait,
                     "activation_bytes_in_backward": self._in_b, "activation_bytes_in_input_grad": self._in_i,
                     "process_activation_peak_bytes": self.tally.peak}

    def figures(self) -> dict[str, Any]:
        """The stage's state bytes now (:func:`state_bytes`) and the last measured step's
        activation figures (none before one; a step under way ends its measurement here)."""
        self._finish()
        return {**state_bytes(self.module, self.optimizers()), **(self.last or {})}

    # -- counting -------------------------------------------------------------------------------
    def _add(self, key: int, n: int) -> None:
        entry = self._held.get(key)
        if entry is not None:
            entry[0] += 1
            return
        j = self._j
        self._held[key] = [1, n, j]
        self._by_mb[j] = self._by_mb.get(j, 0) + n
        now = self.current = self.current + n
        if now > self._peak:
            self._peak = now
        self.tally.add(n)

    def _drop(self, key: int) -> None:
        entry = self._held.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._held[key]
            _, n, j = entry
            self._by_mb[j] -= n
            self.current -= n
            self.tally.add(-n)

    def _pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):  # a weight (FSDP2's unsharded too)
            return t
        key, n = _storage(t)
        if n == 0 or key in self._skip:
            return t
        self._add(key, n)
        # detached: a saved output keeps no reference to its own node (that cycle would outlive
        # a graph whose input side a W never runs again); autograd restores what it needs on unpack
        return _Saved(t.detach(), key, self)

    def hold(self, j: int, tensors: Iterable[Any]) -> None:
        """Count ``tensors`` (kept for microbatch ``j``'s backward) until each is freed."""
        self._j = j
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            key, n = _storage(t)
            if n == 0 or key in self._skip:
                continue
            self._add(key, n)
            weakref.finalize(t, self._drop, key)

    # -- the actions a measured step runs ----------------------------------------------------------
    def forward(self, run: Callable[[int, Any], Any], j: int, received: Any, stash: Mapping[int, Any]) -> Any:
        """``run(j, received)``, the forward of microbatch ``j``, measured: what it saves is
        counted, and what it leaves in the executor's ``stash`` for the backward (the input leaves
        it received, its outputs or the last stage's loss): microbatch ``j``'s bytes."""
        self._j = j
        with self._hooks:
            out = run(j, received)
        kept = stash.get(j)
        if kept is not None:
            leaves, outs, _ = kept
            self.hold(j, leaves)
            self.hold(j, outs if isinstance(outs, tuple) else (outs,))
        self._after_f[j] = now = self._by_mb.get(j, 0)
        self._fwd = max(self._fwd, now)
        return out

    def recompute(self, run: Callable[..., Any], j: int, *args: Any) -> Any:
        """``run(j, *args)``, a backward's recomputation of microbatch ``j``'s forward
        (``recompute=True``): on a measured step what it saves is counted until the backward
        frees it (or, after an ``I``, its ``W``): the transient bytes."""
        if not self.on:
            return run(j, *args)
        self._j, before = j, self.current
        with self._hooks:
            out = run(j, *args)
        self._in_b = max(self._in_b, self.current - before)
        return out

    def kept_for_w(self, j: int, grads: Iterable[Any]) -> None:
        """Microbatch ``j``'s ``I`` is done and keeps ``grads`` for its ``W``, counted from now;
        what it holds at this moment beyond its ``F``'s (its outputs are still alive, a
        recomputation's saved tensors) is transient."""
        self.hold(j, grads)
        self._in_i = max(self._in_i, self._by_mb.get(j, 0) - self._after_f.get(j, 0))

    def waited(self, j: int) -> None:
        """Microbatch ``j``'s ``W`` starts: what it holds now, since its ``I``, is its bytes
        waiting for the ``W`` (its ``F``'s, and the gradients the ``W`` starts from)."""
        self._wait = max(self._wait, self._by_mb.get(j, 0))
