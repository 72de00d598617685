#!/usr/bin/env python
"""pipeq on a CUDA GPU: a GPT's step against one process, CUDA IPC bandwidth, the per-slot cost, memory.

    PYTHONPATH=. python bench/bench_gpu.py --json runs/bench_gpu.json     # one GPU or more, ~2-3 min
    PYTHONPATH=. python bench/bench_gpu.py --device cpu --quick           # the same on the CPU, tiny, seconds
    PYTHONPATH=. python bench/bench_gpu.py --parts gpt,memory             # some parts only

(from the repository root: ``PYTHONPATH=.`` measures this checkout's pipeq). Four parts, each timed
on its own; a part (or a run within one) that fails prints its error and the others still run. The
JSON (``--json PATH``, rewritten after every part, so a run cut short keeps what it measured) holds
every figure, and per part ``status`` ("ok", "failed: ...", "skipped: ...").

1. **gpt**: a GPT-style model (examples/gpt.py's blocks between a learned embedding and a head; ``--d-model`` 1024, ``--layers`` 8, 16 heads, sequence 1024, vocabulary
   256, batch 8 in 8 microbatches of one sequence, AdamW, bf16 autocast) trained by a plain torch loop in
   this process (the whole batch at once), then by pipeq (``precision="bf16"``) with 2 and 4 processes
   on ``cuda:0`` (``devices=["cuda:0"] * stages``) for 1F1B, ZB-H1 and ZBV (ZBV: 2 stages per process,
   so 2N stages), and, on a machine with several GPUs, 1F1B with its stages spread over them. Each row:
   the median step (ms) over ``--steps`` steps after ``--warmup``, its ratio to one process, and the
   largest difference of its losses from one process's (same weights, same batches). **On one GPU
   the stages share it: the ratio measures pipeq's overhead, not a speed-up.** Beside them: the one
   process run the way pipeq runs it (``one process, microbatches``: the same microbatches one after
   another, their gradients accumulated, one step: what a pipeline on one device can at best match);
   pipeq with every stage in one process (``interleaved-1f1b``, ``stages_per_process`` = all:
   pipeq's own overhead, without processes time-slicing the device); and 1F1B, ZB-H1 and ZBV
   compiled (``compile=``, inductor; ``--quick``: Dynamo's ``eager`` backend, the same path through
   the script in seconds) on the smaller process count.
2. **ipc**: one-way bandwidth of an activation between two stage processes on one GPU (``transport="ipc"``:
   CUDA tensors go through CUDA IPC slots). A 2-stage pipeline whose stage 0 widens a one-number
   input into an activation of 1, 16 or 256 MiB (float32, on the GPU) and whose stage 1 sums it; a
   forward-only ``runner.evaluate`` moves it once, stage 0 to stage 1. ``eval ms``: its median;
   ``transfer ms``: that minus the same pipeline's at 4 KiB (None when noise hides it); ``GiB/s``:
   size / transfer; ``GiB/s whole``: size / eval (a lower bound). Beside it, ``copy GiB/s``: a
   device-to-device ``copy_`` of the same size in one process, timed with CUDA events.
3. **slots**: the per-slot fixed cost. 4 processes, 8 microbatches of 8 x 16, stages whose forward,
   input gradient and weight gradient each spin the GPU ``--sleep-ms`` (2) ms with
   ``torch.cuda._sleep`` (cycles calibrated here with CUDA events; ZBV's 8 chunks spin half each, as
   bench_schedules.py's sleep stages do). ``ideal ms``: the critical path of pipeq's plan of the
   schedule at those costs (``pipeq.schedules.dry_run``, messages instant); ``slots``: the actions
   on that critical path (the dry run at one unit per action); ``ms/slot`` = (step - ideal) / slots.
   The stages' kernels share one GPU (time-sliced between processes without MPS), as part 1's do.
4. **memory**: ``runner.memory()`` of every part-1 run, per stage: ``activation_peak_bytes``,
   ``predicted_activation_bytes``, ``device_peak_bytes`` (the allocator's peak; None on the CPU).

``--device cpu --quick`` runs the same code on the CPU at a tiny size (d_model 32, 4 layers, sequence
16, 2 timed steps; ipc at 1 and 16 MiB against a CPU ``copy_``; slots with pipeq.testing's sleep
stages) in seconds: the smoke test runs it so that the script cannot rot. ``--device cuda`` on a
machine without CUDA exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [BENCH, ROOT]  # bench_schedules; examples.gpt, importable in the stage processes too (PYTHONPATH)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
import bench_schedules as bs
from examples.gpt import Block  # noqa: E402  (the example's pre-norm block: causal SDPA attention, 4x GELU MLP)

from pipeq import schedules
from pipeq.schedules import Op
from pipeq.schedules.placement import stages_of
from pipeq.testing import SleepStage

PARTS = ("gpt", "ipc", "slots", "memory")
SCHEDULES = ("1f1b", "zb-h1", "zbv")
MIB = 1 << 20


@dataclass(frozen=True)
class Sizes:
    d_model: int = 1024
    layers: int = 8
    heads: int = 16
    seq: int = 1024
    vocab: int = 256
    batch: int = 8
    microbatches: int = 8
    warmup: int = 2
    steps: int = 5
    gpt_procs: tuple = (2, 4)
    ipc_mib: tuple = (1, 16, 256)
    ipc_reps: int = 10
    sleep_ms: float = 2.0
    slot_procs: int = 4
    slot_microbatches: int = 8
    slot_steps: int = 5
    budget_s: float = 200.0  # runs not started by then are skipped (the GPU check allows 240 s)
    run_limit_s: float = 90.0  # one run (a runner's start, steps and close) that takes longer fails
    compile_backend: str = "inductor"  # the compiled rows'


QUICK = Sizes(d_model=32, layers=4, heads=2, seq=16, batch=4, microbatches=2, warmup=1, steps=2,
              gpt_procs=(2,), ipc_mib=(1, 16), ipc_reps=3, sleep_ms=1.0, slot_procs=2, slot_microbatches=4, slot_steps=2,
              budget_s=100.0, compile_backend="eager")


# -- the model: module-level classes (the stage processes import them from this script) ---------

class Embed(nn.Module):
    def __init__(self, s: Sizes) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(s.vocab, s.d_model), nn.Embedding(s.seq, s.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    def __init__(self, s: Sizes) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(s.d_model), nn.Linear(s.d_model, s.vocab, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(h))


def gpt_stages(s: Sizes, n: int) -> list[nn.Module]:
    """The same GPT (seed 0, built in one order) cut into ``n`` stages of whole blocks."""
    torch.manual_seed(0)
    embed, blocks, head = Embed(s), [Block(s.d_model, s.heads) for _ in range(s.layers)], Head(s)
    if s.layers % n:
        raise ValueError(f"{s.layers} layers do not cut into {n} equal stages")
    per = s.layers // n
    cut = [nn.Sequential(*blocks[k * per:(k + 1) * per]) for k in range(n)]
    cut[0] = nn.Sequential(embed, *cut[0])
    cut[-1] = nn.Sequential(*cut[-1], head)
    return cut


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# -- helpers -------------------------------------------------------------------------------------

class Clock:
    """The run's time budget: a run not started before it ends is skipped, and says so."""

    def __init__(self, budget_s: float) -> None:
        self.t0, self.budget_s = time.monotonic(), budget_s

    def check(self) -> None:
        if time.monotonic() - self.t0 > self.budget_s:
            raise TimeoutError(f"skipped: the run's {self.budget_s:.0f} s budget is spent")

    @contextlib.contextmanager
    def limit(self, seconds: float) -> Iterator[None]:
        """A run that hangs: a TimeoutError in this (the main) thread after ``seconds``, so that the
        runner's ``with`` closes its processes and the next run starts."""
        def ring(signum: int, frame: Any) -> None:
            raise TimeoutError(f"failed: ran past its {seconds:g} s limit")

        old = signal.signal(signal.SIGALRM, ring)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def _err(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _runner(stages: list[nn.Module], loss: Callable, schedule: str, m: int, devices: list[str],
            v: int = 1, **extra: Any) -> Any:
    import pipeq

    return pipeq.PipelineRunner(stages, loss, functools.partial(torch.optim.AdamW, lr=1e-4), schedule=schedule,
                                microbatches=m, devices=devices, threads_per_stage=1, start_method="forkserver",
                                **({"stages_per_process": v} if v > 1 else {}), **extra)


def _table(head: list[str], rows: list[list[Any]]) -> str:
    cells = [[("-" if c is None else f"{c:.3g}" if isinstance(c, float) else str(c)) for c in r] for r in rows]
    w = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{x}}}" for x in w)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * x for x in w))] + [fmt.format(*r) for r in cells])


# -- part 1: the GPT, one process against pipeq; part 4 reads its runs' memory ------------------

def gpt_data(s: Sizes) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(s.warmup + s.steps):
        idx = torch.randint(0, s.vocab, (s.batch, s.seq + 1), generator=g)
        out.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    return out


def one_process(s: Sizes, device: str, data: list, accumulate: bool = False) -> dict:
    """The model in this process: the whole batch at once, or (``accumulate``) as pipeq runs it,
    its ``s.microbatches`` microbatches one after another, their gradients accumulated (each loss
    over the batch's share), one optimizer step."""
    model = nn.Sequential(*gpt_stages(s, 1)).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, losses = [], []
    parts = s.microbatches if accumulate else 1
    for x, y in data:
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
            with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
                loss = lm_loss(model(xs.to(device)), ys.to(device)) * (len(xs) / len(x))
            loss.backward()
            total += loss.detach()
        opt.step()
        losses.append(float(total))  # synchronizes
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
    return {"times": times[s.warmup:], "losses": losses, "device_peak_bytes": peak}


def pipeq_gpt(s: Sizes, schedule: str, procs: int, devices: list[str], data: list, v: int | None = None,
              **extra: Any) -> dict:
    v = v or schedules.resolve(schedule).stages_per_process
    runner = _runner(gpt_stages(s, procs * v), lm_loss, schedule, s.microbatches, devices, v, precision="bf16",
                     **extra)
    times, losses = [], []
    with runner:
        for x, y in data:
            t0 = time.perf_counter()
            losses.append(float(runner.step(x, y)))
            times.append(time.perf_counter() - t0)
        memory = [{"stage": r.stage, "process": r.process, "activation_peak_bytes": r.activation_peak_bytes,
                   "predicted_activation_bytes": r.predicted_activation_bytes,
                   "device_peak_bytes": r.device_peak_bytes} for r in runner.memory()]
    return {"times": times[s.warmup:], "losses": losses, "memory": memory}


def _diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def part_gpt(s: Sizes, device: str, clock: Clock) -> list[dict]:
    from pipeq.control import forkserver

    forkserver.start(compiles=True)  # every row's stages fork from it; the compiled rows' start compiling at once
    data = gpt_data(s)
    base = one_process(s, device, data)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the stage processes share the device: this process keeps no cache
    base_ms = 1e3 * statistics.median(base["times"])
    rows = [{"run": "one process", "schedule": "-", "processes": 1, "stages": 1, "status": "ok", "step_ms": base_ms,
             "ratio": 1.0, "loss_max_diff": 0.0, "losses": base["losses"], "device_peak_bytes": base["device_peak_bytes"]}]
    acc = one_process(s, device, data, accumulate=True)
    acc_ms = 1e3 * statistics.median(acc["times"])
    rows.append({"run": "one process, microbatches", "schedule": "-", "processes": 1, "stages": 1, "status": "ok",
                 "step_ms": acc_ms, "ratio": acc_ms / base_ms, "loss_max_diff": _diff(acc["losses"], base["losses"]),
                 "losses": acc["losses"], "device_peak_bytes": acc["device_peak_bytes"]})
    # (run, schedule, processes, devices, stages per process, settings)
    plan: list[tuple[str, str, int, list[str], int | None, dict]] = [
        ("pipeq one device", sch, n, [device] * (n * (2 if sch == "zbv" else 1)), None, {})
        for n in s.gpt_procs for sch in SCHEDULES]
    every = max(s.gpt_procs)  # pipeq's own overhead: every stage in one process, none time-slicing the device
    plan.append(("pipeq one process", "interleaved-1f1b", 1, [device] * every, every, {}))
    plan += [("pipeq one device, compiled", sch, min(s.gpt_procs), [device] * (min(s.gpt_procs) * (2 if sch == "zbv" else 1)),
              None, {"compile": {"backend": s.compile_backend}}) for sch in SCHEDULES]
    gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
    if gpus > 1:
        plan += [(f"pipeq {min(n, gpus)} GPUs", "1f1b", n, [f"cuda:{k % gpus}" for k in range(n)], None, {})
                 for n in s.gpt_procs]
    for where, sch, n, devices, v, extra in plan:
        row: dict[str, Any] = {"run": where, "schedule": sch, "processes": n, "stages": len(devices)}
        try:
            clock.check()
            with clock.limit(s.run_limit_s):
                got = pipeq_gpt(s, sch, n, devices, data, v, **extra)
            step = 1e3 * statistics.median(got["times"])
            row.update(status="ok", step_ms=step, ratio=step / base_ms, loss_max_diff=_diff(got["losses"], base["losses"]),
                       losses=got["losses"], memory=got["memory"])
        except Exception as e:  # one run failing leaves the others
            row.update(status=e.args[0] if isinstance(e, TimeoutError) else f"failed: {_err(e)}")
        rows.append(row)
        print(f"  .. gpt {row['run']} {sch} x{n}: {row['status']}", flush=True)
    print(_table(["run", "schedule", "procs", "stages", "step ms", "x one process", "loss max diff", "status"],
                 [[r["run"], r["schedule"], r["processes"], r["stages"], r.get("step_ms"), r.get("ratio"),
                   r.get("loss_max_diff"), r["status"]] for r in rows]))
    print(f"  {s.batch} x {s.seq} tokens per step in {s.microbatches} microbatches, d_model {s.d_model}, "
          f"{s.layers} layers, bf16. All stages on one device share it: the ratio is pipeq's overhead, not a speed-up.")
    return rows


def part_memory(gpt_rows: list[dict]) -> dict:
    rows = [dict(schedule=r["schedule"], processes=r["processes"], run=r["run"], **m)
            for r in gpt_rows if r.get("memory") for m in r["memory"]]
    if not rows:
        raise RuntimeError("no pipeq run of part gpt finished: nothing to read the memory of")
    mib = lambda b: None if b is None else b / MIB
    print(_table(["run", "schedule", "procs", "stage", "process", "act peak MiB", "predicted MiB", "device peak MiB"],
                 [[r["run"], r["schedule"], r["processes"], r["stage"], r["process"], mib(r["activation_peak_bytes"]),
                   mib(r["predicted_activation_bytes"]), mib(r["device_peak_bytes"])] for r in rows]))
    return {"rows": rows}


# -- part 2: CUDA IPC bandwidth between two stage processes --------------------------------------

class Widen(nn.Module):
    """Stage 0: a one-number input widened into a ``(1, numel)`` float32 activation on the stage's device."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :1].expand(-1, self.numel) * self.scale


class Reduce(nn.Module):
    """Stage 1: the activation summed back to one number."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.sum(dim=1, keepdim=True) * self.w


def copy_rate(nbytes: int, device: str, reps: int) -> float:
    """ms per ``dst.copy_(src)`` of ``nbytes`` on ``device`` (CUDA: timed with events)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            dst.copy_(src)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    return 1e3 * (time.perf_counter() - t0) / reps


def eval_ms(nbytes: int, device: str, reps: int, limit_mb: int) -> float:
    """The median ms of a forward-only ``evaluate`` that moves ``nbytes`` from stage 0 to stage 1."""
    runner = _runner([Widen(nbytes // 4), Reduce()], nn.MSELoss(), "1f1b", 1, [device, device],
                     transport="ipc", max_message_mb=limit_mb)
    x, y = torch.ones(1, 1), torch.zeros(1, 1)
    times = []
    with runner:
        for _ in range(reps + 2):
            t0 = time.perf_counter()
            runner.evaluate([(x, y)])
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[2:])


def part_ipc(s: Sizes, device: str, clock: Clock) -> dict:
    limit_mb = max(256, 2 * max(s.ipc_mib))  # above the largest activation (the default is 256 MiB)
    clock.check()
    with clock.limit(s.run_limit_s):
        base = eval_ms(4096, device, s.ipc_reps, limit_mb)
    rows = []
    for mib in s.ipc_mib:
        n = mib * MIB
        row: dict[str, Any] = {"mib": mib, "base_4kib_eval_ms": base}
        try:
            clock.check()
            copy = copy_rate(n, device, 10)
            row.update(copy_ms=copy, copy_gib_s=n / 2**30 / (copy / 1e3))
            with clock.limit(s.run_limit_s):
                ev = eval_ms(n, device, s.ipc_reps, limit_mb)
            net = ev - base
            row.update(status="ok", eval_ms=ev, whole_gib_s=n / 2**30 / (ev / 1e3),
                       transfer_ms=net if net > 0 else None, gib_s=n / 2**30 / (net / 1e3) if net > 0 else None)
        except Exception as e:
            row.update(status=e.args[0] if isinstance(e, TimeoutError) else f"failed: {_err(e)}")
        rows.append(row)
        print(f"  .. ipc {mib} MiB: {row['status']}", flush=True)
    print(_table(["MiB", "eval ms", "transfer ms", "GiB/s", "GiB/s whole", "copy ms", "copy GiB/s", "status"],
                 [[r["mib"], r.get("eval_ms"), r.get("transfer_ms"), r.get("gib_s"), r.get("whole_gib_s"),
                   r.get("copy_ms"), r.get("copy_gib_s"), r["status"]] for r in rows]))
    print(f"  one way, stage 0 -> stage 1 on {device} (transport ipc, max_message_mb {limit_mb}); transfer = eval - "
          f"the 4 KiB pipeline's {base:.2f} ms; copy: one process's copy_ of the same size")
    return {"max_message_mb": limit_mb, "rows": rows}


# -- part 3: the per-slot fixed cost on sleep stages ---------------------------------------------

class _CudaSleep(torch.autograd.Function):
    """Identity whose forward and backward each spin the GPU a given number of cycles."""

    @staticmethod
    def forward(ctx, x, forward_cycles, backward_cycles):  # type: ignore[override]
        ctx.backward_cycles = backward_cycles
        if forward_cycles:
            torch.cuda._sleep(forward_cycles)
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        if ctx.backward_cycles:
            torch.cuda._sleep(ctx.backward_cycles)
        return g, None, None


class CudaSleepStage(nn.Module):
    """pipeq.testing.SleepStage on the GPU: F, I and W spin ``torch.cuda._sleep`` cycles, W on the bias's branch."""

    def __init__(self, width: int, f: int, i: int, w: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(width))
        self.f, self.i, self.w = f, i, w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _CudaSleep.apply(x, self.f, self.i) + _CudaSleep.apply(self.bias, 0, self.w)


class SleepChunks:
    """Stage s of n: F, I, W of ``ms`` each per process, split over the process's n / procs chunks."""

    def __init__(self, ms: float, procs: int, cycles_per_ms: float | None) -> None:
        self.ms, self.procs, self.cycles_per_ms = ms, procs, cycles_per_ms

    def __call__(self, s: int, n: int) -> nn.Module:
        t = self.ms / (n // self.procs)
        if self.cycles_per_ms is None:
            return SleepStage(bs.WIDTH, t / 1e3, t / 1e3, weight_s=t / 1e3)
        c = int(t * self.cycles_per_ms)
        return CudaSleepStage(bs.WIDTH, c, c, c)


def cycles_per_ms() -> float:
    """``torch.cuda._sleep``'s cycles per millisecond on this GPU, timed with CUDA events."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 20_000_000
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(n)
    end.record()
    end.synchronize()
    return n / start.elapsed_time(end)


def critical_slots(name: str, n: int, m: int) -> float:
    """The actions on the critical path of pipeq's plan of ``name``: its dry run at one unit per action."""
    v, placement = bs.layout(name)
    held = [stages_of(p, n, v, placement) for p in range(n)]
    unit = {Op.FORWARD: 1.0, Op.INPUT_GRAD: 1.0, Op.WEIGHT_GRAD: 1.0, Op.BACKWARD: 1.0, Op.STEP: 0.0}
    timeline = schedules.dry_run(schedules.build(name, n * v, m), cost=[unit] * (n * v), stages=held)
    return max(t + unit[a.op] for row in timeline for t, a in row)


def part_slots(s: Sizes, device: str, clock: Clock) -> dict:
    n, m = s.slot_procs, s.slot_microbatches
    cpm = cycles_per_ms() if device.startswith("cuda") else None
    x, y = torch.randn(m * bs.MB_ROWS, bs.WIDTH), torch.randn(m * bs.MB_ROWS, bs.WIDTH)
    rows = []
    for name in SCHEDULES:
        v = schedules.resolve(name).stages_per_process
        ideal = bs.pipeq_ideal(name, n, m, (s.sleep_ms,) * 3)
        slots = critical_slots(name, n, m)
        work = m * sum(sum(bs.chunk_costs((s.sleep_ms,) * 3, k, v)[op] for op in (Op.FORWARD, Op.INPUT_GRAD,
                                                                                 Op.WEIGHT_GRAD)) for k in range(n * v))
        row: dict[str, Any] = {"schedule": name, "processes": n, "stages": n * v, "ideal_ms": ideal, "slots": slots,
                               "work_ms": work}
        try:
            clock.check()
            make = SleepChunks(s.sleep_ms, n, cpm)
            runner = _runner([make(k, n * v) for k in range(n * v)], nn.MSELoss(), name, m, [device] * (n * v), v)
            times = []
            with clock.limit(s.run_limit_s), runner:
                for _ in range(s.warmup + s.slot_steps):
                    t0 = time.perf_counter()
                    runner.step(x, y)
                    times.append(time.perf_counter() - t0)
            step = 1e3 * statistics.median(times[s.warmup:])
            row.update(status="ok", step_ms=step, step_over_ideal=step / ideal, ms_per_slot=(step - ideal) / slots)
        except Exception as e:
            row.update(status=e.args[0] if isinstance(e, TimeoutError) else f"failed: {_err(e)}")
        rows.append(row)
        print(f"  .. slots {name}: {row['status']}", flush=True)
    print(_table(["schedule", "procs", "stages", "step ms", "ideal ms", "step/ideal", "slots", "ms/slot", "work ms",
                  "status"],
                 [[r["schedule"], r["processes"], r["stages"], r.get("step_ms"), r["ideal_ms"], r.get("step_over_ideal"),
                   r["slots"], r.get("ms_per_slot"), r["work_ms"], r["status"]] for r in rows]))
    how = f"torch.cuda._sleep at {cpm:.0f} cycles/ms" if cpm else "pipeq.testing.SleepStage (time.sleep)"
    print(f"  N={n} processes, m={m}, F/I/W {s.sleep_ms:g} ms each per process ({how}); "
          "ms/slot = (step - ideal) / critical-path actions; work ms: every action's cost summed (the floor of a "
          "step whose processes' kernels could only run one at a time)")
    return {"cycles_per_ms": cpm, "sleep_ms": s.sleep_ms, "microbatches": m, "rows": rows}


# -- the command line ----------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (default: cuda:0) or cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few steps (the smoke test's run)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)} (default: all)")
    p.add_argument("--d-model", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--steps", type=int, help="timed steps per run (after the warm-up)")
    p.add_argument("--budget", type=float, help="seconds after which runs not yet started are skipped (200)")
    p.add_argument("--run-limit", type=float, help="seconds one run may take before it fails (90)")
    p.add_argument("--json", metavar="PATH", help="every figure as JSON (rewritten after each part)")
    a = p.parse_args(argv)
    bad = set(a.parts.split(",")) - set(PARTS)
    if bad:
        p.error(f"unknown parts {sorted(bad)}: choose from {','.join(PARTS)}")
    return a


def sizes_of(a: argparse.Namespace) -> Sizes:
    s = QUICK if a.quick else Sizes()
    given = {"d_model": a.d_model, "layers": a.layers, "steps": a.steps, "slot_steps": a.steps, "budget_s": a.budget,
             "run_limit_s": a.run_limit}
    return replace(s, **{k: v for k, v in given.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu.py: --device cuda, but CUDA is not available here (torch "
              f"{torch.__version__}, CUDA build {torch.version.cuda}); use --device cpu --quick", file=sys.stderr)
        return 2
    s, device = sizes_of(a), "cuda:0" if a.device == "cuda" else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    name = torch.cuda.get_device_name(0) if device != "cpu" else "cpu"
    gpus = torch.cuda.device_count() if device != "cpu" else 0
    print(f"pipeq GPU benchmark on {name} ({gpus} CUDA devices), torch {torch.__version__}, {os.cpu_count()} CPUs",
          flush=True)
    out: dict[str, Any] = {"device": name, "cuda_devices": gpus, "torch": torch.__version__, "quick": a.quick,
                           "sizes": asdict(s), "parts": {}}
    clock, gpt_rows, wanted = Clock(s.budget_s), [], a.parts.split(",")
    run = {"gpt": lambda: {"rows": part_gpt(s, device, clock)}, "ipc": lambda: part_ipc(s, device, clock),
           "slots": lambda: part_slots(s, device, clock), "memory": lambda: part_memory(gpt_rows)}
    for part in [p for p in PARTS if p in wanted]:
        print(f"\n== {part}", flush=True)
        t0 = time.monotonic()
        try:
            got = run[part]()
            if part == "gpt":
                gpt_rows = got["rows"]
            res = {"status": "ok", **got}
        except Exception as e:  # a part that fails leaves the others
            res = {"status": e.args[0] if isinstance(e, TimeoutError) else f"failed: {_err(e)}"}
            print(f"  {part}: {res['status']}", flush=True)
        out["parts"][part] = {"seconds": time.monotonic() - t0, **res}
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(out, fh, indent=1, allow_nan=True)
    print("\n" + ", ".join(f"{p}: {r['status']} in {r['seconds']:.0f} s" for p, r in out["parts"].items()))
    return 0


if __name__ == "__main__":  # required: the stage processes run this script again, without this part
    sys.exit(main())
