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

**Freeing after an input gradient.** A stage whose plan splits its backward (:meth:`MemoryMeter.split`,
set each step from the plan: the zero-bubble schedules, V-Half, V-Min...) runs *every* training
forward under the same hooks: each saved tensor is held by a small :class:`_Saved` registered to
its microbatch. Before microbatch ``j``'s ``I``, :meth:`MemoryMeter.mark` reads the tensors the
``W``'s autograd nodes saved (:func:`pipeq.stage.grad_graph.read_saved`: each ``_saved_*``
attribute unpacks through the hook, which marks its holder kept); every other node of the input
side gets a post-hook (:meth:`MemoryMeter.unkept`, :func:`free_all`) that drops the tensors it
saved as soon as it has run, and after the ``I`` :meth:`MemoryMeter.keep_for_w` drops the rest of
``j``'s unmarked ones: the attention's probabilities, an activation's input, dropout masks and
what else only the input side read, all of it spent by the ``I``. What waits for the ``W`` is what
it computes from (a Linear's input, a LayerNorm's input and statistics) and the gradients ``I``
captured for it. A ``W`` that starts from the roots (a parameter used at two depths), a node that
hides what it saved (a C++ custom function) or stage 0 (no input gradient) frees nothing; a
compiled stage is not hooked (its ``I`` is its whole backward). A backward that would ever read a
freed tensor raises :class:`FreedTensorError` instead of computing. The numbers do not change: the
same tensors are read, only the unread ones are let go earlier.

The stages of one process (virtual stages) share a :class:`Tally`: the sum of their chunks' held
bytes at each moment and its peak, the process's activation peak.

Measuring costs a Python call per saved tensor (pack and unpack) and a few per microbatch: about
1 % of a step of two GPT blocks on CPU (d_model 64 to 256, 128 tokens, one thread), more where
the kernels are fast beside Python (a GPU). So a stage measures only the training step after each
:meth:`MemoryMeter.ask`: a run's stages ask for their first (:func:`pipeq.runtime.executors.make_executor`),
and ``runner.memory()`` asks for the next after reading the last; the other steps run without
hooks (one attribute test per forward). A split backward's stage pays its hooks on every step: a
pack per saved tensor in the forward, and per ``I`` a read of the saved tensors of the graph's
nodes and a post-hook per node that frees: about 0.3 ms per microbatch of two GPT blocks on CPU
(F +0.12, I +0.13, W +0.05 ms; 6 % of d_model 64, 128 tokens, 2 sequences; 1 % at d_model 256),
proportionally more where the kernels are fast beside Python (a GPU).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from pipeq.tree import tensors_of

__all__ = ["FIGURES", "local", "nbytes", "state_bytes", "Tally", "MemoryMeter", "FreedTensorError", "free_all",
           "device_peak"]

#: the names of a stage's memory figures (:meth:`MemoryMeter.figures`; a measured step's may be absent)
FIGURES = ("param_bytes", "grad_bytes", "optimizer_bytes", "measured_step", "microbatches", "activation_peak_bytes",
           "activation_bytes_per_microbatch", "activation_bytes_waiting_w", "activation_bytes_in_backward",
           "activation_bytes_in_input_grad", "process_activation_peak_bytes",
           # a stage's parallel layers' (pipeq.parallel.layers.StageParallel.figures)
           "gathered_param_bytes", "reduce_bytes")


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


def _weight(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter or a view of one: ``isinstance(t, nn.Parameter)`` (or its
    ``_base``'s) without the parameter type's ``__instancecheck__`` in Python for a plain tensor
    (a pack hook's every call)."""
    for x in (t, t._base):
        if x is not None and type(x) is not torch.Tensor and isinstance(x, nn.Parameter):
            return True
    return False


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
    """What autograd keeps for a saved tensor while the hooks are on: the tensor (counted under
    ``key`` until this wrapper is freed with the graph, or :meth:`free` d; None: not counted)."""

    __slots__ = ("t", "key", "meter", "kept", "__weakref__")

    def __init__(self, t: torch.Tensor, key: int | None, meter: "MemoryMeter") -> None:
        self.t, self.key, self.meter, self.kept = t, key, meter, False

    def free(self) -> None:
        """Let the tensor go now (its W will not read it: see :meth:`MemoryMeter.keep_for_w`)."""
        self.t = None  # type: ignore[assignment]
        key, self.key = self.key, None
        if key is not None:
            self.meter._drop(key)

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._drop(self.key)


def free_all(saved: Sequence[_Saved]) -> Callable[..., None]:
    """A node's post-hook that frees ``saved`` (:meth:`MemoryMeter.unkept`) once the node has run."""
    def hook(*_: Any) -> None:
        for s in saved:
            s.free()
    return hook


class FreedTensorError(RuntimeError):
    """A backward read a saved tensor that a split backward freed after its ``I`` (never expected:
    raised rather than computing with anything else)."""


class MemoryMeter:
    """One stage's memory figures (see the module): its state bytes when asked (``module``'s and
    ``optimizers()``'), and its activations over the steps it measures. ``tally``: shared by the
    stages of one process (:meth:`share`)."""

    def __init__(self, module: nn.Module, optimizers: Callable[[], Sequence[torch.optim.Optimizer]]) -> None:
        self.module = module
        self.optimizers = optimizers
        self.tally = Tally()
        #: measuring the step under way
        self.on = False
        #: the stage's backward splits (I, then W): every training forward is hooked, and each
        #: microbatch's saved tensors its W will not read are freed after its I (:meth:`split`)
        self.frees = False
        #: hooking this step's forwards: measuring, or freeing (the executor tests it before each forward)
        self.hooked = False
        self._saved: dict[int, list[weakref.ref[_Saved]]] = {}  # microbatch -> its saved tensors (freeing)
        self._mine: list[weakref.ref[_Saved]] | None = None  # the list of the microbatch whose forward runs
        self._marking = False  # reading what a W needs (mark): an unpacked tensor is kept
        self._collect: list[_Saved] | None = None  # reading a node's saved tensors (unkept)
        self._asked = False  # measure the next training step
        self._held: dict[int, list[int]] = {}  # storage key -> [holders, bytes, microbatch]
        self._by_mb: dict[int, int] = {}  # microbatch -> the bytes it holds now
        self._after_f: dict[int, int] = {}  # microbatch -> the bytes it held after its forward
        self._skip: set[int] = set()
        self._j = 0  # the microbatch whose forward runs (what it saves is its)
        self.current = 0  # this stage's held bytes now
        self._step = self._m = self._peak = self._fwd = self._wait = self._in_b = self._in_i = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        #: the last measured step's figures (None before one): see :meth:`figures`
        self.last: dict[str, Any] | None = None

    @staticmethod
    def share(meters: Sequence["MemoryMeter"]) -> None:
        """The stages of one process count into one tally (their process's peak)."""
        tally = Tally()
        for m in meters:
            m.tally = tally

    def split(self, on: bool) -> None:
        """Whether the stage's training steps split its backward (the plan has its ``I``): its
        forwards are then hooked to free, after each ``I``, what the ``W`` does not need."""
        self.frees = on
        self.hooked = self.on or on

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
        self._saved.clear()
        self.hooked = self.frees and training
        if not (training and self._asked):
            return
        self._asked, self.on, self.hooked = False, True, True
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
        self.on, self.hooked = False, self.frees
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
        if _weight(t):  # a weight (FSDP2's unsharded too)
            return t
        key: int | None = None
        if self.on:
            key, n = _storage(t)
            if n == 0 or key in self._skip:
                key = None
            else:
                self._add(key, n)
        mine = self._mine
        if key is None and mine is None:
            return t
        # detached: a saved output keeps no reference to its own node (that cycle would outlive
        # a graph whose input side a W never runs again); autograd restores what it needs on unpack
        s = _Saved(t.detach(), key, self)
        if mine is not None:
            mine.append(weakref.ref(s))
        return s

    def _unpack(self, s: Any) -> torch.Tensor:
        if type(s) is not _Saved:
            return s
        if self._marking:
            s.kept = True
        elif self._collect is not None:
            self._collect.append(s)
        t = s.t
        if t is None:
            raise FreedTensorError(
                "a backward read a tensor its forward saved that the split backward freed after the input "
                "gradient (I) as one the weight gradients (W) would not read; nothing was computed with it. "
                "This is a bug in pipeq (pipeq.stage.grad_graph's choice of the W's nodes): please report it")
        return t

    def _hook(self, j: int) -> None:
        """Microbatch ``j``'s forward (or recomputation) runs: what it saves is its."""
        self._j = j
        self._mine = self._saved.setdefault(j, []) if self.frees else None

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
        it received, its outputs or the last stage's loss): microbatch ``j``'s bytes. A stage that
        splits its backward (:meth:`split`) runs every training forward here, its saved tensors
        registered to microbatch ``j`` (see :meth:`keep_for_w`), measured or not."""
        self._hook(j)
        try:
            with self._hooks:
                out = run(j, received)
        finally:
            self._mine = None
        if not self.on:
            return out
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
        if not self.hooked:
            return run(j, *args)
        self._hook(j)
        before = self.current
        try:
            with self._hooks:
                out = run(j, *args)
        finally:
            self._mine = None
        if not self.on:
            return out
        self._in_b = max(self._in_b, self.current - before)
        return out

    def kept_for_w(self, j: int, grads: Iterable[Any]) -> None:
        """Microbatch ``j``'s ``I`` is done and keeps ``grads`` for its ``W``, counted from now;
        what it holds at this moment beyond its ``F``'s (its outputs are still alive, a
        recomputation's saved tensors) is transient."""
        self.hold(j, grads)
        self._in_i = max(self._in_i, self._by_mb.get(j, 0) - self._after_f.get(j, 0))

    def mark(self, j: int, read: Callable[[], Any]) -> bool:
        """Before microbatch ``j``'s ``I``: ``read()`` reads every tensor its ``W``'s nodes saved
        (their ``_saved_*`` attributes, each unpacked through this meter's hook), and each is
        marked kept. False: none of ``j``'s saved tensors is registered (a stage that does not
        split its backward): nothing may be freed."""
        if j not in self._saved:
            return False
        self._marking = True
        try:
            read()
        finally:
            self._marking = False
        return True

    def unkept(self, items: Iterable[Any], read: Callable[[Any], Any]) -> list[tuple[Any, list[_Saved]]]:
        """For each of ``items`` (the input side's nodes) whose ``read(item)`` reads saved tensors
        not marked kept: (the item, those tensors), what the ``I`` may free as soon as that node has
        run (:func:`free_all`)."""
        out = []
        self._collect = got = []
        try:
            for item in items:
                try:
                    read(item)
                except RuntimeError:  # (what it saved is freed with the rest after the I)
                    got.clear()
                    continue
                if got:
                    mine = [s for s in got if not s.kept]
                    if mine:
                        out.append((item, mine))
                    got.clear()
        finally:
            self._collect = None
        return out

    def keep_for_w(self, j: int, marked: bool) -> int:
        """Microbatch ``j``'s ``I`` is done: free each tensor its forward saved that is not marked
        kept (:meth:`mark`), if ``marked``; else (the ``W`` may read any: it starts from the
        roots, or a node hides what it saved) free nothing. Returns how many were freed here.
        A freed tensor that a backward still reads raises :class:`FreedTensorError`."""
        refs = self._saved.pop(j, None)
        if refs is None or not marked:
            return 0
        freed = 0
        for r in refs:
            s = r()
            if s is not None and not s.kept and s.t is not None:
                s.free()
                freed += 1
        return freed

    def waited(self, j: int) -> None:
        """Microbatch ``j``'s ``W`` starts: what it holds now, since its ``I``, is its bytes
        waiting for the ``W`` (its ``F``'s, and the gradients the ``W`` starts from)."""
        self._wait = max(self._wait, self._by_mb.get(j, 0))


def device_peak(device: torch.device, reset: bool = False) -> dict[str, Any]:
    """The allocator's peak of this stage process since the last reset (not the plan's peak:
    :class:`MemoryMeter`'s figures are the activations pipeq holds): CUDA's allocated bytes on a CUDA
    device; else the process's peak resident set (Linux VmHWM, reset through clear_refs)."""
    if device.type == "cuda":
        out = {"peak_bytes": int(torch.cuda.max_memory_allocated(device)), "memory": "cuda allocated"}
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return out
    try:
        with open("/proc/self/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        out = {"peak_bytes": kb * 1024, "memory": "process peak RSS"}
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
    except (OSError, StopIteration, ValueError):
        out = {"peak_bytes": None, "memory": "unavailable"}
    return out
