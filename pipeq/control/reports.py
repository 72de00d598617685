"""What the running stages report of themselves: statistics, learning rates, and every byte they hold.

:class:`StageReports` is the runner's collaborator for the questions a running pipeline answers
about its stages (``runner.stats()``, ``runner.memory()``, ``runner.learning_rates()``) and for
stepping their lr schedulers (``runner.scheduler_step``); it asks the backend
(:class:`~pipeq.runtime.backend.Backend`), which asks every stage with one GET_STATS each.

``runner.memory()`` turns each stage's figures (:mod:`pipeq.stage.memory`: its parameter,
gradient and optimizer-state bytes, and its last measured training step's activations) into one
:class:`StageMemory` per stage and replica, beside what the schedule's plan predicts for that
step: the plan walked with the bytes each microbatch was measured to hold
(:func:`pipeq.schedules.memory.peak_bytes`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from pipeq.errors import ScheduleError
from pipeq.schedules.memory import StageBytes, in_flight_peaks, peak_bytes, size
from pipeq.schedules.plan import process_stages
from pipeq.stage import lr_schedulers
from pipeq.stage.memory import FIGURES

if TYPE_CHECKING:
    from pipeq.runtime.backend import Backend

__all__ = ["StageMemory", "StageReports", "stage_bytes", "memory_table", "size"]


@dataclass(frozen=True)
class StageMemory:
    """What one stage of one replica holds, in bytes (``runner.memory()``; the memory guide,
    docs/guides/memory.md, reads an example). Every tensor counts once, a DTensor its local part
    (a tensor-parallel shard's or a sharded replica's own): with ``tensor_parallel``, shard 0's.

    Attributes:
        stage: the model stage (with virtual stages, each of a process's chunks is one).
        replica: the data-parallel replica (0 without ``data_parallel``).
        process: the pipeline rank (process) that holds the stage, within its replica (replica 1's
            count from 0 too): two stages share one in a V.
        param_bytes: the stage's parameters.
        grad_bytes: their gradients allocated now (after a step, until the next one zeroes them).
        optimizer_bytes: its optimizers' state (Adam: ``exp_avg``, ``exp_avg_sq`` and ``step``).
        measured_step: the training step the activation figures below were measured in (the
            runner's step number; None: no step measured yet). A run measures its first training
            step, and the step after each ``runner.memory()`` call.
        microbatches: that step's microbatches (this replica's).
        activation_peak_bytes: the activations' peak over that step: the distinct storages the
            stage held for its backward at once (what autograd saved, the input it received, its
            output, what an ``I`` keeps for its ``W``), measured with saved-tensor hooks on CPU
            and CUDA alike; parameters and the batch itself do not count.
        activation_bytes_per_microbatch: the most one microbatch held after its forward.
        activation_bytes_waiting_w: the most one held after its ``I``, until its ``W`` (zero-bubble
            schedules; 0 without).
        activation_bytes_in_backward: the most a ``B`` added while it ran (``recompute=True``: the
            recomputed forward; else 0).
        activation_bytes_in_input_grad: the most an ``I`` held beyond its forward's as it ended.
        in_flight: the schedule's plan's peak of this stage's microbatches in flight (forwarded,
            their ``B`` or ``W`` not yet done) at that step's microbatches.
        predicted_activation_bytes: the plan's prediction of ``activation_peak_bytes``: its
            actions walked in order, each microbatch in flight weighing what it was measured to
            hold (:func:`pipeq.schedules.memory.peak_bytes`); ``in_flight`` x
            ``activation_bytes_per_microbatch`` without split backwards and recompute.
        process_activation_peak_bytes: the peak of what the process's stages held together (one
            stage per process: the stage's own peak; a V: both chunks, at most the sum of theirs).
        predicted_process_activation_bytes: the plan's prediction of it.
        device_peak_bytes: ``runner.stats()``'s ``peak_bytes`` on CUDA (the allocator's peak since
            the start or the last reset: everything, not just activations); None on CPU.
        gathered_param_bytes: a sharded stage's parameters gathered whole (FSDP's all-gather):
            held through a training step (``fsdp_reshard="step"``) or one action at a time
            (``"microbatch"``), beside the pieces ``param_bytes`` counts; 0 unsharded.
        reduce_bytes: the flat buckets the replicas' gradient all-reduce holds after the step's last
            backward (this process's pieces of the gradients); 0 without replicas.
        predicted_peak_bytes: what the stage is predicted to hold at its peak: its state, the
            gathered parameters, and the larger of the predicted activations and the reductions'
            buckets (they are not held at once: the buckets come after the last backward).
    """

    stage: int
    replica: int
    process: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    measured_step: int | None = None
    microbatches: int | None = None
    activation_peak_bytes: int | None = None
    activation_bytes_per_microbatch: int | None = None
    activation_bytes_waiting_w: int | None = None
    activation_bytes_in_backward: int | None = None
    activation_bytes_in_input_grad: int | None = None
    in_flight: int | None = None
    predicted_activation_bytes: int | None = None
    process_activation_peak_bytes: int | None = None
    predicted_process_activation_bytes: int | None = None
    device_peak_bytes: int | None = None
    gathered_param_bytes: int = 0
    reduce_bytes: int = 0
    predicted_peak_bytes: int | None = None

    @property
    def state_bytes(self) -> int:
        """Parameters, gradients and optimizer state together."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (JSON-ready)."""
        return dataclasses.asdict(self)


class StageReports:
    """The reports of the stages that ``live()`` returns the backend of (running, every step sent
    done: :meth:`pipeq.control.pipeline.Pipeline.live`), for the run's schedule (``schedule()``:
    once live, settled) of ``n_stages`` model stages per replica; ``lr_schedule``: how their lr
    schedulers step."""

    def __init__(self, live: Callable[[], Backend], schedule: Callable[[], Any], n_stages: int,
                 lr_schedule: Any) -> None:
        self.live, self._schedule, self.n_stages, self.lr_schedule = live, schedule, n_stages, lr_schedule

    @property
    def schedule(self) -> Any:
        return self._schedule()

    def stats(self, reset: bool = False) -> list[dict[str, Any]]:
        """Every stage's statistics (replica 0's; see ``PipelineRunner.stats``)."""
        return [{k: v for k, v in row.items() if k not in FIGURES} for row in self.live().stats(reset)]

    def learning_rates(self) -> list[list[float]]:
        return self.live().learning_rates()

    def scheduler_step(self, metric: float | None) -> None:
        """Step every stage's lr scheduler, ``metric`` checked first, before the stages are asked to
        run (see ``PipelineRunner.scheduler_step``)."""
        value = lr_schedulers.check_metric(self.lr_schedule, metric)
        self.live().scheduler_step(value)

    def memory(self) -> list[StageMemory]:
        """One :class:`StageMemory` per stage and replica (stage order within each replica), each
        stage asked to measure its next training step."""
        rows = self.live().stats(memory=True)
        n = self.n_stages
        process = {k: p for p, held in enumerate(self._where()) for k in held}
        out: list[StageMemory] = []
        for r in range(len(rows) // n):
            mine = rows[r * n:(r + 1) * n]
            predicted = self._predicted(mine)
            for k, row in enumerate(mine):
                known = {f.name: row.get(f.name) for f in dataclasses.fields(StageMemory) if f.name in FIGURES
                         and row.get(f.name) is not None}
                cuda = row.get("memory") == "cuda allocated"
                mem = StageMemory(stage=k, replica=r, process=process.get(k, k), **known, **predicted[k],
                                  device_peak_bytes=row.get("peak_bytes") if cuda else None)
                if mem.predicted_activation_bytes is not None:
                    mem = dataclasses.replace(mem, predicted_peak_bytes=mem.state_bytes + mem.gathered_param_bytes
                                              + max(mem.predicted_activation_bytes, mem.reduce_bytes))
                out.append(mem)
        return out

    def _where(self) -> list[list[int]]:
        try:
            return process_stages(self.schedule, self.n_stages)
        except (ScheduleError, ValueError):
            return [[k] for k in range(self.n_stages)]

    def _predicted(self, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each stage's in-flight peak and the predicted peaks, from one replica's figures (all
        None for a step not measured, or a schedule whose plan says nothing of its memory)."""
        none: dict[str, Any] = {"in_flight": None, "predicted_activation_bytes": None,
                                "predicted_process_activation_bytes": None}
        ms = {row.get("microbatches") for row in rows}
        if len(ms) != 1 or None in ms or any(row.get("activation_bytes_per_microbatch") is None for row in rows):
            return [none] * len(rows)
        (m,) = ms
        per = [stage_bytes(row) for row in rows]
        try:
            counts = in_flight_peaks(self.schedule, self.n_stages, m)
            stage_peak, process_peak = peak_bytes(self.schedule, self.n_stages, m, per)
        except (ScheduleError, ValueError, TypeError):  # a schedule without a plan of its own
            return [none] * len(rows)
        where = self._where()
        of = {k: p for p, held in enumerate(where) for k in held}
        return [{"in_flight": counts[k], "predicted_activation_bytes": round(stage_peak[k]),
                 "predicted_process_activation_bytes": round(process_peak[of[k]])} for k in range(len(rows))]


def stage_bytes(row: dict[str, Any]) -> StageBytes:
    """What one microbatch of a stage holds (the plan's weights), from the stage's measured figures."""
    return StageBytes(row["activation_bytes_per_microbatch"], row["activation_bytes_waiting_w"] or None,
                      row["activation_bytes_in_backward"], row["activation_bytes_in_input_grad"])


def memory_table(rows: Sequence[StageMemory]) -> str:
    """``runner.memory()`` as a table: one line per stage and replica (what ``pipeq launch`` logs
    after its first step)."""
    head = ("stage", "replica", "params", "grads", "optimizer", "activations", "predicted", "per mb", "in flight",
            "process peak")
    body = [(str(r.stage), str(r.replica), size(r.param_bytes), size(r.grad_bytes), size(r.optimizer_bytes),
             size(r.activation_peak_bytes), size(r.predicted_activation_bytes),
             size(r.activation_bytes_per_microbatch), "-" if r.in_flight is None else str(r.in_flight),
             size(r.process_activation_peak_bytes)) for r in rows]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    step = next((r.measured_step for r in rows if r.measured_step is not None), None)
    title = (f"memory per stage (activations: step {step}'s peak, measured; predicted from the schedule's plan)"
             if step is not None else "memory per stage (activations not measured: no training step yet, or this "
                                      "schedule's stages do not measure them)")
    return "\n".join([title] + ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in [head, *body]])
