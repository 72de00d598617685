"""torch.distributed.pipelining's schedule CSV (compute-only), read and written: text in, text out.

TDP (and torchtitan) save a schedule as one CSV row per rank, a cell per time step: ``0F1`` is
stage 0's forward of microbatch 1, ``1I0`` / ``1W0`` the split backward, ``2B3`` a whole
backward, an empty cell an idle step. The number before the letter is TDP's *stage index* (a
virtual stage); pipeq names the same thing (process k, ``chunk`` c). With one stage per process
stage = k; with looped placement (TDP's interleaved schedules) stage = k + c*N; with V placement
(``placement="v"``, TDP's ZBV and DualPipeV) process p holds stages p and 2N-1-p.

:func:`dumps` writes a plan (one list of actions per process; STEP dropped, TDP rows have none);
:func:`loads` reads one back, a STEP at the end of each row, and refuses a malformed, incomplete
or deadlocking file with a :class:`~pipeq.ScheduleError` naming the row (process), the column
(time step) and the cell. ``REDUCE_GRAD``, ``UNSHARD`` and ``RESHARD`` (TDP's bookkeeping, which
pipeq does by itself) are skipped; communication cells (``SEND_F``...) belong to TDP's
compute_comms format and are refused. A plan of one chunk per process is validated and dry-run
like any pipeq schedule; one of several chunks is checked per virtual stage (every microbatch
forwarded and backwarded once, in order) and dry-run across processes, each holding its stages.
:class:`CsvSchedule` is such a file as a schedule the runner takes. Pure: no I/O.
"""

from __future__ import annotations

import csv
import io
import re

from pipeq.errors import ScheduleError
from pipeq.schedules.actions import COMPUTE_OPS, STEP, Action, Op, Schedule, lower, lower_process
from pipeq.schedules.dryrun import check_consistency, dry_run
from pipeq.schedules.placement import PLACEMENTS, _check_placement, process_chunk, stage_index, stages_of
from pipeq.schedules.protocol import SchedulePolicy

__all__ = ["PLACEMENTS", "stage_index", "process_chunk", "dumps", "loads", "CsvSchedule"]

_CELL = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B|OVERLAP_F_B)(\d*)")
_COMPUTE = {"F": Op.FORWARD, "I": Op.INPUT_GRAD, "W": Op.WEIGHT_GRAD, "B": Op.BACKWARD}
_SKIPPED = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
_Where = tuple[int, int, str]  # (row, column, cell text)


def dumps(plan: Schedule, placement: str = "loop") -> str:
    """A plan (compute or lowered action lists, one per process) as TDP's compute-only CSV text."""
    n = len(plan)
    out = io.StringIO()
    writer = csv.writer(out)
    for k, acts in enumerate(plan):
        writer.writerow([f"{stage_index(k, a.chunk, n, placement)}{a.op.value}{a.microbatch}"
                         for a in acts if a.op in COMPUTE_OPS and a.op is not Op.STEP])
    return out.getvalue()


def _parse_cell(cell: str, row: int, col: int, n: int, placement: str) -> Action | None:
    """One cell as an action of process ``row`` (None: idle or TDP's bookkeeping)."""
    text = cell.strip()
    if not text:
        return None
    where = f"row {row} (process {row}), column {col} (step {col}), {text!r}"
    match = _CELL.fullmatch(text)
    if match is None:
        raise ScheduleError(f"{where}: not an action (stage, F/I/B/W, microbatch: e.g. 0F1)")
    stage, kind, mb = int(match[1]), match[2], match[3]
    if kind in _SKIPPED:
        return None
    if kind not in _COMPUTE:
        raise ScheduleError(f"{where}: {kind} is a communication or overlap action (TDP's compute_comms "
                            "format); pipeq reads the compute-only format and derives the messages")
    if not mb:
        raise ScheduleError(f"{where}: {kind} needs a microbatch index")
    process, chunk = process_chunk(stage, n, placement)
    if process != row:
        raise ScheduleError(f"{where}: stage {stage} is on process {process} ({placement} placement), "
                            f"not on this row's process {row}")
    return Action(_COMPUTE[kind], int(mb), chunk)


def _read(text: str, n: int, placement: str) -> tuple[Schedule, list[list[_Where]]]:
    rows = list(csv.reader(io.StringIO(text)))
    while rows and not any(c.strip() for c in rows[-1]):
        rows.pop()  # trailing blank lines
    if len(rows) != n:
        raise ScheduleError(f"the CSV has {len(rows)} rows for {n} processes (one row per process)")
    plan: Schedule = []
    where: list[list[_Where]] = []
    for r, row in enumerate(rows):
        acts, at = [], []
        for c, cell in enumerate(row):
            a = _parse_cell(cell, r, c, n, placement)
            if a is not None:
                acts.append(a)
                at.append((r, c, cell.strip()))
        plan.append(acts)
        where.append(at)
    return plan, where


def _virtual(plan: Schedule, where: list[list[_Where]], n: int, chunks: int,
             placement: str) -> tuple[Schedule, list[list[_Where]]]:
    """Every virtual stage's actions (as chunk 0, a STEP last), by TDP stage index."""
    stages: Schedule = [[] for _ in range(n * chunks)]
    at: list[list[_Where]] = [[] for _ in range(n * chunks)]
    for k, acts in enumerate(plan):
        for a, w in zip(acts, where[k]):
            s = stage_index(k, a.chunk, n, placement)
            stages[s].append(Action(a.op, a.microbatch))
            at[s].append(w)
    for s in range(n * chunks):
        stages[s].append(STEP)
        at[s].append((process_chunk(s, n, placement)[0], -1, "STEP"))
    return stages, at


def _locate(exc: ScheduleError, at: list[list[_Where]]) -> ScheduleError:
    """``exc`` (naming a stage's action by position) naming the CSV's row, column and cell."""
    found = re.search(r"stage (\d+), action (\d+)", str(exc))
    if found is None or int(found[2]) >= len(at[int(found[1])]) - 1:
        stage = re.search(r"stage (\d+)", str(exc))
        if stage is None or int(stage[1]) >= len(at):
            return ScheduleError(f"the CSV: {exc}")
        r = at[int(stage[1])][-1][0]
        return ScheduleError(f"row {r} (process {r}), TDP stage {stage[1]}: {exc}")
    r, c, text = at[int(found[1])][int(found[2])]
    return ScheduleError(f"row {r} (process {r}), column {c} (step {c}), {text!r}: {exc}")


def _locate_deadlock(exc: ScheduleError, plan: Schedule, where: list[list[_Where]]) -> ScheduleError:
    """A deadlock naming every blocked row's cell: the action that waits for the message."""
    cells = []
    for k, kind, j in re.findall(r"stage (\d+) waits for the (act|grad) of microbatch (\d+)", str(exc)):
        ops = (Op.FORWARD,) if kind == "act" else (Op.BACKWARD, Op.INPUT_GRAD)
        for a, (r, c, text) in zip(plan[int(k)], where[int(k)]):
            if a.op in ops and a.microbatch == int(j):
                cells.append(f"row {r} (process {r}), column {c} (step {c}), {text!r}")
                break
    return ScheduleError(f"{exc} (waiting: {'; '.join(cells)})" if cells else f"the CSV: {exc}")


def loads(text: str, n_processes: int, placement: str = "loop", n_microbatches: int | None = None) -> Schedule:
    """TDP compute-only CSV text as pipeq's per-process compute action lists (STEP last),
    checked (see the module docstring). ``n_microbatches``: the count the file must cover
    (default: as many as it names)."""
    _check_placement(placement)
    if type(n_processes) is not int or n_processes < 1:
        raise ScheduleError(f"need at least one process, got n_processes={n_processes!r}")
    plan, where = _read(text, n_processes, placement)
    named = [a.microbatch for acts in plan for a in acts]
    if not named:
        raise ScheduleError("the CSV names no compute action")
    m = n_microbatches if n_microbatches is not None else max(named) + 1
    chunks = 2 if placement == "v" else max(a.chunk for acts in plan for a in acts) + 1
    stages, at = _virtual(plan, where, n_processes, chunks, placement)
    try:
        check_consistency(stages, len(stages), m, training=True)
    except ScheduleError as exc:
        raise _locate(exc, at) from None
    if chunks == 1:
        full = [acts + [STEP] for acts in plan]
        try:
            dry_run(lower(full))
        except ScheduleError as exc:
            raise _locate_deadlock(exc, plan, where) from None
        return full
    full = [acts + [Action(Op.STEP, -1, c) for c in range(chunks)] for acts in plan]
    held = [stages_of(p, n_processes, chunks, placement) for p in range(n_processes)]
    try:
        dry_run([lower_process(acts, held[p], n_processes * chunks) for p, acts in enumerate(full)], stages=held)
    except ScheduleError as exc:
        raise ScheduleError(f"the CSV ({placement} placement): {exc}") from None
    return full


class CsvSchedule(SchedulePolicy):
    """A TDP CSV's plan as a schedule: plain backprop, the plan fixed by the file, so it runs only
    with the file's process and microbatch counts. A file of several stages per process (stage
    indices beyond its rows) runs them in ``placement`` (``"loop"``, or ``"v"`` for ZBV and
    DualPipeV files). ``label`` names it in traces (e.g. its path)."""

    def __init__(self, text: str, label: str = "csv", placement: str = "loop") -> None:
        self.text, self.name = text, label
        rows = [r for r in csv.reader(io.StringIO(text)) if any(c.strip() for c in r)]
        self._plan = loads(text, len(rows), placement)
        self.n_processes = len(self._plan)
        self.stages_per_process = 1 + max(a.chunk for acts in self._plan for a in acts)
        self.placement = placement
        self.n_stages = self.n_processes * self.stages_per_process
        self.n_microbatches = 1 + max(a.microbatch for acts in self._plan for a in acts)

    def plan(self, n_stages: int, n_microbatches: int) -> Schedule:
        if (n_stages, n_microbatches) != (self.n_processes, self.n_microbatches):
            what = "stages" if self.stages_per_process == 1 else f"processes of {self.stages_per_process} stages"
            raise ScheduleError(f"schedule {self.name!r} is a CSV of {self.n_processes} {what} x "
                                f"{self.n_microbatches} microbatches; the run has {n_stages} x {n_microbatches}")
        return [list(acts) for acts in self._plan]

    @property
    def options(self) -> dict:
        return {"csv": self.text, "placement": self.placement}

    @property
    def label(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"CsvSchedule({self.name!r})"
