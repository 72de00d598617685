"""Simulated mode: every stage in this process, the same schedules and actions as process mode.

The engine keeps one :func:`~pipeq.runtime.interpreter.execute` generator per stage process the
schedule plans (each over the stages that process would hold: one, or several with virtual
stages) and advances them in turn: a process runs until it needs a message that has not been sent
yet, then the next one runs. The interpreter runs every action, a split backward's ``I`` and
``W`` too (zero-bubble schedules), so nothing here depends on the schedule. Messages are cloned
tensors in a dictionary, so nothing is shared between processes that process mode would not share
either; so are tied weights' gradients (the interpreter's :class:`~pipeq.runtime.requests.SwapTies`:
each stage posts its copies' gradients for its tie peers in other processes and waits for theirs,
then adds them in stage order, as a stage process does). Use it to debug a model or a schedule,
for research and for fast tests; process mode gives the same numbers.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch

from pipeq.errors import PipelineError, error_line, format_remote
from pipeq.runtime.backend import Shard, StageInputs
from pipeq.runtime.executors import make_executor
from pipeq.runtime.interpreter import ChunkBatch, ChunkError, ProcessPlan, execute
from pipeq.runtime.requests import Emit, Recv, Send, SwapTies
from pipeq.stage.microbatch import rewrap
from pipeq.stage.compiled import CompileOptions
from pipeq.stage.numerics import Numerics
from pipeq.schedules import Op, ScheduleFn
from pipeq.schedules.plan import process_stages
from pipeq.stage.executor import Tensors
from pipeq.stage.info import info_of
from pipeq.stage.memory import MemoryMeter
from pipeq.stage.spec import StageSpec


def _ties_answer(req: SwapTies, got: list[Any]) -> dict[int, dict[int, Any]]:
    """What a SwapTies gets back: the tensors taken from the mailbox, by chunk and sender."""
    answer: dict[int, dict[int, Any]] = {}
    it = iter(got)
    for c, by_peer in req.outgoing.items():
        answer[c] = {peer: next(it) for peer in by_peer}
    return answer


def _awaited(held: Sequence[int], req: Any) -> list[tuple[Any, ...]]:
    """The mailbox keys a process holding stages ``held`` (by chunk) waits for with ``req``."""
    if type(req) is SwapTies:
        return [(held[c], "tie", peer, req.round) for c, by_peer in req.outgoing.items() for peer in by_peer]
    return [(held[req.chunk], "act" if req.op is Op.RECV_ACT else "grad", req.microbatch)]


class SimulatedBackend:
    """Every stage's executor in this process, each built from a private copy of its spec."""

    def __init__(self, specs: Sequence[StageSpec], schedule: "str | ScheduleFn", device: str = "cpu",
                 numerics: Numerics | None = None, compile: CompileOptions | None = None) -> None:
        """``compile``: each stage's module compiled (:mod:`pipeq.stage.compiled`), in this process."""
        self.schedule = schedule
        n = len(specs)
        dev = torch.device(device)
        self.executors = [make_executor(schedule, k, n, copy.deepcopy(spec), dev, numerics, compile=compile)
                          for k, spec in enumerate(specs)]
        # the stages each process holds (virtual stages: several), by chunk
        self.groups = process_stages(schedule, n)
        for held in self.groups:  # each process's activation peak (pipeq.stage.memory)
            MemoryMeter.share([self.executors[k].memory for k in held])
        self._taken: list[tuple[int, list[dict[str, Any]]]] = []  # request_snapshots' snapshots
        self.plans = [ProcessPlan(schedule, p, n) for p in range(len(self.groups))]
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

    def close(self, failed: bool = False) -> None:
        pass

    def _run(
        self, step: int, sizes: list[int], x: Any, target: Any, training: bool,
        weights: list[float] | None = None, aux_weights: list[float] | None = None, stream: bool = False,
        inputs: Sequence[dict[str, Any] | None] | None = None,
    ) -> list[Tensors]:
        gens = []
        for p, (held, plan) in enumerate(zip(self.groups, self.plans)):
            exs = [self.executors[k] for k in held]
            parts = [ChunkBatch(x if k == 0 else None, target if self.executors[k].needs_target else None, weights,
                                aux_weights, inputs[k] if inputs is not None else None) for k in held]
            actions, _ = self._guard(held[0], plan.begin, exs, step, sizes, training, parts, stream)
            traces = [self.trace_rows[k] for k in held] if self.trace_rows is not None else None
            gens.append(execute(exs, actions, traces))
        return self._advance(gens)

    def _advance(self, gens: list[Any]) -> list[Tensors]:
        """Advance every process's interpreter in turn until all are done; the EMITted outputs."""
        n = len(gens)
        mailbox = self.mailbox
        outputs: dict[int, Tensors] = {}
        pending: list[Any] = [None] * n  # request a process is blocked on
        values: list[Any] = [None] * n
        done = [False] * n
        while not all(done):
            progressed = False
            for p in range(n):
                held = self.groups[p]
                while not done[p]:
                    req = pending[p]
                    if req is not None:  # blocked on a receive: is the message there yet?
                        keys = _awaited(held, req)
                        if not all(key in mailbox for key in keys):
                            break
                        got = [mailbox.pop(key) for key in keys]
                        values[p] = _ties_answer(req, got) if type(req) is SwapTies else got[0]
                        pending[p] = None
                    try:
                        req = self._guard(held[0], gens[p].send, values[p])
                    except StopIteration:
                        done[p] = True
                        progressed = True
                        break
                    progressed = True
                    values[p] = None
                    if type(req) is Recv:
                        pending[p] = req
                    elif type(req) is Send:
                        s = held[req.chunk]
                        if req.op is Op.SEND_ACT:
                            mailbox[(s + 1, "act", req.microbatch)] = rewrap(req.tensors, [t.clone() for t in req.tensors])
                        else:
                            mailbox[(s - 1, "grad", req.microbatch)] = tuple(t.clone() for t in req.tensors)
                    elif type(req) is Emit:
                        outputs[req.microbatch] = req.tensors
                    elif type(req) is SwapTies:  # post the tied gradients, then wait for the peers'
                        for c, by_peer in req.outgoing.items():
                            for peer, tensors in by_peer.items():
                                mailbox[(peer, "tie", held[c], req.round)] = [t.detach().clone() for t in tensors]
                        pending[p] = req
            if not progressed:  # cannot happen for a validated schedule
                raise PipelineError(f"simulated pipeline stalled on {pending}")
        return [outputs[j] for j in sorted(outputs)]

    def drain(self) -> None:
        """Finish a stream's leftover work (asynchronous 1F1B's last backwards)."""
        self._advance([execute([self.executors[k] for k in held], plan.drain())
                       for held, plan in zip(self.groups, self.plans)])

    def _guard(self, k: int, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args)``, a failure raised as the PipelineError of stage ``k`` (or of the stage a
        ChunkError names)."""
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

    def stats(self, reset: bool = False, memory: bool = False) -> list[dict[str, Any]]:
        """Every stage's stats (their peak memory is this one process's) and the bytes it holds;
        ``memory``: each measures its next training step (one replica: no other rows)."""
        for ex in self.executors if memory else ():
            ex.memory.ask()
        return [{**ex.stats(reset), **ex.memory.figures(), "shm_waits": 0}  # no transport: nothing waits
                for ex in self.executors]

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
