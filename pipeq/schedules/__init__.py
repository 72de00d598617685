"""Schedules as data: per-stage lists of actions, validated and dry-run before any process starts.

A schedule is a :class:`SchedulePolicy`: its plan names the *compute* actions of one training step,
``F j`` (forward of microbatch j), ``B j`` (backward of microbatch j), or the backward split into
``I j`` (input gradient) and ``W j`` (weight gradients), and ``STEP`` (optimizer step), and its hooks tell the runtime what else the schedule needs (:mod:`.protocol`).
:func:`lower` derives the communication from the compute actions (an ``F`` on stage k > 0 first
receives its activation from k-1, an ``F`` on stage k < N-1 then sends it to k+1; ``B`` likewise
on the backward channel), and :func:`dry_run` executes the lowered lists symbolically, refusing
any schedule that would deadlock. Nothing here does I/O.

    actions.py   the vocabulary: Op, Action, F, B, I, W, STEP, and lowering into sends and receives
    basic.py     fill-drain (GPipe), 1F1B, forward-only
    zero_bubble.py  the zero-bubble schedules (split backward): ZB-H1 (1F1B's memory), ZB-H2 (twice
                 the memory, the pipeline kept full), ZBV (two stages per process in a V)
    placement.py virtual stages: which model stages a process holds (looped, V)
    interleaved.py  interleaved 1F1B and looped BFS (v stages per process, looped)
    dualpipe.py  DualPipeV (DeepSeek's DualPipe in a V)
    v_memory.py  V-Half and V-Min (a V under a cap on activations in flight: 1/2, 1/3 of 1F1B's)
    protocol.py  SchedulePolicy (what the runtime asks of a schedule), FunctionSchedule
    registry.py  SCHEDULES by name, register(), resolve()
    bubbles.py   each built-in schedule's bubble in closed form (printed beside its dry run)
    plan.py      build(): a validated, lowered, dry-run plan; format_table()
    dryrun.py    consistency checks and the symbolic dry run
    bounds.py    the plan under runner.stream and the time per batch it allows
    memory.py    what a plan holds: each stage's peak of microbatches in flight (in_flight_peaks),
                 each process's; in bytes from what a microbatch holds (peak_bytes, StageBytes:
                 ``runner.memory()``'s prediction; ``pipeq schedule --memory``)
    choose.py    choose(): rank the schedules by their dry run with measured costs under a memory
                 limit, and search I/W placements (``schedule="auto"``, ``pipeq schedule auto``)
    tdp_csv.py   torch.distributed.pipelining's schedule CSV: dumps, loads, CsvSchedule
                 (a file as a schedule: ``pipeq.from_csv(path)``)

The research schedules (``Interlock``, ``AsyncOneFOneB``, ``AssociatedLearning``) are plug-ins
from :mod:`pipeq.research`; they are offered here by name too. ``format_table(name, N, m)``
prints a schedule's dry run, e.g. 1F1B, 4 stages x 4 microbatches::

    stage 0 | F0 F1 F2 F3 .  .  .  B0 .  B1 .  B2 .  B3 ST
    stage 1 | .  F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3 ST
    stage 2 | .  .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 ST
    stage 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 ST
"""

from __future__ import annotations

from typing import Any

from pipeq.errors import ScheduleError
from pipeq.schedules.actions import (B, COMPUTE_OPS, GRAD_OPS, STEP, WEIGHT_DONE_OPS, Action, F, I, Op, Schedule,
                                     ScheduleFn, W, lower, lower_stage)
from pipeq.schedules.basic import fill_drain, forward_only, one_f_one_b, warmup_order
from pipeq.schedules.dryrun import check_consistency, dry_run, step_bubble
from pipeq.schedules.plan import build, format_table, process_stages
from pipeq.schedules.memory import StageBytes, in_flight_peaks, peak_bytes, process_peaks, stage_in_flight
from pipeq.schedules.zero_bubble import ZBV, zb_h1, zb_h2, zbv
from pipeq.schedules.interleaved import Interleaved1F1B, LoopedBFS, interleaved_1f1b, looped_bfs
from pipeq.schedules.dualpipe import DualPipeV, dualpipev
from pipeq.schedules.v_memory import VHalf, VMin, capped_v
from pipeq.schedules.protocol import FunctionSchedule, SchedulePolicy
from pipeq.schedules.registry import (EXPORTS, SCHEDULES, NeedsOptions, from_label, get_schedule, is_research,
                                      loss_stages, options_of, output_stage, register, resolve, schedule_name,
                                      taking_aux_heads)

__all__ = [
    "Op", "Action", "F", "B", "I", "W", "STEP", "GRAD_OPS", "WEIGHT_DONE_OPS", "zb_h1", "Schedule", "ScheduleFn", "COMPUTE_OPS", "lower", "lower_stage",
    "warmup_order", "fill_drain", "one_f_one_b", "forward_only", "SchedulePolicy", "FunctionSchedule",
    "NeedsOptions", "SCHEDULES", "register", "resolve", "get_schedule", "from_label", "loss_stages",
    "output_stage", "is_research", "schedule_name", "options_of", "check_consistency", "dry_run", "step_bubble", "build",
    "format_table", "process_stages", "ScheduleError", "taking_aux_heads", "zb_h2", "Interleaved1F1B", "LoopedBFS", "interleaved_1f1b",
    "looped_bfs", "ZBV", "zbv", "DualPipeV", "dualpipev", "VHalf", "VMin", "capped_v",
    "in_flight_peaks", "stage_in_flight", "process_peaks", "peak_bytes", "StageBytes",
]


def __getattr__(name: str) -> Any:
    """The names plug-ins offer here (``pipeq.schedules.Interlock``...)."""
    if name in EXPORTS:
        return EXPORTS[name]
    raise AttributeError(f"module 'pipeq.schedules' has no attribute {name!r}")
