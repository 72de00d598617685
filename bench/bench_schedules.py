#!/usr/bin/env python
"""pipeq's schedules side by side with torch.distributed.pipelining's (TDP), against their ideal.

    PYTHONPATH=. python bench/bench_schedules.py        # both cost sets + real compute, ~6-8 min
    PYTHONPATH=. python bench/bench_schedules.py --costs 5,5,5 --part sleep --steps 10   # ~3 min
    PYTHONPATH=. python bench/bench_schedules.py --only 1f1b --only tdp:zbv --json runs/schedules.json
    PYTHONPATH=. python bench/bench_schedules.py --fiw                  # issue 41's F/I/W harness, ~4 min idle
    PYTHONPATH=. python bench/bench_schedules.py --fiw --processes 2    # 2 processes on 2 cores

(from the repository root: ``PYTHONPATH=.`` measures this checkout's pipeq, not an installed one).

What it measures. **sleep**: N = 4 processes, m = 8 microbatches of 8 x 16, ``pipeq.testing.SleepStage``
chunks whose forward (F), input gradient (I) and weight gradient (W) each sleep their own time
(``--costs F,I,W`` in ms per *process*, default ``5,5,5 1,1,1``). The per-process work is constant:
a 1-chunk schedule cuts the model into 4 stages sleeping F/I/W each; a 2-chunk schedule
(interleaved-1f1b, looped-bfs: looped placement, process p holds stages p and p+4; zbv, dualpipev:
V placement, p holds p and 7-p) cuts the same model into 8 chunks sleeping F/2, I/2, W/2 each.
A schedule with a whole backward (B) sleeps I + W; stage 0 has no input gradient, so its I sleeps
nothing (pipeq's and TDP's split backward both skip it) and the ideal counts it as 0. A sleep costs
no CPU: four processes on two cores overlap perfectly, so what is measured is the schedule plus each
runtime's overhead. **mlp** (real compute): 4 x (Linear(512, 512) + ReLU), batch 64, m = 8,
MSELoss, SGD, one thread per process, 5x the sleep part's steps (they are short): 1f1b and zb-h1
on 2 processes x 1 stage (2 blocks each) against interleaved-1f1b and zbv on 2 processes x 2
chunks (1 block each).

Each row is one schedule on one side. pipeq: ``PipelineRunner(stages, schedule=name,
microbatches=8, threads_per_stage=1, start_method="forkserver")`` in process mode, inside one
spawned child (its stages are grandchildren); a 2-chunk schedule gets 8 stages (and
``stages_per_process`` where the runtime takes it). TDP: the schedule's class on gloo, N ranks
spawned on 127.0.0.1 with a free port, one thread each, pinned to core r mod ncpu
(``bench/tdp_runner.py``). Every schedule runs in fresh processes: ``--warmup`` steps, then
``--steps`` timed ones (TDP: zero_grad, step, opt.step, a barrier; pipeq: ``runner.step``).

Columns: **step ms** the median timed step; **ideal ms** the critical path of pipeq's plan of that
schedule with those costs (``pipeq.schedules.dry_run``: each process runs its actions in order,
messages instant), or, marked ``*``, of TDP's own order where pipeq has no such schedule; **TDP
order** the critical path of the TDP class's own compute order (its ``pipeline_order``, read as
pipeq reads a TDP CSV and dry-run alike; "-" for the single-stage classes, which keep none); **step/ideal** how far from its plan a runtime gets (1.00 = no
overhead); **vs 1F1B** steps/s against the same side's 1F1B in the same config (> 1: faster).
**update L1** how far the run's training moved the parameters (sum of |p_end - p_start| after all
warm-up and timed steps): rows of one config that cut the model alike train the same parameters on
the same data with the same SGD, so they must agree up to float rounding (a schedule that dropped a
W would not). The MLP's 1-chunk and 2-chunk cuts hold the same layers, so all its rows agree; 8
sleep chunks hold 8 biases where 4 stages hold 4, so there the 2-chunk rows agree among themselves.
A row reads "n/a (not in this build)" when pipeq has no schedule of that name yet, "error: ..."
when a run failed (the exception's first line). The machine is shared: compare rows of one run.

**--fiw** (issue 41's harness): F, I and W each ``--fiw-ms`` (default 4) ms per process (a
2-chunk schedule's chunk sleeps half), m = 8, ``--processes`` (default 4; 2: no
oversubscription on 2 cores) processes, for 1f1b, zb-h1, interleaved-1f1b, zbv and dualpipev and
TDP's class of each, in ``--rounds`` (default 2) alternating rounds: pipeq's rows (one child),
then TDP's, then pipeq's again... Each cell: the median step over every round's timed steps, the
range of the rounds' medians when they differ, and step over the schedule's own ideal (pipeq's
plan of it with these costs, for both sides: the same work, the same bound); **vs 1F1B** is the
side's 1F1B step over this row's (the speed-up the schedule brings on that runtime).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_core as bc  # noqa: E402  (bench/ on the path first)
import tdp_runner  # noqa: E402

from pipeq import schedules  # noqa: E402
from pipeq.schedules import Op  # noqa: E402
from pipeq.schedules import tdp_csv  # noqa: E402
from pipeq.schedules.actions import lower_process  # noqa: E402
from pipeq.schedules.placement import stages_of  # noqa: E402
from pipeq.testing import SleepStage  # noqa: E402

N, M, WIDTH, MB_ROWS = 4, 8, 16, 8
MLP_WIDTH, MLP_BLOCKS, MLP_BATCH, MLP_PROCS = 512, 4, 64, 2
MLP_STEPS_X = 5  # the MLP's steps are short (10-40 ms): it runs this many times --steps and --warmup
#: (pipeq schedule name, TDP class of the same schedule or None)
SLEEP_ROWS = [("fill-drain", "ScheduleGPipe"), ("1f1b", "Schedule1F1B"), ("zb-h1", "ScheduleInterleavedZeroBubble"),
              ("interleaved-1f1b", "ScheduleInterleaved1F1B"), ("looped-bfs", "ScheduleLoopedBFS"),
              ("zb-h2", None), ("zbv", "ScheduleZBVZeroBubble"), ("dualpipev", "ScheduleDualPipeV"),
              ("auto", None), ("auto-v2", None)]
MLP_ROWS = [("1f1b", "Schedule1F1B"), ("zb-h1", "ScheduleInterleavedZeroBubble"),
            ("interleaved-1f1b", "ScheduleInterleaved1F1B"), ("zbv", "ScheduleZBVZeroBubble"),
            ("auto", None), ("auto-v2", None)]
#: issue 41's F/I/W harness: the modern schedules and TDP's class of each
FIW_ROWS = [("1f1b", "Schedule1F1B"), ("zb-h1", "ScheduleInterleavedZeroBubble"),
            ("interleaved-1f1b", "ScheduleInterleaved1F1B"), ("zbv", "ScheduleZBVZeroBubble"),
            ("dualpipev", "ScheduleDualPipeV")]
#: schedule="auto" rows: the model in 4 stages (one per process), or in 8 (two per process)
AUTO = {"auto": 1, "auto-v2": 2}


# ---------------------------------------------------------------------------------------------
# Stage factories: module level, picklable, (stage index, number of stages) -> nn.Module
# ---------------------------------------------------------------------------------------------
class SleepChunks:
    """Stage s of n: a SleepStage whose F/I/W (seconds per process) are split over n / N chunks."""

    def __init__(self, f: float, i: float, w: float, n_procs: int = N) -> None:
        self.f, self.i, self.w, self.n_procs = f, i, w, n_procs

    def __call__(self, s: int, n: int) -> nn.Module:
        v = n // self.n_procs
        return SleepStage(WIDTH, self.f / v, self.i / v, weight_s=self.w / v)


class MlpChunks:
    """Stage s of n: its share of 4 x (Linear(512) + ReLU), the same weights however it is cut."""

    def __call__(self, s: int, n: int) -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(MLP_BLOCKS):
            layers += [nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()]
        per = len(layers) // n
        return nn.Sequential(*layers[s * per:(s + 1) * per])


# ---------------------------------------------------------------------------------------------
# Ideals: the critical path of a schedule's plan with given costs
# ---------------------------------------------------------------------------------------------
def chunk_costs(costs: tuple[float, float, float], stage: int, chunks: int) -> dict[Op, float]:
    """One chunk's F, I, W, B (ms): the process's costs / chunks; stage 0 has no input gradient."""
    f, i, w = (c / chunks for c in costs)
    i = 0.0 if stage == 0 else i
    return {Op.FORWARD: f, Op.INPUT_GRAD: i, Op.WEIGHT_GRAD: w, Op.BACKWARD: i + w, Op.STEP: 0.0}


def _critical_path(lowered: list, v: int, placement: str, costs: tuple[float, float, float]) -> float:
    """The step's length (ms) of a lowered plan (one list per process) at these per-process costs:
    pipeq's own dry run, each model stage costing its chunk's share."""
    n = len(lowered)
    held = [stages_of(p, n, v, placement) for p in range(n)]
    per_stage = [chunk_costs(costs, s, v) for s in range(n * v)]
    timeline = schedules.dry_run(lowered, cost=per_stage, stages=held)
    return max(t + per_stage[held[k][a.chunk]][a.op] for k, row in enumerate(timeline) for t, a in row)


def layout(name: str) -> tuple[int, str]:
    """(chunks per process, placement) of a row: its schedule's, or an auto row's stages per process."""
    if name in AUTO:
        return AUTO[name], "loop"
    policy = schedules.resolve(name)
    return policy.stages_per_process, policy.placement


def pipeq_ideal(name: str, n: int, m: int, costs: tuple[float, float, float]) -> float | None:
    """The critical path (ms) of pipeq's plan of ``name`` on ``n`` processes (None: not in this build)."""
    if not isinstance(schedules.SCHEDULES.get(name), schedules.SchedulePolicy):
        return None
    v, placement = layout(name)
    return _critical_path(schedules.build(name, n * v, m), v, placement, costs)


def order_ideal(order: list[list[tuple[int, str, int]]] | None, m: int, costs: tuple[float, float, float],
                placement: str = "loop") -> float | str | None:
    """The critical path (ms) of TDP's own compute order, read as pipeq reads a TDP CSV and
    dry-run (None: the class keeps none; a string: why it cannot be what the class runs)."""
    if not order:
        return None
    text = "\n".join(",".join(f"{s}{op}{j}" for s, op, j in acts) for acts in order) + "\n"
    try:
        plan = tdp_csv.loads(text, len(order), placement, n_microbatches=m)
        v = 1 + max(a.chunk for acts in plan for a in acts)
        held = [stages_of(p, len(plan), v, placement) for p in range(len(plan))]
        lowered = [lower_process(acts, held[p], len(plan) * v) for p, acts in enumerate(plan)]
        return _critical_path(lowered, v, placement, costs)
    except schedules.ScheduleError as e:
        return str(e)[:200]


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------
def _runner_extra(v: int) -> dict[str, Any]:
    """``stages_per_process`` for a 2-chunk schedule where the runtime takes it as a setting."""
    from pipeq.control import config

    known = {f.name for cls in (config.PlacementConfig, config.RunConfig) for f in dataclasses.fields(cls)}
    return {"stages_per_process": v} if v > 1 and "stages_per_process" in known else {}


def child_pipeq(rank: int, world: int, names: list[str], make: Callable, n_procs: int, x: torch.Tensor,
                y: torch.Tensor, warmup: int, steps: int) -> dict[str, dict]:
    """Each schedule in its own PipelineRunner (process mode); times (s) or the error."""
    bc._threads(1)
    import pipeq

    out: dict[str, dict] = {}
    for name in names:
        v, _ = layout(name)
        try:
            stages = [make(s, v * n_procs) for s in range(v * n_procs)]
            start = [p.detach().clone() for st in stages for p in st.parameters()]
            runner = pipeq.PipelineRunner(stages, nn.MSELoss(),
                                          functools.partial(torch.optim.SGD, lr=0.01),
                                          schedule="auto" if name in AUTO else name,
                                          microbatches=M, threads_per_stage=1, start_method="forkserver",
                                          **_runner_extra(v))
            times = []
            with runner:
                for _ in range(warmup + steps):
                    t0 = time.perf_counter()
                    runner.step(x, y)
                    times.append(time.perf_counter() - t0)
                end = list(runner.state_dict().values())
            update = sum(float((p - p0).abs().double().sum()) for p, p0 in zip(end, start))
            out[name] = {"times": times[warmup:], "update": update}
            if name in AUTO:  # which schedule it chose
                out[name]["chose"] = runner.schedule.name
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"}
    return out


def run_pipeq(names: list[str], make: Callable, n_procs: int, x: torch.Tensor, y: torch.Tensor,
              a: argparse.Namespace) -> dict[str, dict]:
    if not names:
        return {}
    try:
        return bc.run_group("pipeq", child_pipeq, 1, lambda _r: (names, make, n_procs, x, y, a.warmup, a.steps),
                            a.timeout * len(names))[0]
    except bc.BenchError as e:
        return {name: {"error": str(e).strip().splitlines()[0][:200]} for name in names}


def run_tdp(cls: str, make: Callable, n_procs: int, x: torch.Tensor, y: torch.Tensor, a: argparse.Namespace) -> dict:
    try:
        return tdp_runner.run_tdp(cls, make, n_procs, x, y, M, a.warmup, a.steps, a.timeout,
                                  bc.run_group, bc.free_port)
    except bc.BenchError as e:
        lines = str(e).strip().splitlines()
        return {"error": (lines[-1] if len(lines) > 1 else lines[0])[:200]}


def wanted(only: list[str] | None, side: str, name: str) -> bool:
    """``--only NAME`` picks both sides' row of a schedule, ``--only pipeq:NAME`` / ``tdp:NAME`` one."""
    return not only or name in only or f"{side}:{name}" in only


def measure(config: str, rows: list[tuple[str, str | None]], make: Callable, n_procs: int,
            costs: tuple[float, float, float] | None, data: tuple[torch.Tensor, torch.Tensor],
            a: argparse.Namespace) -> list[dict]:
    """Every selected row of one configuration, measured: pipeq's, then TDP's."""
    x, y = data
    registered = [n for n, _ in rows if n in AUTO or n in schedules.SCHEDULES]
    t0 = time.monotonic()
    got = run_pipeq([n for n in registered if wanted(a.only, "pipeq", n)], make, n_procs, x, y, a)
    print(f"  .. {config}: pipeq rows in {time.monotonic() - t0:.0f} s", flush=True)
    out = []
    for name, cls in rows:
        chose = got.get(name, {}).get("chose")  # schedule="auto": the ideal of what it chose
        ideal = pipeq_ideal(chose or name, n_procs, M, costs) if costs and (chose or name not in AUTO) else None
        if wanted(a.only, "pipeq", name):
            res = got.get(name, {"status": "n/a (not in this build)"})
            out.append(_row(config, name, "pipeq", "PipelineRunner", res, ideal, None))
        if cls and wanted(a.only, "tdp", name):
            t0 = time.monotonic()
            res = run_tdp(cls, make, n_procs, x, y, a)
            print(f"  .. {config}: TDP {cls} in {time.monotonic() - t0:.0f} s", flush=True)
            own = order_ideal(res.get("order"), M, costs, layout(name)[1]) if costs else None
            out.append(_row(config, name, "tdp", cls, res, ideal, own))
    for r in out:
        base = next((b for b in out if b["side"] == r["side"] and b["schedule"] == "1f1b" and b["step_ms"]), None)
        r["vs_1f1b"] = base["step_ms"] / r["step_ms"] if base and r["step_ms"] else None
    return out


def _row(config: str, name: str, side: str, impl: str, res: dict, ideal: float | None, own: float | None) -> dict:
    times = res.get("times")
    impl = f"{impl} (chose {res['chose']})" if res.get("chose") else impl
    step = 1e3 * statistics.median(times) if times else None
    status = res.get("status") or (f"error: {res['error']}" if "error" in res else "ok")
    problem = own if isinstance(own, str) else None
    own = None if problem else own
    starred = ideal is None and own is not None
    ideal = own if starred else ideal
    return {"config": config, "schedule": name, "side": side, "impl": impl, "status": status, "step_ms": step,
            "ideal_ms": ideal, "ideal_from_tdp_order": starred, "tdp_order_ideal_ms": own, "tdp_order_problem": problem,
            "step_over_ideal": step / ideal if step and ideal else None,
            "update_l1": res.get("update"), "times_ms": [1e3 * t for t in times] if times else None}


# ---------------------------------------------------------------------------------------------
# Output and main
# ---------------------------------------------------------------------------------------------
def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def table(rows: list[dict]) -> str:
    cells = []
    for r in rows:
        ideal = _ms(r["ideal_ms"]) + ("*" if r["ideal_from_tdp_order"] else "")
        if r["status"] != "ok":
            cells.append([r["config"], r["schedule"], r["side"], r["impl"], r["status"], ideal, "", "", "", ""])
            continue
        cells.append([r["config"], r["schedule"], r["side"], r["impl"], _ms(r["step_ms"]), ideal,
                      ("bad" if r["tdp_order_problem"] else _ms(r["tdp_order_ideal_ms"])) if r["side"] == "tdp" else "",
                      "-" if r["step_over_ideal"] is None else f"{r['step_over_ideal']:.2f}",
                      "-" if r["vs_1f1b"] is None else f"{r['vs_1f1b']:.2f}",
                      "-" if r.get("update_l1") is None else f"{r['update_l1']:.5g}"])
    head = ["config", "schedule", "side", "implementation", "step ms", "ideal ms", "TDP order", "step/ideal",
            "vs 1F1B", "update L1"]
    return bc._table(head, cells)


def parse_costs(text: str) -> tuple[float, float, float]:
    parts = text.split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"costs are F,I,W in ms (e.g. 5,5,5), got {text!r}")
    try:
        f, i, w = (float(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"costs are three numbers F,I,W in ms, got {text!r}") from None
    if min(f, i, w) < 0:
        raise argparse.ArgumentTypeError(f"costs must be >= 0, got {text!r}")
    return f, i, w


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--costs", nargs="+", type=parse_costs, default=[(5.0, 5.0, 5.0), (1.0, 1.0, 1.0)],
                   help="F,I,W ms per process, one set per configuration (default: 5,5,5 1,1,1)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per row (default 3)")
    p.add_argument("--only", action="append", metavar="NAME",
                   help="rows to run: a schedule (both sides) or pipeq:NAME / tdp:NAME; repeatable")
    p.add_argument("--part", choices=("sleep", "mlp", "both"), default="both")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per row before it counts as hung")
    p.add_argument("--json", metavar="PATH", help="also write the rows (with every step time) as JSON")
    p.add_argument("--fiw", action="store_true", help="issue 41's F/I/W harness, alternating rounds (see above)")
    p.add_argument("--fiw-ms", type=float, default=4.0, help="--fiw: F = I = W ms per process (default 4)")
    p.add_argument("--processes", type=int, default=N, help="--fiw: stage processes (default 4)")
    p.add_argument("--rounds", type=int, default=2, help="--fiw: alternating rounds (default 2)")
    return p.parse_args(argv)


def sleep_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(M * MB_ROWS, WIDTH, generator=g), torch.randn(M * MB_ROWS, WIDTH, generator=g)


def mlp_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(MLP_BATCH, MLP_WIDTH, generator=g), torch.randn(MLP_BATCH, MLP_WIDTH, generator=g)


def fiw_rounds(a: argparse.Namespace) -> dict[tuple[str, str], dict]:
    """Issue 41's harness in ``a.rounds`` alternating rounds: per (schedule, side), every round's
    result (times or error), plus the ideal."""
    n, ms = a.processes, a.fiw_ms
    costs = (ms, ms, ms)
    make = SleepChunks(ms / 1e3, ms / 1e3, ms / 1e3, n_procs=n)
    rows = [(name, cls) for name, cls in FIW_ROWS if wanted(a.only, "pipeq", name) or wanted(a.only, "tdp", name)]
    out: dict[tuple[str, str], dict] = {}
    for name, cls in rows:
        ideal = pipeq_ideal(name, n, M, costs)
        for side in ("pipeq", "tdp"):
            out[(name, side)] = {"ideal_ms": ideal, "rounds": [], "impl": "PipelineRunner" if side == "pipeq" else cls}
    for r in range(a.rounds):
        t0 = time.monotonic()
        got = run_pipeq([name for name, _ in rows if wanted(a.only, "pipeq", name)], make, n, *sleep_data(), a)
        for name, res in got.items():
            out[(name, "pipeq")]["rounds"].append(res)
        print(f"  .. round {r + 1}: pipeq rows in {time.monotonic() - t0:.0f} s", flush=True)
        for name, cls in rows:
            if cls and wanted(a.only, "tdp", name):
                t0 = time.monotonic()
                out[(name, "tdp")]["rounds"].append(run_tdp(cls, make, n, *sleep_data(), a))
                print(f"  .. round {r + 1}: TDP {cls} in {time.monotonic() - t0:.0f} s", flush=True)
    return out


def _fiw_cell(res: dict) -> tuple[str, float | None]:
    """'155.6 ms, 1.18x' (with the rounds' range when they differ) and the median step (ms)."""
    rounds = [r for r in res["rounds"] if r.get("times")]
    if not rounds:
        errs = [r.get("error") or r.get("status") for r in res["rounds"]]
        return (f"error: {errs[0]}" if errs and errs[0] else "not run"), None
    step = 1e3 * statistics.median([t for r in rounds for t in r["times"]])
    meds = [1e3 * statistics.median(r["times"]) for r in rounds]
    ideal = res["ideal_ms"]
    lo, hi = min(meds), max(meds)
    text = f"{step:.1f} ms" + (f" ({lo:.1f}-{hi:.1f})" if len(meds) > 1 else "")
    if ideal:
        text += f", {step / ideal:.2f}x" + (f" ({lo / ideal:.2f}-{hi / ideal:.2f})" if len(meds) > 1 else "")
    return text, step


def fiw_table(out: dict[tuple[str, str], dict], a: argparse.Namespace) -> str:
    names = list(dict.fromkeys(name for name, _ in out))
    cells, steps = {}, {}
    for key, res in out.items():
        cells[key], steps[key] = _fiw_cell(res)
    rows = []
    for name in names:
        ideal = out[(name, "pipeq")]["ideal_ms"]
        row = [name, _ms(ideal)]
        for side in ("pipeq", "tdp"):
            res = out[(name, side)]
            if side == "tdp" and not res["rounds"]:
                row += ["(TDP has no such class)" if res["impl"] is None else "not run", ""]
                continue
            base, mine = steps.get(("1f1b", side)), steps.get((name, side))
            row += [cells[(name, side)], f"{base / mine:.2f}" if base and mine else "-"]
        rows.append(row)
    head = ["schedule", "ideal ms", "pipeq: step, step/ideal", "vs 1F1B", "TDP: step, step/ideal", "vs 1F1B"]
    note = (f"  F/I/W harness: {a.processes} processes, m={M}, F=I=W={a.fiw_ms:g} ms per process (2-chunk schedules: "
            f"half per chunk); {a.rounds} alternating rounds of {a.warmup} warm-up + {a.steps} timed steps; "
            "median step over all rounds (range of the rounds' medians); ideal = pipeq's plan with these costs")
    return bc._table(head, rows) + "\n" + note


def fiw_main(a: argparse.Namespace) -> int:
    print(f"issue 41 F/I/W harness, pipeq vs TDP {torch.__version__}: {a.processes} processes, {a.rounds} rounds; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    try:
        out = fiw_rounds(a)
    finally:
        bc.cleanup_children()
    print()
    print(fiw_table(out, a))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"torch": torch.__version__, "processes": a.processes, "fiw_ms": a.fiw_ms, "rounds": a.rounds,
                       "steps": a.steps, "warmup": a.warmup,
                       "rows": [{"schedule": k[0], "side": k[1], **v} for k, v in out.items()]}, fh, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    bc._become_subreaper()
    torch.set_num_threads(1)
    if a.fiw:
        return fiw_main(a)
    print(f"pipeq vs torch.distributed.pipelining {torch.__version__}: {a.warmup} warm-up + {a.steps} timed steps "
          f"per row; load average {os.getloadavg()[0]:.1f}", flush=True)
    rows: list[dict] = []
    try:
        if a.part in ("sleep", "both"):
            for costs in a.costs:
                f, i, w = costs
                config = f"sleep {f:g}/{i:g}/{w:g}"
                make = SleepChunks(f / 1e3, i / 1e3, w / 1e3)
                rows += measure(config, SLEEP_ROWS, make, N, costs, sleep_data(), a)
        if a.part in ("mlp", "both"):
            a = argparse.Namespace(**{**vars(a), "steps": a.steps * MLP_STEPS_X, "warmup": a.warmup * MLP_STEPS_X})
            rows += measure(f"mlp {MLP_WIDTH}", MLP_ROWS, MlpChunks(), MLP_PROCS, None, mlp_data(), a)
    finally:
        bc.cleanup_children()
    print()
    print(table(rows))
    print("  sleep: N=4 processes, m=8, F/I/W ms per process (2-chunk schedules: 8 chunks of half that); "
          "mlp: 2 processes, 4 x Linear(512)+ReLU, batch 64, m=8\n"
          "  * ideal from TDP's own order (pipeq has no such schedule in this build); "
          "vs 1F1B = steps/s over the same side's 1F1B")
    problems = {r["impl"]: r["tdp_order_problem"] for r in rows if r.get("tdp_order_problem")}
    for impl, why in problems.items():
        print(f"  TDP order 'bad': {impl}.pipeline_order is not what it runs: {why}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"torch": torch.__version__, "steps": a.steps, "warmup": a.warmup, "mlp_steps_x": MLP_STEPS_X,
                       "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
