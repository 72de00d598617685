"""The shapes between stages, checked in the driver before the first batch is sent.

Stage k's output is stage k+1's input; a mismatch (stage 0 returns 64 features, stage 1's first
``nn.Linear`` takes 128) would otherwise surface only once the stage processes run it, as a stage's
remote error. :class:`FirstBatchCheck` runs each stage once on the **meta device** with the first
microbatch's shapes (copies of the stages whose parameters and buffers are meta tensors: the real
weights are never touched or copied, nothing is computed, no random number is drawn) and raises a
:class:`~pipeq.PipelineError` naming both stages and the shapes at the first stage that
cannot take its predecessor's output::

    stage 0 returns (4, 64) float32, but stage 1 expects (*, 128): a and b must have same reduction dim ...

The check runs only where it is sound and cheap, and is quietly skipped otherwise (the stages then
fail as before, in their processes): every stage is a module this process holds (not a recipe
built in the stage processes), made only of ``torch`` / ``torchvision`` layers and pipeq's own
(``pipeq.split``'s stages, ``pipeq.models``) -- a forward of your own class may do anything (sleep,
write files, talk to other processes), so it is not run here --, plain backprop (or
``schedule="auto"``), no tensor parallelism and no ``stage_inputs``. The runner calls it from the
first ``step`` or ``stream`` batch: before any stage process starts with ``schedule="auto"``
(which starts them then), after they started with the runner otherwise, but before anything is
sent. :func:`warm_up` loads torch's meta kernels in the background while the stages start. Any error that is not a clear shape
mismatch between two stages (an op the meta device lacks, a data-dependent shape, stage 0 refusing
``x``, which its process names as before) skips it too.

It runs once, on the first batch's first microbatch: a later batch of another length is never
refused here (a traced split's stages are dynamic in the dimensions the model lets vary,
:mod:`pipeq.split.dims`); a first batch whose length the model cannot take (one it fixed in the
trace, ``Split.static``) is named like any other mismatch, at the first stage that cannot take it.
:class:`TracedSizes` checks every batch against the sizes a traced split holds (in the driver,
before anything is sent: cheap, shapes only).
"""

from __future__ import annotations

import copy
import importlib
import re
import sys
import threading
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from pipeq.errors import PipelineError
from pipeq.stage.microbatch import Microbatches
from pipeq.tree import as_args, map_tensors, tensors_of

if TYPE_CHECKING:
    from pipeq.control.batching import Batcher

__all__ = ["FirstBatchCheck", "TracedSizes", "candidate", "check_stages", "checkable", "warm_up"]

#: Where the layers come from whose forward runs here: code with no side effects of its own.
TRUSTED = ("torch.", "torchvision.", "pipeq.split", "pipeq.models")
#: What a shape mismatch says (torch's own wording); anything else is not reported here.
SHAPE_WORDS = re.compile(r"shape|size|dim|channels|must match|expected input|cannot be multiplied", re.IGNORECASE)


def checkable(modules: Sequence[nn.Module]) -> bool:
    """Whether the stages' forwards are all torch's or pipeq's (so safe to run in the driver)."""
    return all(type(m).__module__.startswith(TRUSTED) for stage in modules for m in stage.modules())


def _meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are meta tensors (no data copied)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


def _describe(value: Any) -> str:
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in tensors_of(value))


def _first_layer(module: nn.Module) -> nn.Module:
    while isinstance(module, nn.Sequential) and len(module):
        module = module[0]
    return module


def _expects(module: nn.Module) -> str:
    """What ``module`` takes, when its first layer says (a Sequential starting with Linear, Conv...)."""
    first = _first_layer(module)
    if isinstance(first, nn.Linear):
        return f"(*, {first.in_features})"
    if isinstance(first, nn.modules.conv._ConvNd):
        return f"(N, {first.in_channels}, ...)"
    if isinstance(first, nn.LayerNorm):
        return "(*, " + ", ".join(str(s) for s in first.normalized_shape) + ")"
    return "another shape"


def check_stages(modules: Sequence[nn.Module], x: Any) -> None:
    """Run ``modules`` in a chain on meta copies, from ``x`` (one microbatch, any device); raise a
    PipelineError at the first stage k >= 1 that cannot take stage k-1's output for a shape
    reason. Anything else returns quietly: the stage processes will say what they find."""
    value = map_tensors(x, lambda t: torch.empty_like(t, device="meta"))
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for k, module in enumerate(modules):
                meta = _meta_copy(module)
                try:
                    out = meta(*as_args(value))
                except RuntimeError as exc:
                    if k == 0 or isinstance(exc, NotImplementedError) or "meta" in str(exc).lower() \
                            or not SHAPE_WORDS.search(str(exc)):
                        return
                    line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    err = PipelineError(f"stage {k - 1} returns {_describe(value)}, but stage {k} expects "
                                        f"{_expects(module)}: {line} (checked on the meta device before the first "
                                        "batch was sent)")
                    err.stage = k  # the stage that cannot take its input; the text names both
                    raise err from None
                if out is None:
                    return
                value = out
    except PipelineError:
        raise
    except Exception:  # noqa: BLE001 - anything unexpected: the stages will tell
        return


def candidate(model: Any, plain: bool, tensor_parallel: int) -> list[nn.Module] | None:
    """The stages to check at the first batch (None: the check does not apply; see the module)."""
    if model.builder is not None or not model.replicas or not plain or tensor_parallel != 1:
        return None
    modules = [spec.module for spec in model.replicas[0]]
    try:
        from pipeq.stage.info import info_of

        if len(modules) < 2 or any(info_of(m).inputs for m in modules) or not checkable(modules):
            return None
    except Exception:  # noqa: BLE001
        return None
    return modules


def warm_up() -> None:
    """Import, in the background while the stages start, what the meta device's first op imports
    (``torch._dynamo``, 1-2 s), so that the check at the first batch takes milliseconds."""
    if "torch._dynamo" not in sys.modules:
        threading.Thread(target=importlib.import_module, args=("torch._dynamo",), daemon=True,
                         name="pipeq-shape-check").start()


class FirstBatchCheck:
    """A runner's shape check, run once at its first training batch: ``modules`` are the stages
    to check (:func:`candidate`; None: the check does not apply)."""

    def __init__(self, modules: list[nn.Module] | None) -> None:
        self.modules = modules

    @classmethod
    def of(cls, model: Any, cfg: Any) -> FirstBatchCheck:
        """The check of ``model``'s stages (a :class:`~pipeq.control.checks.Model`) in the run
        ``cfg`` (a :class:`~pipeq.control.config.RunConfig`) says, if it applies (:func:`candidate`)."""
        return cls(candidate(model, cfg.auto or cfg.schedule.plain_backprop, cfg.placement.tensor_parallel))

    @property
    def pending(self) -> bool:
        """The first training batch has not come yet, and the check applies."""
        return self.modules is not None

    def check(self, batcher: Batcher, x: Any, target: Any, stage_inputs: Any) -> None:
        """The first training batch ``(x, target)``, split as ``batcher`` splits it: check the
        shapes between the stages on its first microbatch (see the module), then never again. A
        batch ``batcher`` refuses raises its ValueError here, as the step would, and the check
        waits for the next."""
        checked, _, n = batcher.training_pair(x, target)
        modules, self.modules = self.modules, None
        if modules is None or stage_inputs is not None:
            return
        try:
            first = batcher.first(checked, n)
        except Exception:  # noqa: BLE001
            return
        check_stages(modules, first)


class TracedSizes:
    """The sizes beyond dim 0 that a traced split's stages hold for the model's inputs
    (:func:`pipeq.split.dims.limits_of`), checked in the driver on every batch before anything is
    sent: a length of 1, or another than one the trace fixed, is refused with the stage's
    ValueError and the pipeline goes on. Stages that are not ``pipeq.split``'s (or a recipe's,
    built elsewhere) check nothing here."""

    def __init__(self, modules: Sequence[nn.Module] | None) -> None:
        stages = [m for m in modules or () if getattr(m, "limits", None) and hasattr(m, "check_sizes")]
        self.stages = stages
        first = modules[0] if modules else None
        self.first: tuple[str, ...] = tuple(getattr(first, "model_inputs", ()) or ())  # GraphStage.model_inputs

    def check(self, x: Any, stage_inputs: Any) -> None:
        """Check ``x`` (stage 0's positional inputs: one value, or a tuple of them) and the
        ``stage_inputs`` dict, or each microbatch of a batch given as :class:`Microbatches`."""
        if not self.stages:
            return
        if isinstance(x, Microbatches):  # each with its own stage inputs
            given = stage_inputs if isinstance(stage_inputs, Microbatches) else [stage_inputs] * len(x)
            for xj, gj in zip(x, given):
                self.check(xj, gj)
            return
        values = x if isinstance(x, tuple) and len(self.first) > 1 else (x,)
        inputs = dict(zip(self.first, values))
        if isinstance(stage_inputs, dict):
            inputs.update(stage_inputs)
        for stage in self.stages:
            stage.check_sizes(inputs)
