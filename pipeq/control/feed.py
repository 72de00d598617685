"""A runner's batches as its backend takes them: checked, split, routed and numbered.

:class:`Feed` is the runner's collaborator between a caller's batch and the backend
(:class:`~pipeq.runtime.backend.Backend`): ``x`` and ``target`` are checked and split into
microbatches and replica shards with their loss weights (:class:`~pipeq.control.batching.Batcher`),
``stage_inputs`` are routed to the stages that declare them (:mod:`pipeq.control.stage_inputs`),
a dict batch is matched to stage 0's inputs and the stages' first (:mod:`pipeq.control.dict_batch`),
and every step is numbered (training and prediction alike, counting up). A prediction's
microbatch outputs are joined again as the last stage returned them (a ``ModelOutput`` rebuilt; a
batch given as its microbatches, :class:`~pipeq.stage.microbatch.Microbatches`: one output per
microbatch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from pipeq.control.batching import check_batch
from pipeq.control.dict_batch import DictBatch
from pipeq.control.shape_check import TracedSizes
from pipeq.control.stage_inputs import route, route_each
from pipeq.stage import microbatch
from pipeq.stage.microbatch import Microbatches

if TYPE_CHECKING:
    from pipeq.control.batching import Batcher
    from pipeq.runtime.backend import Backend, Shard, StageInputs
    from pipeq.stage.executor import Tensors

__all__ = ["Feed", "TrainingStep"]


class TrainingStep(NamedTuple):
    """One training batch as a backend's ``submit`` takes it."""

    step: int
    shards: list[Shard]
    x: Any
    target: Any
    inputs: StageInputs | None


class Feed:
    """Turns a runner's batches into its backend's steps; ``batcher`` splits them, ``dicts``
    matches dict batches."""

    def __init__(self, batcher: Batcher, dicts: DictBatch | None = None, sizes: TracedSizes | None = None) -> None:
        self.batcher = batcher
        self.dicts = dicts or DictBatch(None)
        self.sizes = sizes or TracedSizes(None)  # a traced split's held sizes, checked on every batch
        #: the runner's backend, once it exists (``schedule="auto"``: once the first batch settled it)
        self.backend: Backend | None = None
        self._declared: list[tuple[str, ...]] | None = None  # each stage's declared inputs, asked once
        self._step = 0  # the last step's number

    @property
    def sent(self) -> int:
        """The steps numbered so far, training and predict alike: a stage names one of 1..sent."""
        return self._step

    def attach(self, backend: Backend, batcher: Batcher) -> None:
        """Feed ``backend``, its batches split by ``batcher`` (both built for the run's schedule)."""
        self.backend, self.batcher, self._declared = backend, batcher, None

    def _backend(self) -> Backend:
        assert self.backend is not None, "the runner settles its backend before it feeds it"
        return self.backend

    def match(self, x: Any, given: Any) -> tuple[Any, Any]:
        """``(x, stage_inputs)`` with a dict batch matched to the stages (:mod:`pipeq.control.dict_batch`)."""
        declared = self.dicts.declared
        if declared is None:
            if self.backend is None:  # schedule="auto" with a recipe, before it settles: the step matches it
                return x, given
            declared = self._declared = self._declared or self._backend().declared_inputs()
        return self.dicts.match(x, given, declared)

    def training(self, x: Any, target: Any, given: Any) -> TrainingStep:
        """The training batch ``(x, target)`` (with ``given``, its ``stage_inputs``) as the next step."""
        x, given = self.match(x, given)
        x, target, n = self.batcher.training_pair(x, target)
        self.sizes.check(x, given)
        inputs = self._route(given, x, n)
        shards = self.batcher.shards(target, n)
        self._step += 1
        return TrainingStep(self._step, shards, x, target, inputs)

    def predict(self, x: Any, given: Any) -> Any:
        """The output of a forward-only step on ``x`` (see :meth:`PipelineRunner.predict`)."""
        x, given = self.match(x, given)
        x, n = check_batch("x", x)
        self.batcher.check_input(x)
        self.sizes.check(x, given)
        inputs = self._route(given, x, n)
        self._step += 1
        split = isinstance(x, Microbatches)
        sizes = self.batcher.given_sizes(x, training=False) if split else self.batcher.sizes(n)
        out = _joined(self._backend().predict(self._step, sizes, x, inputs), split)
        return Microbatches(self.dicts.output(o) for o in out) if split else self.dicts.output(out)

    def _route(self, given: Any, x: Any, batch: int) -> StageInputs | None:
        """``stage_inputs`` as each stage's keyword arguments (None: none), checked against what
        the stages declare (:mod:`pipeq.control.stage_inputs`); of a batch given as its
        microbatches (``x``), one ``stage_inputs`` per microbatch."""
        if self._declared is None:
            self._declared = self._backend().declared_inputs()
        if given is None and not any(self._declared):  # the common case: nothing to route
            return None
        if isinstance(x, Microbatches):
            return route_each(given, self._declared, [microbatch.rows(v) for v in x], self.batcher.schedule)
        return route(given, self._declared, batch, self.batcher.schedule)


def _joined(outputs: list[Tensors], split: bool) -> Any:
    """Each microbatch's output unpacked as the last stage returned it (one tensor, or a 1-tuple
    of one, gives that tensor), joined again on dim 0; ``split`` (a batch given as its
    microbatches): as they are, one per microbatch (:class:`Microbatches`)."""
    outs = [microbatch.unpack(microbatch.spec_of(o), o) for o in outputs]
    outs = [o[0] if isinstance(o, tuple) and len(o) == 1 and isinstance(o[0], torch.Tensor) else o for o in outs]
    return Microbatches(outs) if split else microbatch.cat(outs)
