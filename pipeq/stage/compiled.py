"""Compiled stages: each stage process compiles its own stage with ``torch.compile``, after placement.

The run's ``compile`` setting (:class:`pipeq.NumericsConfig`) is False, True, or a dict of
``torch.compile`` keyword arguments (``backend``, ``mode``, ``dynamic``, ``fullgraph``,
``options``...) plus ``cache_dir``, the directory of torch's compile cache (inductor's FX graph
cache and AOTAutograd's cache, ``TORCHINDUCTOR_CACHE_DIR``; None: torch's own,
``TORCHINDUCTOR_CACHE_DIR`` or ``/tmp/torchinductor_<user>``). :func:`options` checks it once in the
driver; a stage process gets the resulting :class:`CompileOptions` and :func:`compile_stage` compiles
its module in place once it is on its device:

- a module with its own ``pipeq_compile(compile)`` says what to compile: a stage of
  :func:`pipeq.split` its graph code, not its wrapper (which turns the sizes sent between stages
  into ints: no graph break); an AL layer its four parts, which its executor calls apart;
- any other module has its ``forward`` compiled (an attribute of the instance): its parameters,
  ``state_dict`` names, ties, checkpoints and exports are the module's own (no ``_orig_mod.``).

The backward of a compiled forward is lowered with the forward (AOTAutograd's
``force_non_lazy_backward_lowering``), so that all of a stage's compile time falls in its forward
calls, where a :class:`CompileWatch` measures it: the compile seconds, the graphs compiled, the
recompiles (a call that compiled again after the function's first), the graph breaks and the cache
hits, which ``runner.stats()`` reports per stage. With ``dynamic=None`` (torch's default) every
dimension of a stage's tensor inputs but a floating tensor's last (its features) is marked as
possibly dynamic (``torch._dynamo.maybe_mark_dynamic``): the first compile is dynamic in the batch
and the sequence length, and a new length reuses it instead of recompiling (what torch's automatic
dynamic shapes alone would do once per dimension). Dynamic kernels cost a little per step (the
quick GPT of examples/gpt.py, one CPU thread: 5.1 ms a step marked, 3.5 ms static, 3.8-4.6 eager):
``mark_dynamic=False`` leaves torch's automatic dynamic shapes (static until a length changes, then
one recompile). ``dynamic=True`` / ``False`` is torch's own.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn

from pipeq.stage.split_backward import SPLIT_BACKENDS, Splitting, split_backend

__all__ = ["CompileOptions", "CompileWatch", "options", "compile_stage", "unwrap", "NO_COMPILE_FIGURES"]

#: torch.compile's keyword arguments a ``compile`` dict may give (besides ``cache_dir``)
TORCH_KWARGS = ("backend", "mode", "dynamic", "fullgraph", "options", "disable", "recompile_limit",
                "isolate_recompiles")
#: the keys of a ``compile`` dict that are pipeq's own
OWN = ("cache_dir", "mark_dynamic")
#: a stage's compile figures when it is not compiled (what ``runner.stats()`` reports)
NO_COMPILE_FIGURES = {"compile_s": 0.0, "compiles": 0, "recompiles": 0, "graph_breaks": 0, "compile_cache_hits": 0,
                      "backward_split": None}


@dataclass(frozen=True)
class CompileOptions:
    """What a stage process compiles with: ``torch.compile``'s keyword arguments and the cache directory."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    cache_dir: str | None = None
    mark_dynamic: bool = True  # with dynamic=None: mark the inputs' varying dimensions (see the module)
    #: the stage's schedule runs I and W apart: its backward is cut in two (:mod:`pipeq.stage.split_backward`)
    split_backward: bool = False


def options(setting: Any) -> CompileOptions | None:
    """The run's ``compile`` setting checked: None (False: not compiled) or its :class:`CompileOptions`;
    a ``ValueError`` names what is wrong."""
    if setting is False or setting is None:
        return None
    if setting is True:
        return CompileOptions()
    if isinstance(setting, CompileOptions):
        return setting
    if not isinstance(setting, Mapping):
        raise ValueError(f"compile must be True, False or a dict of torch.compile keyword arguments (backend, mode, "
                         f"dynamic, fullgraph, options) and cache_dir, got {setting!r}")
    unknown = sorted(set(setting) - {*TORCH_KWARGS, *OWN})
    if unknown:
        raise ValueError(f"compile: unknown key(s) {unknown}; it takes torch.compile's {list(TORCH_KWARGS)}, "
                         "cache_dir (the directory of torch's compile cache) and mark_dynamic (True or False)")
    if type(setting.get("mark_dynamic", True)) is not bool:
        raise ValueError(f"compile: mark_dynamic must be True or False, got {setting['mark_dynamic']!r}")
    cache = setting.get("cache_dir")
    if cache is not None and not isinstance(cache, (str, os.PathLike)):
        raise ValueError(f"compile: cache_dir must be a directory path, got {cache!r}")
    backend = setting.get("backend", "inductor")
    if not isinstance(backend, str):
        raise ValueError(f"compile: backend must be a registered backend's name (a stage process compiles: the "
                         f"setting crosses to it as data), got {backend!r}")
    return CompileOptions({k: v for k, v in setting.items() if k not in OWN},
                          os.path.abspath(os.fspath(cache)) if cache is not None else None,
                          setting.get("mark_dynamic", True))


#: what Dynamo records of each frame it compiles: its seconds (the backends' included)
_COMPILES = "_compile.compile_inner"
#: cache hits and graph breaks as counted after this process's last compile (they change only in one)
_seen: list[int] = []


def _hits_and_breaks() -> list[int]:
    """Torch's process-wide cache hits (inductor's FX graph cache, AOTAutograd's cache) and graph
    breaks (a break Dynamo resumes after, or one that made it skip a frame: ``unimplemented``)."""
    from torch._dynamo.utils import counters

    return [counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"],
            sum(counters["graph_break"].values()) + sum(counters["unimplemented"].values())]


def _mark_dynamic(args: Any) -> None:
    """Mark the dimensions of ``args``' tensors that vary in practice as dynamic (``maybe_mark_dynamic``:
    torch may still specialize one): every dimension but a floating tensor's last (its features), so
    that the first compile is dynamic in the batch and the sequence length and a new length (a
    batch's, a last microbatch's) reuses it instead of recompiling."""
    for t in args:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            floating = t.is_floating_point() or t.is_complex()
            dims = range(t.dim() - 1 if floating else t.dim())
            if dims:
                torch._dynamo.maybe_mark_dynamic(t, list(dims))


class CompileWatch:
    """One stage's compiled functions and what compiling them cost (see the module)."""

    def __init__(self, opts: CompileOptions, stage: int | None = None) -> None:
        self.opts = opts
        self.seconds = 0.0
        self.compiles = 0
        self.recompiles = 0
        self.graph_breaks = 0
        self.cache_hits = 0
        self.splitting = Splitting(stage) if opts.split_backward else None
        if self.splitting is not None:
            backend = opts.kwargs.get("backend", "inductor")
            if backend == "eager":  # Dynamo alone: an eager autograd graph, which pipeq splits as it is
                self.splitting.graphs = 1
            elif backend not in SPLIT_BACKENDS:
                self.splitting.whole(f"backend {backend!r} (pipeq cuts the backward of {' and '.join(SPLIT_BACKENDS)})")
            elif opts.kwargs.get("mode") in ("reduce-overhead", "max-autotune"):
                self.splitting.whole(f"mode {opts.kwargs['mode']!r} records CUDA graphs of a whole backward")

    def _kwargs(self) -> dict[str, Any]:
        """``torch.compile``'s keyword arguments: the run's, or its backward cut in two (the
        backend given as a function, with inductor's mode and options as its config)."""
        kwargs = {"isolate_recompiles": True, **self.opts.kwargs}
        if self.splitting is None or self.splitting.reason is not None or kwargs.get("backend") == "eager":
            return kwargs
        backend = kwargs.pop("backend", "inductor")
        options = dict(kwargs.pop("options", None) or {})
        mode = kwargs.pop("mode", None)
        if mode not in (None, "default"):
            from torch._inductor import list_mode_options

            options = {**list_mode_options(mode, kwargs.get("dynamic")), **options}
        return {**kwargs, "backend": split_backend(backend, options, self.splitting)}

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` compiled with the run's keyword arguments, its calls measured (a call that compiles
        nothing costs a dict lookup)."""
        from torch._dynamo.utils import compilation_time_metrics as metrics

        # each stage's functions recompile apart: two stages of one class (a split by module names)
        # in one process do not spend each other's recompile limit
        compiled = torch.compile(fn, **self._kwargs())
        compiled_before = [False]  # whether a call of this function compiled already
        mark = self.opts.mark_dynamic and self.opts.kwargs.get("dynamic") is None
        if not _seen:
            _seen.extend(_hits_and_breaks())

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if mark:
                _mark_dynamic((*args, *kwargs.values()))
            n0 = len(metrics.get(_COMPILES, ()))
            try:
                return compiled(*args, **kwargs)
            finally:
                times = metrics.get(_COMPILES, ())
                if len(times) > n0:
                    hits, breaks = _hits_and_breaks()
                    self.seconds += float(sum(times[n0:]))
                    self.compiles += len(times) - n0
                    self.cache_hits += hits - _seen[0]
                    self.graph_breaks += breaks - _seen[1]
                    _seen[:] = hits, breaks
                    self.recompiles += compiled_before[0]
                    compiled_before[0] = True

        return call

    def figures(self) -> dict[str, Any]:
        """What ``runner.stats()`` reports of the stage's compiling: ``compile_s`` (seconds compiling),
        ``compiles`` (graphs compiled), ``recompiles`` (calls that compiled again after a compiled
        function's first: a new shape torch could not reuse a graph for, eval mode), ``graph_breaks``
        and ``compile_cache_hits`` (torch's compile cache's); ``backward_split``: with a schedule
        that splits the backward, "I+W" (its compiled backward cut in two) or "whole: <why>" (run
        whole in ``I``: :mod:`pipeq.stage.split_backward`), else None."""
        return {"compile_s": round(self.seconds, 3), "compiles": self.compiles, "recompiles": self.recompiles,
                "graph_breaks": self.graph_breaks, "compile_cache_hits": self.cache_hits,
                "backward_split": self.splitting.figure() if self.splitting is not None else None}


def use_cache(opts: CompileOptions) -> None:
    """Point torch's compile cache at ``opts.cache_dir`` (this process's, before its first compile)."""
    if opts.cache_dir is not None:
        os.makedirs(opts.cache_dir, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = opts.cache_dir


def compile_stage(module: nn.Module, opts: CompileOptions, static: bool = False,
                  stage: int | None = None) -> CompileWatch:
    """Compile ``module`` (on its device already) in place, as the module says (see the module).
    Sets AOTAutograd's ``force_non_lazy_backward_lowering`` in this process (when a backward is
    compiled, not what it computes). ``static``: the module computes on DTensors (tensor
    parallelism), whose compile torch does not support with dynamic shapes yet
    (:mod:`pipeq.compat`, ``tp-compile-dynamic``): unless ``dynamic`` is given, every shape compiles
    a graph of its own (``dynamic=False``; a new length recompiles). ``stage``: its index, in messages."""
    import dataclasses

    from torch._functorch import config as aot_config

    if static and opts.kwargs.get("dynamic") is None:
        opts = dataclasses.replace(opts, kwargs={**opts.kwargs, "dynamic": False}, mark_dynamic=False)
    use_cache(opts)
    aot_config.force_non_lazy_backward_lowering = True
    watch = CompileWatch(opts, stage)
    own = getattr(module, "pipeq_compile", None)
    if callable(own):
        own(watch.wrap)
    else:
        module.forward = watch.wrap(module.forward)  # type: ignore[method-assign]
    return watch


def unwrap(module: nn.Module) -> tuple[nn.Module, bool]:
    """``module`` as pipeq runs it, and whether it was compiled here: an ``OptimizedModule``
    (``torch.compile(module)``) is its original module; a module whose ``compile()`` was called
    has it undone (a compiled call does not cross to a stage process: the run's ``compile`` setting
    compiles each stage there)."""
    compiled = False
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    while dynamo is not None and isinstance(module, dynamo.OptimizedModule):
        module, compiled = module._orig_mod, True
    for m in module.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None
            compiled = True
    return module, compiled

