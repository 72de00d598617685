"""Simulated mode: every stage in this process, the same schedules and actions as process mode.

The engine keeps one :func:`~pipeq.runtime.interpreter.execute` generator per stage and advances them in
turn: a stage runs until it needs a message that has not been sent yet, then the next stage runs.
The interpreter runs every action, a split backward's ``I`` and ``W`` too (zero-bubble
schedules), so nothing here depends on the schedule. Messages are cloned tensors in a dictionary, so nothing is shared between stages that process
mode would not share either; so are tied weights' gradients (the interpreter's ``TIES``: each stage
posts its copies' gradients for its tie peers and waits for theirs, then adds them in stage order,
as a stage process does). Use it to debug a model or a schedule, for research and for fast
tests; process mode gives the same numbers.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch

from pipeq.errors import PipelineError, error_line, format_remote
from pipeq.runtime.backend import Shard, StageInputs
from pipeq.runtime.chunks import ChunkError, execute_chunks
from pipeq.runtime.executors import make_executor
from pipeq.runtime.interpreter import EMIT, TIES, StagePlan, execute
from pipeq.stage.microbatch import rewrap
from pipeq.stage.numerics import Numerics
from pipeq.schedules import Op, ScheduleFn
from pipeq.schedules.plan import process_stages
from pipeq.stage.executor import Tensors
from pipeq.stage.info import info_of
from pipeq.stage.spec import StageSpec


def _awaited(k: int, req: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """The mailbox keys stage ``k``'s blocked request ``req`` waits for."""
    if req[0] is TIES:
        return [(k, "tie", peer, req[3]) for peer in req[2]]
    return [(k, "act" if req[0] is Op.RECV_ACT else "grad", req[1])]


class SimulatedBackend:
    """Every stage's executor in this process, each built from a private copy of its spec."""

    def __init__(self, specs: Sequence[StageSpec], schedule: "str | ScheduleFn", device: str = "cpu",
                 numerics: Numerics | None = None) -> None:
        self.schedule = schedule
        n = len(specs)
        dev = torch.device(device)
        self.executors = [make_executor(schedule, k, n, copy.deepcopy(spec), dev, numerics)
                          for k, spec in enumerate(specs)]
        # the stages each process holds (virtual stages: several, pipeq.runtime.chunks), by chunk
        self.groups = process_stages(schedule, n)
        self.chunked = len(self.groups) < n
        self._taken: list[tuple[int, list[dict[str, Any]]]] = []  # request_snapshots' snapshots
        self.plans = [StagePlan(schedule, k, n) for k in range(len(self.groups))]
        # messages sent and not yet received: (destination, kind, microbatch), or tied gradients'
        # (destination, "tie", sender, exchange); a stream's outlive a batch
        self.mailbox: dict[tuple[Any, ...], Any] = {}
        self._results: dict[int, float | PipelineError] = {}  # submitted steps, not yet handed out
        self.step_lrs: dict[int, float | None] = {}  # step -> its learning rate, until the runner takes it
        #: one list per stage to record its compute actions' trace rows in (:mod:`pipeq.trace`;
        #: ``schedule="auto"`` times F, I and W so), None: no record
        self.trace_rows: list[list[tuple[int, ...]]] | None = None

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def _run(
        self, step: int, sizes: list[int], x: Any, target: Any, training: bool,
        weights: list[float] | None = None, aux_weights: list[float] | None = None, stream: bool = False,
        inputs: Sequence[dict[str, Any] | None] | None = None,
    ) -> list[Tensors]:
        gens = []
        if self.chunked:  # each process runs its chunks' actions in its one order
            for k, ex in enumerate(self.executors):
                more = {"inputs": inputs[k]} if inputs is not None and inputs[k] is not None else {}
                self._guard(k, ex.begin, step, sizes, training, x if k == 0 else None,
                            target if ex.needs_target else None, weights, aux_weights, **more)
            for p, group in enumerate(self.groups):
                gens.append(execute_chunks([self.executors[s] for s in group],
                                           self.plans[p].actions(len(sizes), training)))
            return self._advance(gens)
        for k, (ex, plan) in enumerate(zip(self.executors, self.plans)):
            actions, _ = self._guard(k, plan.begin, ex, step, sizes, training, x if k == 0 else None,
                                     target if ex.needs_target else None, weights, aux_weights, stream,
                                     inputs[k] if inputs is not None else None)
            gens.append(execute(ex, actions, self.trace_rows[k] if self.trace_rows is not None else None))
        return self._advance(gens)

    def _advance(self, gens: list[Any]) -> list[Tensors]:
        """Advance every stage's interpreter in turn until all are done; the EMITted outputs."""
        n = len(gens)
        mailbox = self.mailbox
        outputs: dict[int, Tensors] = {}
        pending: list[Any] = [None] * n  # request a stage is blocked on
        stage_of = list(range(n))  # the stage whose message a blocked process waits for
        values: list[Any] = [None] * n
        done = [False] * n
        while not all(done):
            progressed = False
            for k in range(n):
                while not done[k]:
                    req = pending[k]
                    if req is not None:  # blocked on a receive: is the message there yet?
                        keys = _awaited(stage_of[k], req)
                        if not all(key in mailbox for key in keys):
                            break
                        got = [mailbox.pop(key) for key in keys]
                        values[k] = dict(zip(req[2], got)) if req[0] is TIES else got[0]
                        pending[k] = None
                    try:
                        req = self._guard(k, gens[k].send, values[k])
                    except StopIteration:
                        done[k] = True
                        progressed = True
                        break
                    progressed = True
                    values[k] = None
                    op = req[0]
                    if self.chunked and op is not TIES:  # (..., chunk): that chunk's stage
                        s = self.groups[k][req[-1]]
                        req = (op, *req[1:-1])
                    else:
                        s = k
                    if op is Op.RECV_ACT or op is Op.RECV_GRAD:
                        pending[k] = req
                        stage_of[k] = s
                    elif op is Op.SEND_ACT:
                        mailbox[(s + 1, "act", req[1])] = rewrap(req[2], [t.clone() for t in req[2]])
                    elif op is Op.SEND_GRAD:
                        mailbox[(s - 1, "grad", req[1])] = tuple(t.clone() for t in req[2])
                    elif op is EMIT:
                        outputs[req[1]] = req[2]
                    elif op is TIES:  # post this stage's tied gradients, then wait for the peers'
                        for peer, tensors in req[2].items():
                            mailbox[(peer, "tie", k, req[3])] = [t.detach().clone() for t in tensors]
                        pending[k] = req
            if not progressed:  # cannot happen for a validated schedule
                raise PipelineError(f"simulated pipeline stalled on {pending}")
        return [outputs[j] for j in sorted(outputs)]

    def drain(self) -> None:
        """Finish a stream's leftover work (asynchronous 1F1B's last backwards)."""
        self._advance([execute(ex, plan.drain()) for ex, plan in zip(self.executors, self.plans)])

    def _guard(self, k: int, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except StopIteration:
            raise
        except ChunkError as exc:  # a process of several stages: the stage that failed
            raise PipelineError(str(exc), exc.stage, format_remote(exc)) from None  # its traceback is in the text
        except Exception as exc:
            raise PipelineError(error_line(exc), k, format_remote(exc)) from None

    def train(self, step: int, shards: list[Shard], x: Any, target: Any, stream: bool = False,
              inputs: StageInputs | None = None) -> float:
        """One step on one shard (the whole batch: there are no replicas in one process);
        ``inputs``: each stage's keyword arguments (``stage_inputs``), or None."""
        ((sizes, weights, aux_weights),) = shards
        self._run(step, sizes, x, target, True, weights, aux_weights, stream, inputs)
        return self.executors[-1].mean_loss()

    def submit(self, step: int, shards: list[Shard], x: Any, target: Any, stream: bool = False,
               inputs: StageInputs | None = None) -> None:
        """In one process a step runs when it is submitted: ``result`` hands its loss (or its
        failure) back, so a stream fails at the batch where it happened, as in process mode."""
        self.step_lrs[step] = self.executors[-1].learning_rate()  # the one this batch trains with
        try:
            self._results[step] = self.train(step, shards, x, target, stream, inputs)
        except PipelineError as exc:
            self._results[step] = exc

    @property
    def failing(self) -> bool:
        return any(isinstance(r, PipelineError) for r in self._results.values())

    def result(self, step: int) -> float:
        got = self._results.pop(step)
        if isinstance(got, PipelineError):
            raise got
        return got

    def predict(self, step: int, sizes: list[int], x: Any, inputs: StageInputs | None = None) -> list[Tensors]:
        return self._run(step, sizes, x, None, training=False, inputs=inputs)

    def stats(self, reset: bool = False) -> list[dict[str, Any]]:
        """Every stage's stats (their peak memory is this one process's)."""
        return [{**ex.stats(reset), "shm_waits": 0} for ex in self.executors]  # no transport: nothing waits

    def get_state(self) -> list[tuple[list[str], list[torch.Tensor]]]:
        out = []
        for ex in self.executors:
            names, tensors = ex.state_tensors()
            out.append((names, [t.clone() for t in tensors]))  # process mode returns copies too
        return out

    def set_state(self, per_stage: list[tuple[list[str], list[torch.Tensor]]]) -> None:
        for ex, (names, tensors) in zip(self.executors, per_stage):
            ex.load_state(names, tensors)

    def get_snapshots(self) -> list[dict[str, Any]]:
        return [ex.snapshot() for ex in self.executors]

    def request_snapshots(self, step: int) -> None:
        """Every stage's snapshot now (the steps sent have run), labelled ``step``."""
        self._taken.append((step, self.get_snapshots()))

    def take_snapshots(self) -> list[tuple[int, list[dict[str, Any]]]]:
        """The snapshots taken since the last call (see the process backend's)."""
        taken, self._taken = self._taken, []
        return taken

    def restore(self, snapshots: list[dict[str, Any]]) -> None:
        for k, (ex, snap) in enumerate(zip(self.executors, snapshots)):
            self._guard(k, ex.restore, snap)

    def layouts(self) -> list[dict[str, Any]]:
        return [ex.layout() for ex in self.executors]

    def declared_inputs(self) -> list[tuple[str, ...]]:
        """The inputs each stage declares (:class:`pipeq.stage.info.StageInfo`)."""
        return [info_of(ex.module).inputs for ex in self.executors]

    def scheduler_step(self, metric: float | None) -> None:
        for k, ex in enumerate(self.executors):
            self._guard(k, ex.scheduler_step, metric)

    def learning_rates(self) -> list[list[float]]:
        return [ex.learning_rates() for ex in self.executors]
