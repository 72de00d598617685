"""What does not run together, and why: the one table of pipeq's refusals.

Every capability composes with every other (schedules, replicas, FSDP / HSDP, tensor
parallelism, precision, clipping, recompute, finiteness checks, compile, tied weights, replica
fault tolerance), each equal to one process. What is left here cannot be: torch cannot do it
(the row cites where), or what is asked has no meaning (a simulated run has one process, a lost
FSDP piece has no copy), or, for one setting beside them (``auto_memory_limit``), pipeq's own way
of checking it. Each :class:`Refusal` names the settings, why, and what to do instead;
:func:`check` raises the first that applies, as a ``ValueError``, before any process starts
(``PipelineRunner`` and ``pipeq launch`` alike), and the stage processes of a recipe ask again for
what only they know. ``docs/reference/compatibility.md`` is this table, generated
(:func:`markdown`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Refusal", "Run", "REFUSALS", "check", "refusal", "markdown"]


@dataclass(frozen=True)
class Run:
    """What a rule looks at: the run's configuration (a :class:`pipeq.RunConfig`), whether it spans
    hosts, whether a stage holds tied weights, and the numerics it asks for (any not default)."""

    config: Any
    multi_host: bool = False
    ties: bool = False
    numerics: bool = False

    @property
    def place(self) -> Any:
        return self.config.placement

    @property
    def schedule(self) -> Any:
        return self.config.schedule

    @property
    def ft(self) -> bool:
        return self.config.fault.fault_tolerance == "replicas"


@dataclass(frozen=True)
class Refusal:
    """One row: ``what`` is refused (the settings as a user writes them), ``why``, whose limit it is
    (``torch``, with ``link``; ``meaning``: the request has none; ``pipeq``: pipeq's own, outside
    the capabilities that compose), and ``fix``."""

    key: str
    what: str
    why: str
    fix: str
    whose: str
    applies: Callable[[Run], bool]
    link: str = ""
    #: the settings a refusal of this run names (its own values: "schedule 'async', data_parallel=2")
    names: tuple[str, ...] = ()

    def message(self, run: Run | None = None) -> str:
        said = f" (this run: {', '.join(_value(run, n) for n in self.names)})" if run is not None and self.names else ""
        return f"{self.what}{said}: {self.why}; {self.fix}" + (f" ({self.link})" if self.link else "")


def _value(run: Run, name: str) -> str:
    """``name`` as this run sets it (the schedule by its name)."""
    if name == "schedule":
        return f"schedule {run.schedule.name!r}"
    for part in ("placement", "numerics", "fault", "wire"):
        if hasattr(getattr(run.config, part), name):
            return f"{name}={getattr(getattr(run.config, part), name)!r}"
    return name


def _own_way(run: Run) -> bool:
    """A schedule that computes its own way (its own losses, updates or recomputation)."""
    return not run.schedule.plain_backprop


REFUSALS: tuple[Refusal, ...] = (
    Refusal("simulated-replicas", "data_parallel > 1 with mode='simulated'",
            "a simulated run computes every stage of one replica in this one process", "use mode='process'",
            "meaning", lambda r: r.place.mode == "simulated" and r.place.data_parallel > 1, names=("data_parallel",)),
    Refusal("simulated-shards", "tensor_parallel > 1 with mode='simulated'",
            "tensor parallelism splits a stage over processes, and a simulated run has one", "use mode='process'",
            "meaning", lambda r: r.place.mode == "simulated" and r.place.tensor_parallel > 1,
            names=("tensor_parallel",)),
    Refusal("simulated-faults", "fault_tolerance='replicas' with mode='simulated'",
            "a simulated run has no replicas to lose", "use mode='process'",
            "meaning", lambda r: r.place.mode == "simulated" and r.ft),
    Refusal("ft-one-replica", "fault_tolerance='replicas' with data_parallel=1",
            "the other replicas carry on without a failed one, and there is no other",
            "set data_parallel=2 or more, or leave fault_tolerance unset (pipeq launch --max-restarts restarts a "
            "run from its checkpoint)", "meaning", lambda r: r.ft and r.place.data_parallel < 2,
            names=("data_parallel",)),
    Refusal("ft-fsdp", "fault_tolerance='replicas' with sharding='fsdp'",
            "every replica holds the only copy of its pieces of each parameter and optimizer state, so a lost "
            "one cannot be rebuilt from the others",
            "use sharding='hsdp' (a shard group lost whole is rebuilt from another group's copy), or restart "
            "from a snapshot or a checkpoint (pipeq launch --max-restarts)", "meaning",
            lambda r: r.ft and r.place.sharding == "fsdp"),
    Refusal("ft-stream", "fault_tolerance='replicas' with a schedule that carries work across batches",
            "a lost replica's unfinished microbatches of the next batch could not be told from its finished ones",
            "use a schedule that finishes each batch (e.g. '1f1b')", "meaning",
            lambda r: r.ft and r.schedule.streams_across_batches, names=("schedule",)),
    Refusal("ft-hosts", "fault_tolerance='replicas' in a multi-host run",
            "a lost replica's processes are started again by the driver, which starts only its own host's",
            "leave it unset across hosts (pipeq launch --max-restarts restarts a run from its checkpoint)",
            "meaning", lambda r: r.ft and r.multi_host),
    Refusal("hosts-untrusted", "replicas across hosts without trusted_network=True",
            "torch's collectives (gloo, NCCL) between hosts carry no authentication and no encryption: anyone "
            "on the network could join them or read the gradients (a stage's tensor-parallel shards share "
            "its host, on loopback)",
            "set trusted_network=True where the network between the hosts is yours alone (the security guide "
            "says what it covers), or run the replicas on one host", "torch",
            lambda r: r.multi_host and r.place.data_parallel > 1 and not r.config.wire.trusted_network,
            "https://pytorch.org/docs/stable/distributed.html#security", names=("data_parallel",)),
    Refusal("replicas-per-microbatch", "data_parallel > 1 with a schedule that updates after every microbatch",
            "the replicas would have to all-reduce every microbatch, which is no step of the whole batch",
            "use a schedule that updates once per batch", "meaning",
            lambda r: r.place.data_parallel > 1 and r.schedule.per_microbatch_steps, names=("schedule",)),
    Refusal("own-way-shards", "tensor_parallel or sharding with a schedule that computes its own way",
            "its executor holds each stage whole and computes its own losses or updates", "use a schedule of "
            "plain backprop (fill-drain, 1f1b, zb-h1, zb-h2, zbv, interleaved-1f1b, dualpipev, v-half, v-min, "
            "your own of F, B, I, W and STEP)", "meaning",
            lambda r: _own_way(r) and (r.place.tensor_parallel > 1 or r.place.sharding != "none"),
            names=("schedule", "tensor_parallel", "sharding")),
    Refusal("own-way-numerics", "precision, clip_grad_norm, check_finite or recompute with a schedule that "
            "computes its own way", "its own losses, updates or recomputation decide these",
            "use them with a schedule of plain backprop", "meaning", lambda r: _own_way(r) and r.numerics,
            names=("schedule",)),
    Refusal("own-way-ties", "tied weights with a schedule that computes its own way",
            "their gradients are summed over the stages at the one optimizer step of a batch, which such a "
            "schedule does not have", "untie them, or use a schedule of plain backprop", "meaning",
            lambda r: _own_way(r) and r.ties, names=("schedule",)),
    Refusal("tp-compile-dynamic", "compile with dynamic=True and tensor_parallel > 1",
            "torch compiles DTensor-sharded modules with dynamic shapes only in part: their backward fails to "
            "trace (pipeq compiles a tensor-parallel stage with static shapes instead, a graph per length, unless "
            "dynamic is given)", "leave dynamic unset (or False) with tensor parallelism", "torch",
            lambda r: r.place.tensor_parallel > 1 and isinstance(r.config.numerics.compile, dict)
            and r.config.numerics.compile.get("dynamic") is True,
            "https://github.com/pytorch/pytorch/issues/174732", names=("tensor_parallel",)),
    Refusal("auto-limit-parallel", "auto_memory_limit with data_parallel or tensor_parallel",
            "schedule='auto' checks the limit against what each stage holds, measured by profiling the stages "
            "whole in this one process before any other starts: a replica's, a shard's or a piece's share is "
            "not what it measures", "name the schedule (runner.memory() then says what each process holds)",
            "pipeq", lambda r: False),
    Refusal("fp16-cpu", "precision='fp16' on the CPU", "this torch has no float16 autocast on the CPU",
            "use precision='bf16' on the CPU", "torch", lambda r: False,
            "https://pytorch.org/docs/stable/amp.html#cpu-ops-that-can-autocast-to-bfloat16"),
    Refusal("nccl-one-gpu", "two processes of one stage's mesh on one GPU",
            "NCCL refuses two ranks of a communicator on one device", "give the stage's shards and replicas a "
            "GPU each (devices=, or fewer shards or replicas per host)", "torch", lambda r: False,
            "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting.html"),
)

_BY_KEY = {r.key: r for r in REFUSALS}


def refusal(key: str) -> Refusal:
    """The row ``key`` (for the checks that need what only a stage process or a device plan knows)."""
    return _BY_KEY[key]


def check(config: Any, *, multi_host: bool = False, ties: bool = False, numerics: bool = False) -> None:
    """Raise the first refusal that applies to a run of ``config`` (see :class:`Run`)."""
    run = Run(config, multi_host, ties, numerics)
    for row in REFUSALS:
        if row.applies(run):
            raise ValueError(row.message(run))


def markdown() -> str:
    """The table as the docs render it."""
    lines = ["| refused | why | whose limit | instead |", "|---|---|---|---|"]
    for row in REFUSALS:
        whose = f"[torch]({row.link})" if row.link else row.whose
        lines.append(f"| {row.what} | {row.why} | {whose} | {row.fix} |")
    return "\n".join(lines)
