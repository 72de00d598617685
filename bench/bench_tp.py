#!/usr/bin/env python
"""Tensor parallelism inside a stage: the step of T = 1 and T = 2 shards, split into compute and
communication, the memory of each process, and what a GPU node would need for it to pay.

    python bench/bench_tp.py                 # N = 1 and 2 stages, width 2048, batch 128 in 4 microbatches, 3 rounds
    python bench/bench_tp.py --quick         # 1 round, batch 64 in 2 microbatches, 4 timed steps
    python bench/bench_tp.py --stages 2 --schedule fill-drain --steps 20

The model: N stages, each ``nn.Sequential(Linear(W, W), ReLU(), Linear(W, W))`` (W = ``--width``,
2048), the plan ``{"0": "colwise", "2": "rowwise"}`` for every stage, MSELoss against random
targets, SGD with momentum 0.9 (so that there is optimizer state to count), float32, a global
batch of ``--batch`` rows in ``--microbatches`` microbatches, ``--schedule`` (1f1b). For each N
and T in (1, 2), a fresh ``PipelineRunner(..., tensor_parallel=T, tp_plan=[plan] * N,
start_method="forkserver", threads_per_stage=1)`` runs ``--warmup`` + ``--steps`` steps; the step
time is the median after the warm-up. The configurations take turns, the order rotating every
round; the figures are medians over rounds. Per configuration:

- step: the median step time;
- T_comp: one shard's own work of a step, measured alone: one fresh process (spawned, pinned to
  one core, one thread) runs stage k's shard with the same local shapes -- for T = 2 a
  ``Linear(W, W/2)`` and a ``Linear(W/2, W)`` (with the full bias, as torch's RowwiseParallel
  keeps it) -- on the same microbatches: m forwards and backwards (the input's gradient too for
  k > 0, the loss on the last stage) and the optimizer step; the slowest stage's. The process sets
  glibc's allocator as every stage process does (``pipeq.wire.sockets.tune_process_allocator``):
  without it the gradients freed by ``zero_grad(set_to_none=True)`` are unmapped and faulted in
  again every step, which made the same work ~2x slower here (198 against ~100 ms at T = 1);
- contention: the same work with min(P, C) such processes computing at once, one per core (P = N x T
  processes, C cores; stage r mod N on core r), over alone: the two vCPUs slow each other down;
- bound: T_comp x contention x (m + N - 1) / m (the pipeline's fill and drain) x max(1, P / C)
  (more busy processes than cores share them);
- T_comm = step - bound: what the step spends beyond compute (the all-reduces, pipeq's messages
  and the shard broadcasts, waiting), and T_comm / T_comp;
- memory: the peak resident set (VmHWM in /proc/<pid>/status) of every stage process, from the
  pids in ``runner.stage_processes`` read before the runner closes (and its resident set
  right after the start: the model loaded, nothing computed), beside the analytic parameters +
  gradients + momentum of one shard (4 bytes each). The probe's process gives the scale: its
  resident set before and after making the model, and its peak;
- loss@1 / loss@last: the same initial weights and data for every configuration, so T = 1 and
  T = 2 must agree up to float32 rounding (a correctness cross-check).

Directly, in plain torch (two spawned processes pinned to cores 0 and 1, gloo over 127.0.0.1):
the mean time (beside the median and p10-p90: gloo's all-reduce is bimodal on this VM) of
``all_reduce`` of one microbatch's activation ([B/m, W] float32: what a
rowwise layer sums in its forward, and a colwise layer's input gradient in the backward),
``all_gather`` of [B/m, W/2] pieces (a trailing colwise) and ``broadcast`` of [B/m, W] (shard 0
handing a received activation or gradient to its sibling); and one stage tensor-parallelized by
torch alone (``parallelize_module`` on a 2-process gloo mesh, no pipeq, N = 1): its step time and
its collectives per microbatch counted by ``CommDebugMode`` (the forward's all-reduce; a second
one in the backward when the stage's input needs its gradient, i.e. every stage but the first).
From these, the communication a T = 2 step needs at least: per stage and microbatch its
all-reduces plus two messages shard 0 shares with its sibling (``pipeq.wire.shard_link``: a broadcast
of the size, one of the frames; the input or received activation, the target or received
gradient; the commands' small ones left out), m microbatches, the slowest stage.

The GPU accounting at the end is arithmetic, not a measurement: per colwise + rowwise block and
shard, the forward and backward do 12 B W^2 / T FLOPs (4 B W^2 / T forward) and all-reduce two
(one forward) [B, W] activations, 2 (T - 1) / T x B W s bytes each per GPU in a ring (s = 2 for
bf16); T shards beat one GPU when the communication takes less than (T - 1) x the shard's
compute (T x c against c + comm), the tutorial's rule for data parallelism turned round. The
bandwidth part of comm / comp is (T - 1) s F / (3 W BW), independent of the batch; the latency
of each all-reduce (``--gpu-latency-us``, an assumption) adds a floor that only a large B hides.

This machine has 2 cores: N = 1, T = 2 gives each shard a core; N = 2, T = 2 puts 4 busy
processes on 2 cores, which can only lose. The point here is the accounting, not a speed-up.

Measured on a 2-vCPU VM (torch 2.13 CPU, nothing else running, the default command, 2 min 23 s)::

    config        procs  step ms  T_comp ms  contention  bound ms  T_comm ms  T_comm/T_comp  peak RSS/proc MB  params+grads+mom MB/shard
    N = 1, T = 1      1    104.0      108.6       1.00x     108.6      -4.58          -0.04           505-505                       96.0
    N = 1, T = 2      2     89.6       67.8       1.02x      69.2       20.4           0.30           389-405                       48.0
    N = 2, T = 1      2    171.4      122.4       1.10x     168.3       3.02           0.02           524-526                       96.0
    N = 2, T = 2      4    248.6       73.5       1.10x     202.3       46.3           0.63           374-410                       48.0
    gloo, [32, 2048] float32: all_reduce 2.30 ms (median 2.48, p10-p90 0.30-4.00), broadcast 0.37 ms
    torch's own TP of one stage: step 82.5 ms (pipeq N = 1, T = 2: 89.6 ms, 1.09x)
    N = 1, T = 2: the communication a step needs at least 16.6 ms: T_comm / T_comp = 0.24 directly, 0.30 from the step

T = 2 against T = 1: 1.16x the steps/s with one stage (1.18x in two earlier runs), 0.69x with two
(0.73x, 0.78x), the losses equal (0 and 1.2e-7 apart); each process's peak resident set 108 MB
lower with one stage, 125 MB with two (103-148 MB over the three runs) where the analytic state is
48 MB lower. In one plain process the peak holds about five parameter-sized buffers, not three
(the resident set grows by a gradient's size at each of the first three microbatches: each
microbatch's weight gradients are new tensors before they are added to .grad), which halve with
the shard, plus ~85 MB that the first backward allocates whatever the size: 230 MB (python and
torch) + 85 + 5 x 33.6 = 483 MB at T = 1, 230 + 85 + 5 x 16.8 = 399 MB at T = 2, near the
measured ~505 and ~410 MB (a shard process starts ~30 MB larger than a T = 1 stage holding the
same parameters: gloo's process group and DTensor). pipeq's step was 0.84-1.09x torch's own TP
of the stage. T_comp alone moved by 10-25% between rounds (nothing else running): T_comm is a difference
of two noisy numbers, and a negative one (T = 1, where only pipeq's messages remain) is noise. The
T_comm of N = 2, T = 2 is larger than its collectives: 4 processes on 2 cores also wait for each
other to be scheduled between collectives.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import traceback
from datetime import timedelta

import torch
from torch import nn

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import bench_core as bc  # noqa: E402  (bench/ on the path first)
from bench_core import BenchError, _pin, _table, _threads, free_port, run_group  # noqa: E402

import pipeq  # noqa: E402

PLAN = {"0": "colwise", "2": "rowwise"}
LR = 1e-3
MOMENTUM = 0.9
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
# GPU figures for the accounting (typical A100 node; see the docstring and the printed caveats)
A100_BF16_FLOPS = 300e12
NVLINK_BPS = 600e9
PCIE_BPS = 25e9


# -- the model ------------------------------------------------------------------------------------
def make_stages(width: int, n_stages: int, seed: int = 0) -> list[nn.Module]:
    """``n_stages`` x Sequential(Linear(W, W), ReLU, Linear(W, W)); deterministic."""
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)) for _ in range(n_stages)]


def make_data(width: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def shard_module(width: int, shards: int, seed: int = 0) -> nn.Module:
    """One shard of a stage under PLAN, as plain modules: Linear(W, W/T) + ReLU + Linear(W/T, W)
    (the rowwise layer keeps its whole bias, as torch's RowwiseParallel replicates it)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width // shards), nn.ReLU(), nn.Linear(width // shards, width))


def shard_numbers(width: int, shards: int) -> int:
    """Parameters one shard holds: colwise W x W/T + W/T, rowwise W/T x W + W (replicated bias)."""
    h = width // shards
    return width * h + h + h * width + width


def shard_bytes(width: int, shards: int) -> dict[str, float]:
    """Analytic bytes of one shard process: parameters, gradients, SGD momentum (float32)."""
    p = 4 * shard_numbers(width, shards)
    return {"params": p, "grads": p, "optim": p, "total": 3 * p}


# -- helpers ------------------------------------------------------------------------------------
def _status_kb(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _mb(nbytes: float) -> float:
    return nbytes / 2**20


def _ms(s: float) -> str:
    return "-" if s is None or s != s else (f"{1e3 * s:.1f}" if abs(s) >= 0.01 else f"{1e3 * s:.2f}")


PROBLEMS: list[str] = []


def _attempt(label: str, thunk):
    t0 = time.monotonic()
    try:
        res = thunk()
        print(f"  .. {label}: {time.monotonic() - t0:.1f} s", flush=True)
        return res
    except (BenchError, Exception) as exc:  # noqa: BLE001 -- a bench reports and goes on
        msg = str(exc) if isinstance(exc, BenchError) else traceback.format_exc()
        print(f"  !! {label}: FAILED after {time.monotonic() - t0:.1f} s: {msg}", flush=True)
        PROBLEMS.append(f"{label}: {msg.strip().splitlines()[-1]}")
        return None


# -- pipeq: one configuration --------------------------------------------------------------------
def run_pipeq(n_stages: int, shards: int, a: argparse.Namespace) -> dict:
    """A fresh runner: median step time, losses, each process's peak RSS (read before close)."""
    stages = make_stages(a.width, n_stages)
    x, y = make_data(a.width, a.batch)
    tp = {"tensor_parallel": shards, "tp_plan": [dict(PLAN) for _ in range(n_stages)]} if shards > 1 else {}
    t_start = time.perf_counter()
    runner = pipeq.PipelineRunner(
        stages, nn.MSELoss(), functools.partial(torch.optim.SGD, lr=LR, momentum=MOMENTUM),
        schedule=a.schedule, microbatches=a.microbatches, start_method="forkserver",
        threads_per_stage=1, step_timeout=300.0, **tp,
    )
    times, losses = [], []
    with runner:
        start_s = time.perf_counter() - t_start
        rss_start = {w.get("pid"): _status_kb(w.get("pid"), "VmRSS") for w in runner.stage_processes}
        for _ in range(a.warmup + a.steps):
            t0 = time.perf_counter()
            losses.append(runner.step(x, y))
            times.append(time.perf_counter() - t0)
        procs = []
        for w in runner.stage_processes:
            pid = w.get("pid")
            procs.append({"pid": pid, "stage": w.get("stage"), "shard": w.get("shard", 0),
                          "replica": w.get("replica", 0), "hwm_kb": _status_kb(pid, "VmHWM"),
                          "rss_kb": _status_kb(pid, "VmRSS"), "rss_start_kb": rss_start.get(pid)})
        stats = runner.stats()
    return {"step": statistics.median(times[a.warmup:]), "times": times, "losses": losses,
            "procs": procs, "stats_peak": [s.get("peak_bytes") for s in stats], "start_s": start_s}


# -- one shard's compute alone (a spawned child) --------------------------------------------------
def child_comp(rank: int, world: int, width: int, shards: int, stages: tuple, n_stages: int, batch: int,
               mbs: int, warmup: int, steps: int, barrier=None) -> dict:
    """Stage ``stages[rank]``'s shard, pinned to core ``rank``. With ``world`` > 1 the processes
    line up at a barrier before every iteration and alternate: every process computes ("beside"),
    then one alone (each in turn), so that both figures come from the same minutes."""
    from pipeq.wire.sockets import tune_process_allocator

    tune_process_allocator()  # as every stage process does: freed large blocks are reused, not unmapped
    _pin(rank)
    _threads(1)
    stage = stages[rank]
    rss0 = _status_kb(os.getpid(), "VmRSS")
    model = shard_module(width, shards)
    rss_model = _status_kb(os.getpid(), "VmRSS")
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    x, y = make_data(width, batch)
    xs, ys = x.tensor_split(mbs), y.tensor_split(mbs)

    def work() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for xb, yb in zip(xs, ys):
            if stage > 0:
                xb = xb.detach().requires_grad_()  # a later stage also computes its input's gradient
            out = model(xb)
            if stage == n_stages - 1:
                (nn.functional.mse_loss(out, yb) * (len(xb) / batch)).backward()
            else:
                out.backward(yb)  # stands in for the gradient received from the next stage
        opt.step()
        return time.perf_counter() - t0

    alone, beside = [], []
    if world == 1:
        alone = [work() for _ in range(warmup + steps)][warmup:]
    else:
        for j in range(2 * world * (warmup + steps)):
            barrier.wait()
            if j % 2 == 0:
                beside.append(work())
            elif (j // 2) % world == rank:
                alone.append(work())
        alone, beside = alone[warmup:], beside[world * warmup:]
    return {"alone": statistics.median(alone), "beside": statistics.median(beside) if beside else None,
            "stage": stage, "hwm_kb": _status_kb(os.getpid(), "VmHWM"), "rss0_kb": rss0, "rss_model_kb": rss_model}


def measure_comp(n_stages: int, shards: int, a: argparse.Namespace) -> dict:
    """min(P, C) processes (P = N x T, C cores), process r pinned to core r with stage r mod N's
    shard; T_comp: the slowest stage's work alone; beside: the slowest while all compute."""
    world = min(n_stages * shards, CORES)
    stages = tuple(r % n_stages for r in range(world))
    if world < n_stages:  # more stages than cores: each stage's alone in turn
        got = [run_group(f"comp-N{n_stages}-T{shards}-k{k}", child_comp, 1, lambda _r, k=k: (
            a.width, shards, (k,), n_stages, a.batch, a.microbatches, a.warmup, a.steps), timeout=300)[0]
            for k in range(n_stages)]
    else:
        import multiprocessing as mp

        barrier = mp.get_context("spawn").Barrier(world) if world > 1 else None
        got = run_group(f"comp-N{n_stages}-T{shards}", child_comp, world, lambda _r: (
            a.width, shards, stages, n_stages, a.batch, a.microbatches, a.warmup, a.steps, barrier), timeout=300)
    per_stage = [max(d["alone"] for d in got if d["stage"] == k) for k in range(n_stages)]
    beside = [d["beside"] for d in got if d["beside"] is not None]
    first = got[0]
    return {"t": max(per_stage), "per_stage": per_stage, "t_beside": max(beside) if beside else max(per_stage),
            "hwm_kb": first["hwm_kb"], "rss0_kb": first["rss0_kb"], "rss_model_kb": first["rss_model_kb"]}


# -- raw gloo collectives and torch's own TP of one stage (two spawned children) -------------------
def child_comm(rank: int, world: int, port: int, width: int, batch: int, mbs: int, warmup: int,
               iters: int, steps: int) -> dict:
    import warnings

    import torch.distributed as dist

    from pipeq.wire.sockets import tune_process_allocator

    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    tune_process_allocator()
    _pin(rank)
    _threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        rows = batch // mbs
        act = torch.randn(rows, width)
        piece = torch.randn(rows, width // world)
        pieces = [torch.empty_like(piece) for _ in range(world)]

        def timed(fn) -> list[float]:
            ts = []
            for i in range(warmup + iters):
                dist.barrier()  # time the collective, not the partner's lateness
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return ts[warmup:]

        tiny = torch.randn(16)
        head = torch.zeros(2, dtype=torch.int64)
        out = {"all_reduce": timed(lambda: dist.all_reduce(act)),
               "all_reduce_tiny": timed(lambda: dist.all_reduce(tiny)),  # the latency
               "all_gather": timed(lambda: dist.all_gather(pieces, piece)),
               "broadcast": timed(lambda: dist.broadcast(act, src=0)),
               "broadcast_tiny": timed(lambda: dist.broadcast(head, src=0))}  # pipeq.wire.shard_link's size header

        # one stage tensor-parallelized by torch alone (N = 1: no input gradient), and its
        # collectives per microbatch with and without an input gradient
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.debug import CommDebugMode
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,))
        model = parallelize_module(make_stages(width, 1)[0], mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        x, y = make_data(width, batch)
        xs, ys = x.tensor_split(mbs), y.tensor_split(mbs)

        def step(input_grad: bool = False) -> float:
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for xb, yb in zip(xs, ys):
                if input_grad:
                    xb = xb.detach().requires_grad_()
                loss = nn.functional.mse_loss(model(xb), yb) * (len(xb) / batch)
                loss.backward()
                total += loss.item()
            opt.step()
            return total

        counts = {}
        for input_grad in (False, True):
            mode = CommDebugMode()
            with mode:
                xb = xs[0].detach().requires_grad_(input_grad)
                nn.functional.mse_loss(model(xb), ys[0]).backward()
            counts["input_grad" if input_grad else "first_stage"] = {
                str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}
            opt.zero_grad(set_to_none=True)
        ts, losses = [], []
        for _ in range(warmup + steps):
            dist.barrier()
            t0 = time.perf_counter()
            losses.append(step())
            ts.append(time.perf_counter() - t0)
        out.update(tdp_step=statistics.median(ts[warmup:]), tdp_losses=losses, counts=counts,
                   hwm_kb=_status_kb(os.getpid(), "VmHWM"))
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def measure_comm(a: argparse.Namespace) -> dict:
    port = free_port()
    res = run_group("comm", child_comm, 2, lambda _r: (port, a.width, a.batch, a.microbatches, 3,
                                                       a.comm_iters, a.steps), timeout=300)
    out = {"tdp_step": max(r["tdp_step"] for r in res)}
    for k in ("all_reduce", "all_reduce_tiny", "all_gather", "broadcast", "broadcast_tiny"):
        ts = [max(pair) for pair in zip(res[0][k], res[1][k])]  # the slower rank's, call by call
        out[k] = statistics.mean(ts)  # what they cost a step on average (see main: bimodal here)
        out[k + "_med"] = statistics.median(ts)
        out[k + "_p10"], out[k + "_p90"] = (sorted(ts)[int(q * (len(ts) - 1))] for q in (0.1, 0.9))
    out.update(counts=res[0]["counts"], tdp_losses=res[0]["tdp_losses"], hwm_kb=max(r["hwm_kb"] for r in res))
    return out


# -- the GPU accounting ----------------------------------------------------------------------------
def gpu_accounting(width: int, rows: int, shards: int = 2, flops: float = A100_BF16_FLOPS, bps: float = NVLINK_BPS,
                   latency: float = 0.0, elem: int = 2, backward: bool = True) -> dict:
    """Per colwise + rowwise block and shard: compute time, all-reduce time, their ratio."""
    f = (12 if backward else 4) * rows * width * width / shards
    n_ar = 2 if backward else 1
    moved = 2 * (shards - 1) / shards * rows * width * elem  # per GPU per ring all-reduce
    t_comp = f / flops
    t_comm = n_ar * (latency + moved / bps)
    return {"flops": f, "bytes": n_ar * moved, "t_comp": t_comp, "t_comm": t_comm, "ratio": t_comm / t_comp}


def rows_to_pay(width: int, shards: int, flops: float, bps: float, latency: float, elem: int = 2,
                margin: float = 1.0) -> float:
    """The smallest B (rows per microbatch, e.g. tokens) at which comm <= margin x (T-1) x comp,
    forward + backward; inf if the bandwidth alone forbids it."""
    # 2 (latency + 2(T-1)/T B W s / bps) <= margin (T-1) 12 B W^2 / (T F)
    per_row_comp = margin * (shards - 1) * 12 * width * width / (shards * flops)
    per_row_comm = 2 * 2 * (shards - 1) / shards * width * elem / bps
    if per_row_comp <= per_row_comm:
        return float("inf")
    return 2 * latency / (per_row_comp - per_row_comm)


def _rows(v: float) -> str:
    return "never" if v == float("inf") else f"{v:,.0f}"


def print_accounting(a: argparse.Namespace, measured: dict) -> dict:
    """The table of what T = 2 needs on this box and on an A100 node; returns its numbers."""
    W, T = a.width, 2
    rows = a.batch // a.microbatches
    lat = a.gpu_latency_us * 1e-6
    print(f"\n=== What a GPU node would need for T = 2 to pay (arithmetic, per colwise + rowwise block of Linear({W})s) ===")
    print(f"Forward + backward per shard: 12 B W^2 / T FLOPs (B rows per microbatch: tokens) and 2 all-reduces of\n"
          f"[B, {W}] (forward: the rowwise sum; backward: the colwise input gradient), each moving 2 (T-1)/T x B x {W} x s\n"
          f"bytes per GPU in a ring. T shards take c + comm where one device takes T c (c: a shard's compute), so\n"
          f"T = 2 pays while comm / comp < T - 1 = 1, and reaches 1.6x of one device while comm / comp < 0.25.")
    bw_ratio = lambda F, BW, s: (T - 1) * s * F / (3 * W * BW)  # noqa: E731  (B cancels)
    out: dict = {}
    tbl = []
    if measured.get("cpu_flops"):
        F, BW = measured["cpu_flops"], measured["gloo_bps"]
        out["box"] = {"bw_ratio": bw_ratio(F, BW, 4), "ratio_at_b": measured["ratio_at_b"]}
        tbl.append(["this box: 1 core fp32, gloo (measured)", f"{F / 1e9:.0f} GFLOP/s", f"{BW / 1e9:.2f} GB/s *", "4",
                    f"{out['box']['bw_ratio']:.2f} *", f"{measured['ratio_at_b']:.2f} (measured)", "-"])
    for name, BW in (("A100 node, NVLink", NVLINK_BPS), ("A100s over PCIe", PCIE_BPS)):
        g = gpu_accounting(W, rows, T, A100_BF16_FLOPS, BW, lat)
        need = (rows_to_pay(W, T, A100_BF16_FLOPS, BW, lat), rows_to_pay(W, T, A100_BF16_FLOPS, BW, lat, margin=0.25))
        out[name] = {"bw_ratio": bw_ratio(A100_BF16_FLOPS, BW, 2), "ratio_at_b": g["ratio"], "rows_to_pay": need}
        tbl.append([f"{name}, bf16", f"{A100_BF16_FLOPS / 1e12:.0f} TFLOP/s", f"{BW / 1e9:.0f} GB/s", "2",
                    f"{out[name]['bw_ratio']:.3f}", f"{g['ratio']:.1f}", f"{_rows(need[0])} / {_rows(need[1])}"])
    print(_table(["", "compute F", "all-reduce BW", "s (bytes)", "comm/comp, bytes only",
                  f"comm/comp at B = {rows}, +{a.gpu_latency_us:g} us per all-reduce", "B for < 1 / < 0.25"], tbl))
    if measured.get("cpu_flops"):
        print("* this box's bandwidth is the mean all-reduce's bytes / time, its latency included")
    g = gpu_accounting(W, rows, T, A100_BF16_FLOPS, NVLINK_BPS, lat)
    nv, pc = out["A100 node, NVLink"], out["A100s over PCIe"]
    print(f"At this bench's B = {rows}: {g['flops'] / 1e9:.2f} GFLOP per shard and block, {1e6 * g['t_comp']:.1f} us at "
          f"{A100_BF16_FLOPS / 1e12:.0f} TFLOP/s, against 2 all-reduces of {g['bytes'] / 2 / 1024:.0f} KiB per GPU: "
          f"{1e6 * (g['t_comm'] - 2 * lat):.2f} us of NVLink\nbandwidth and 2 x {a.gpu_latency_us:g} us of latency. "
          f"The bytes alone cost (T-1) s F / (3 W BW) = {nv['bw_ratio']:.3f} of the compute on NVLink (any B), "
          f"{pc['bw_ratio']:.1f} on PCIe,\nwhere T = 2 never pays at W = {W} (it needs W > (T-1) s F / (3 BW) = "
          f"{(T - 1) * 2 * A100_BF16_FLOPS / (3 * PCIE_BPS):,.0f}). On NVLink the latency sets the size: B >= "
          f"{_rows(nv['rows_to_pay'][0])} rows (tokens) per microbatch to break even, >= {_rows(nv['rows_to_pay'][1])} "
          f"for 1.6x.\n(Caveats: GEMMs this small reach only part of 300 TFLOP/s, which lowers the ratios; NCCL "
          f"achieves less all-reduce bandwidth than the link's 600 GB/s, which raises them; {a.gpu_latency_us:g} us "
          f"per all-reduce is an assumption, --gpu-latency-us.)")
    return out


# -- the run ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 round, batch 64 in 2 microbatches, 4 timed steps")
    p.add_argument("--rounds", type=int, default=None, help="default 3 (--quick: 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 10; --quick: 4)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --quick: 2)")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=None, help="the global batch (default 128; --quick: 64)")
    p.add_argument("--microbatches", type=int, default=None, help="default 4 (--quick: 2)")
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2], help="the N to measure")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="the T to measure (1 and 2)")
    p.add_argument("--schedule", default="1f1b", help="1f1b or fill-drain")
    p.add_argument("--comm-iters", type=int, default=None, help="timed collectives (default 50; --quick: 20)")
    p.add_argument("--gpu-latency-us", type=float, default=10.0,
                   help="assumed latency of one small all-reduce on the GPU node (accounting only)")
    a = p.parse_args(argv)
    q = a.quick
    a.rounds = a.rounds or (1 if q else 3)
    a.steps = a.steps or (4 if q else 10)
    a.warmup = a.warmup if a.warmup is not None else (2 if q else 3)
    a.batch = a.batch or (64 if q else 128)
    a.microbatches = a.microbatches or (2 if q else 4)
    a.comm_iters = a.comm_iters or (20 if q else 50)
    if a.batch % a.microbatches or a.width % 2:
        p.error("--batch must be a multiple of --microbatches and --width even")
    if any(t not in (1, 2) for t in a.tp):
        p.error("--tp takes 1 and/or 2")
    PROBLEMS.clear()
    W, B, m = a.width, a.batch, a.microbatches
    print(f"tensor parallelism: N x Sequential(Linear({W}, {W}), ReLU, Linear({W}, {W})), plan {PLAN}, batch {B} "
          f"in {m} microbatches of {B // m}, {a.schedule}, SGD momentum {MOMENTUM}, MSELoss; T = "
          f"{' and '.join(map(str, a.tp))}, N = {' and '.join(map(str, a.stages))}; {a.warmup} warm-up + "
          f"{a.steps} timed steps x {a.rounds} round(s); forkserver, 1 thread per process, {CORES} cores", flush=True)
    print(f"    {bc._background()}", flush=True)

    configs = [(n, t) for n in a.stages for t in a.tp]
    jobs = [("pipeq", c) for c in configs] + [("comp", c) for c in configs] + [("comm", None)]
    got: dict = {j: [] for j in jobs}
    for r in range(a.rounds):
        order = jobs[r % len(jobs):] + jobs[:r % len(jobs)]
        for what, c in order:
            if what == "pipeq":
                res = _attempt(f"round {r + 1}: pipeq N = {c[0]}, T = {c[1]}", lambda: run_pipeq(c[0], c[1], a))
            elif what == "comp":
                res = _attempt(f"round {r + 1}: one shard's compute, alone and beside, N = {c[0]}, T = {c[1]}",
                               lambda: measure_comp(c[0], c[1], a))
            else:
                res = _attempt(f"round {r + 1}: gloo collectives and torch's own TP (2 processes)",
                               lambda: measure_comm(a))
            if res is not None:
                got[(what, c)].append(res)
        print(f"  round {r + 1}: " + "; ".join(
            f"N = {c[0]}, T = {c[1]}: step {_ms(got[('pipeq', c)][-1]['step'] if len(got[('pipeq', c)]) > r else None)}, "
            f"T_comp {_ms(got[('comp', c)][-1]['t'] if len(got[('comp', c)]) > r else None)}"
            for c in configs) + " ms", flush=True)

    med = statistics.median
    result: dict = {"configs": {}, "problems": PROBLEMS}
    comm = got[("comm", None)]
    cm = {k: med(x[k] for x in comm) for k in comm[0] if k not in ("counts", "tdp_losses", "hwm_kb")} if comm else {}
    rows = []
    for c in configs:
        n, t = c
        runs, comps = got[("pipeq", c)], got[("comp", c)]
        if not runs or not comps:
            continue
        step = med(x["step"] for x in runs)
        tc = med(x["t"] for x in comps)
        tb = med(x["t_beside"] for x in comps)
        procs = n * t
        bound = tb * (m + n - 1) / m * max(1.0, procs / CORES)
        t_comm = step - bound
        last = runs[-1]
        hwm = [pr["hwm_kb"] for pr in last["procs"] if pr["hwm_kb"] is not None]
        analytic = shard_bytes(W, t)
        res = {"step": step, "t_comp": tc, "t_beside": tb, "contention": tb / tc, "bound": bound,
               "t_comm": t_comm, "ratio": t_comm / tc,
               "procs": last["procs"], "hwm_mb": [kb / 1024 for kb in hwm], "analytic": analytic,
               "comp_hwm_mb": comps[-1]["hwm_kb"] / 1024, "comp_rss0_mb": comps[-1]["rss0_kb"] / 1024,
               "comp_rss_model_mb": comps[-1]["rss_model_kb"] / 1024,
               "losses": last["losses"], "stats_peak": last["stats_peak"], "start_s": last["start_s"],
               "steps_per_s": 1 / step, "per_stage_comp": comps[-1]["per_stage"]}
        result["configs"][c] = res
        rows.append([f"N = {n}, T = {t}", str(procs), _ms(step), _ms(tc), f"{tb / tc:.2f}x", _ms(bound), _ms(t_comm),
                     f"{t_comm / tc:.2f}",
                     f"{min(res['hwm_mb']):.0f}-{max(res['hwm_mb']):.0f}" if hwm else "?",
                     f"{_mb(analytic['total']):.1f}", f"{last['losses'][0]:.6f} / {last['losses'][-1]:.6f}"])
    print()
    print(_table(["config", "procs", "step ms", "T_comp ms", "contention", "bound ms", "T_comm ms", "T_comm/T_comp",
                  "peak RSS/proc MB", "params+grads+mom MB/shard", "loss@1 / loss@last"], rows))
    print(f"(step: median; T_comp: one shard's work of a step alone, the slowest stage; contention: the same work with "
          f"min(procs, {CORES}) shards computing at once,\n one per core, over alone; bound: T_comp x contention x "
          f"(m+N-1)/m x max(1, procs/{CORES} cores); T_comm = step - bound)")
    for c, res in result["configs"].items():
        per = ", ".join(f"stage {pr['stage']} shard {pr['shard']} {pr['hwm_kb'] / 1024:.0f} "
                        f"(at start {(pr['rss_start_kb'] or 0) / 1024:.0f})"
                        for pr in res["procs"] if pr["hwm_kb"] is not None)
        print(f"  N = {c[0]}, T = {c[1]}: peak RSS MB {per}; one shard alone in a spawned process "
              f"{res['comp_hwm_mb']:.0f} (before the model {res['comp_rss0_mb']:.0f}, with it "
              f"{res['comp_rss_model_mb']:.0f})")
    for n in a.stages:
        r1, r2 = result["configs"].get((n, 1)), result["configs"].get((n, 2))
        if r1 and r2:
            saved = med(r1["hwm_mb"]) - med(r2["hwm_mb"])
            want = _mb(r1["analytic"]["total"] - r2["analytic"]["total"])
            l1, l2 = r1["losses"], r2["losses"]
            dl = max(abs(u - v) for u, v in zip(l1, l2))
            rel = dl / max(abs(v) for v in l1)
            r2["loss_rel_diff"] = rel
            print(f"  N = {n}: T = 2 / T = 1 steps/s {r2['steps_per_s'] / r1['steps_per_s']:.2f}x; peak RSS per process "
                  f"{abs(saved):.0f} MB {'lower' if saved >= 0 else 'higher'} (analytic: {want:.1f} MB of parameters, gradients and momentum); "
                  f"max |loss difference| over {len(l1)} steps {dl:.1e} ({rel:.1e} relative)")
    if cm:
        rows_b = B // m
        counts = comm[-1]["counts"]
        ar_first = counts["first_stage"].get("all_reduce", 0)
        ar_later = counts["input_grad"].get("all_reduce", 0)
        kib = rows_b * W * 4 / 1024
        print(f"\ngloo between 2 pinned processes, mean (median, p10-p90) of {a.comm_iters} calls after a barrier each:\n"
              f"  [{rows_b}, {W}] float32 ({kib:.0f} KiB): all_reduce {_ms(cm['all_reduce'])} ms "
              f"({_ms(cm['all_reduce_med'])}, {_ms(cm['all_reduce_p10'])}-{_ms(cm['all_reduce_p90'])}), broadcast "
              f"{_ms(cm['broadcast'])} ({_ms(cm['broadcast_med'])}, {_ms(cm['broadcast_p10'])}-{_ms(cm['broadcast_p90'])}); "
              f"all_gather of [{rows_b}, {W // 2}] pieces {_ms(cm['all_gather'])} ({_ms(cm['all_gather_med'])}, "
              f"{_ms(cm['all_gather_p10'])}-{_ms(cm['all_gather_p90'])})\n"
              f"  16 floats all_reduce {_ms(cm['all_reduce_tiny'])} ({_ms(cm['all_reduce_tiny_med'])}, "
              f"{_ms(cm['all_reduce_tiny_p10'])}-{_ms(cm['all_reduce_tiny_p90'])}); 2 int64 broadcast "
              f"{_ms(cm['broadcast_tiny'])} ({_ms(cm['broadcast_tiny_med'])}, {_ms(cm['broadcast_tiny_p10'])}-"
              f"{_ms(cm['broadcast_tiny_p90'])}) ms")
        if cm["all_reduce_p90"] > 4 * cm["all_reduce_p10"]:
            print("  (gloo's all_reduce here is bimodal: most calls take either ~0.3-0.5 ms or ~3-4 ms, about one 4 ms\n"
                  "   timer tick, whatever the size up to 256 KiB; the mean is what a step pays on average)")
        print(f"torch's own TP of one stage (parallelize_module, 2 processes, no pipeq): step "
              f"{1e3 * cm['tdp_step']:.1f} ms; collectives per microbatch (CommDebugMode): first stage "
              f"{counts['first_stage'] or 'none'}, a stage with an input gradient {counts['input_grad'] or 'none'}")
        for c, res in result["configs"].items():
            n, t = c
            if t != 2:
                continue
            n_ar = max(ar_first if k == 0 else ar_later for k in range(n))
            per_mb = n_ar * cm["all_reduce"] + 2 * (cm["broadcast_tiny"] + cm["broadcast"])
            direct = m * per_mb
            res["t_comm_direct"] = direct
            res["ratio_direct"] = direct / res["t_comp"]
            print(f"  N = {n}, T = 2: the communication a step needs at least, the slowest stage: {m} microbatches x "
                  f"({n_ar} all-reduce + 2 shared messages, each a size and a [{rows_b}, {W}] broadcast) = "
                  f"{1e3 * direct:.1f} ms: T_comm / T_comp = {direct / res['t_comp']:.2f} directly, "
                  f"{res['ratio']:.2f} from the step")
        if (1, 2) in result["configs"]:
            r = result["configs"][(1, 2)]
            print(f"  N = 1, T = 2: pipeq step {1e3 * r['step']:.1f} ms against torch's own TP "
                  f"{1e3 * cm['tdp_step']:.1f} ms ({r['step'] / cm['tdp_step']:.2f}x)")
        result["comm"] = dict(cm, counts=counts)
        # this box in the GPU table's terms: F from one shard's measured compute, BW from gloo
        c1 = result["configs"].get((1, 2))
        if c1 is not None:
            flops = 12 * B * W * W / 2 - 2 * B * W * W / 2  # N = 1 stage 0: no input gradient
            cpu_f = flops / c1["t_comp"]
            gloo_bps = rows_b * W * 4 / cm["all_reduce"]  # ring bytes per rank (T = 2: all), latency included
            ratio_at_b = 2 * cm["all_reduce"] / (cpu_f and 12 * rows_b * W * W / 2 / cpu_f)
            result["box"] = {"cpu_flops": cpu_f, "gloo_bps": gloo_bps, "ratio_at_b": ratio_at_b}
            print(f"this box: one core computes {cpu_f / 1e9:.0f} GFLOP/s in the T = 2 shard (N = 1); gloo all-reduces "
                  f"{gloo_bps / 1e9:.2f} GB/s at {kib:.0f} KiB (the mean call, latency included)")
    rule = result["configs"]
    print(f"rule: T = 2 pays when T_comm / T_comp < T - 1 = 1 (2 shards take T_comp + T_comm where one process takes "
          f"about 2 T_comp;\n  it assumes a core per shard: with N = 2 the 4 processes share {CORES} cores)")
    for (n, t), res in rule.items():
        if t == 2 and (n, 1) in rule:
            verdict = "pays" if res["ratio"] < 1 else "does not pay"
            print(f"  N = {n}, T = 2 ({2 * n} processes on {CORES} cores): T_comm / T_comp = {res['ratio']:.2f}: "
                  f"{verdict}; measured {res['steps_per_s'] / rule[(n, 1)]['steps_per_s']:.2f}x the steps/s of T = 1")
    result["accounting"] = print_accounting(a, result.get("box", {}))
    if PROBLEMS:
        print("\nProblems:\n  " + "\n  ".join(PROBLEMS))
    return result


if __name__ == "__main__":
    out = main()
    sys.exit(1 if out["problems"] else 0)
