"""The pipeline a runner drives: the backend that runs its stages, from its first batch to its close.

:class:`Pipeline` is the runner's collaborator that holds the backend
(:class:`~pipeq.runtime.backend.Backend`) and hands it to the collaborators that use it. The
backend is built with the runner, or, with ``schedule="auto"``, at the first training batch, whose
profile settles the schedule (:meth:`~pipeq.control.assembly.BackendPlan.settle`); that batch's
shapes are checked between the stages first (:class:`~pipeq.control.shape_check.FirstBatchCheck`).
The stages are started and closed once (:class:`~pipeq.control.lifecycle.Lifecycle`); batches
become steps (:class:`~pipeq.control.feed.Feed`), sent ahead and handed back in order
(:class:`~pipeq.control.streaming.InFlight`); the state is read and written
(:class:`~pipeq.control.state.StateAccess`) and snapshotted in memory
(:class:`~pipeq.control.snapshots.SnapshotSchedule`); the stages report of themselves
(:class:`~pipeq.control.reports.StageReports`). Every call that needs the stages goes
through :meth:`Pipeline.live`: the backend settled, running, and every step sent so far done.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from pipeq.control import streaming
from pipeq.control.assembly import processes_of
from pipeq.control.batching import given_batch
from pipeq.control.dict_batch import DictBatch
from pipeq.control.feed import Feed
from pipeq.control.lifecycle import Lifecycle
from pipeq.control.reports import StageReports
from pipeq.control.shape_check import FirstBatchCheck, TracedSizes, warm_up
from pipeq.control.snapshots import SnapshotSchedule
from pipeq.control.stage_inputs import batch_item
from pipeq.control.state import StateAccess
from pipeq.control.streaming import InFlight
from pipeq.errors import PipelineError

if TYPE_CHECKING:
    from pipeq.control.assembly import BackendPlan
    from pipeq.control.batching import Batcher
    from pipeq.control.config import RunConfig
    from pipeq.control.driver import ProcessBackend
    from pipeq.control.exclusive import CallGuard
    from pipeq.runtime.backend import Backend
    from pipeq.schedules.choose import Choice

__all__ = ["Pipeline"]


class Pipeline:
    """A runner's stages, as its calls reach them: built from ``plan`` for the run ``config``; the
    steps in flight hold ``guard`` (the runner's) while a stream runs. ``settled(choice, config)``
    is told when ``schedule="auto"`` settles the schedule, and the run's configuration with it."""

    def __init__(self, plan: BackendPlan, config: RunConfig, guard: CallGuard,
                 settled: Callable[[Choice, RunConfig], None]) -> None:
        self.config = config
        self.n_stages = plan.model.n_stages
        self._auto = plan if config.auto else None  # "auto": no backend until the first batch settles the schedule
        self._settled = settled
        self._shapes = FirstBatchCheck.of(plan.model, config)  # at the first batch
        modules = None if plan.model.builder is not None else [s.module for s in plan.model.replicas[0]]
        self.feed = Feed(plan.batcher(config), DictBatch.of(modules), TracedSizes(modules))  # batches -> steps
        self.snapshots = SnapshotSchedule()  # in-memory snapshots
        self.flight = InFlight(guard, self.snapshots)  # the steps in flight
        self.life = Lifecycle(config.placement.mode)  # built, running, closed
        self.backend: Backend | None = None  # what runs the stages, once built
        self.processes: ProcessBackend | None = None  # the backend in process mode: what only it has
        self._state: StateAccess | None = None  # the stages' state, once the backend is built
        self._lr_schedule = plan.model.lr_schedule  # how the stages' lr schedulers step (the reports')
        if not config.auto:
            self._use(plan.backend(config), self.feed.batcher)

    def _use(self, backend: Backend, batcher: Batcher) -> None:
        """Run the stages on ``backend``, built for the run's schedule: each collaborator uses it."""
        self.backend, self.processes = backend, processes_of(backend, self.config.placement.mode)
        self.feed.attach(backend, batcher)
        self._state = StateAccess(backend, self.n_stages)
        self.snapshots.backend = backend
        self.flight.attach(backend, self.config.schedule, self.processes.degraded if self.processes else None)

    def start(self) -> None:
        """Start the stages, once (the shape check's warm-up meanwhile, when it will run)."""
        self.life.start(self.backend, warm_up if self._shapes.pending else lambda: None)

    def close(self, failed: bool = False) -> None:
        self.life.close(self.backend, failed)

    def live(self) -> Backend:
        """The backend, settled (``schedule="auto"``) and running, every step sent so far done."""
        if self._auto is not None and self.life.running:
            self._settle(None)
        self.life.check()
        assert self.backend is not None, "a running runner's backend is settled"
        self.flight.settle()
        return self.backend

    def state(self) -> StateAccess:
        """What reads and writes the stages' state, once :meth:`live`."""
        self.live()
        assert self._state is not None
        return self._state

    def reports(self) -> StageReports:
        """What the stages report of themselves (statistics, bytes, learning rates): each asks :meth:`live`."""
        return StageReports(self.live, lambda: self.config.schedule, self.n_stages, self._lr_schedule)

    def replica_failures(self) -> list[PipelineError]:
        """The replicas' failures the run carried on after (``fault_tolerance="replicas"``)."""
        loss = self.processes.replica_loss if self.processes is not None else None
        return list(loss.failures) if loss is not None else []

    def stage_processes(self) -> list[dict[str, Any]]:
        """Each stage process as it reported itself (see :attr:`PipelineRunner.stage_processes`)."""
        every = self.processes.worker_info if self.processes is not None else []
        return [{k: v for k, v in info.items() if k not in ("layout", "inputs")} for info in every]

    def first_batch(self, x: Any, target: Any, stage_inputs: Any) -> None:
        """The first training batch (once running): the shapes between the stages checked, before
        any is sent (:mod:`pipeq.control.shape_check`); with ``schedule="auto"`` the schedule settled."""
        x, stage_inputs = self.feed.match(x, stage_inputs)  # a dict batch: refused here if it does not fit
        if self.life.running and self._shapes.pending:
            self._shapes.check(self.feed.batcher, x, target, stage_inputs)
        if self.life.running and self._auto is not None:
            self._settle((x, target, stage_inputs))

    def _settle(self, batch: tuple[Any, Any, Any] | None) -> None:
        """``schedule="auto"``: choose the schedule (profiled with ``batch``, the first step's, when
        there is one), print the ranking once, build and start the backend (:meth:`BackendPlan.settle`)."""
        plan = self._auto
        assert plan is not None
        choice, config = plan.settle(self.config, self.feed.batcher, batch)
        backend = plan.backend(config)  # (until here nothing changed: a bad batch raises, and the next one settles)
        self._auto, self.config = None, config
        self._use(backend, plan.batcher(config))
        self._settled(choice, config)
        if self.life.running:
            backend.start()

    def train(self, x: Any, target: Any, stage_inputs: Any) -> float:
        """One training step on ``(x, target)``: its loss (see :meth:`PipelineRunner.step`)."""
        x, target, stage_inputs = given_batch(x, target, stage_inputs)
        self.first_batch(x, target, stage_inputs)
        self.live()
        return self.flight.hand_out(self._submit(x, target, stage_inputs))

    def _submit(self, x: Any, target: Any, given: Any = None, stream: bool = False) -> int:
        return self.flight.send(self.feed.training(x, target, given), stream)

    def predict(self, x: Any, stage_inputs: Any) -> Any:
        """A forward-only step's output (see :meth:`PipelineRunner.predict`)."""
        self.live()
        return self.feed.predict(x, stage_inputs)

    def eval_loss(self, loss_fn: Any) -> tuple[Any, str]:
        """The loss an evaluation reports: ``loss_fn``, or by default the run's (as its schedule evaluates it),
        and how its batches weigh (the run's ``loss_weighting``)."""
        self.live()
        chosen = self.config.schedule.eval_loss(self.feed.batcher.loss_fn) if loss_fn is None else loss_fn
        return chosen, self.config.numerics.loss_weighting

    def stream(self, batches: Iterable[Any], in_flight: int | None) -> Iterator[float]:
        """Each batch's loss, with up to ``in_flight`` batches sent ahead (see :meth:`PipelineRunner.stream`)."""
        if self.life.running and (self._auto is not None or self._shapes.pending):
            first, batches = streaming.peek(batches)  # the first batch checks the shapes, settles "auto"
            try:
                parts = batch_item(first, "stream")
            except ValueError:  # no batch: the stream says what is wrong
                parts = None
            if parts is not None:
                self.first_batch(*parts)
        self.live()
        depth = streaming.depth(in_flight, self.n_stages, self.config.microbatches, self.config.queue_capacity)
        return self.flight.stream(iter(batches), depth, self._submit, lambda: self.life.running)
