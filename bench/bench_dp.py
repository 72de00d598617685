"""Data parallelism: steps/s of R = 1 and R = 2 replicas and T_sync / T_comp; the bytes and time of the replicas' sum.

    python bench/bench_dp.py                          # width 1024, 4 layers, batch 256, 3 rounds
    python bench/bench_dp.py --rounds 5 --steps 30 --width 512
    PYTHONPATH=. python bench/bench_dp.py --bytes     # R = 1, 2, 4: step time and bytes per replica (~1 min)
    PYTHONPATH=. python bench/bench_dp.py --bytes --old auto   # and the replica link it replaced, beside
    python bench/bench_dp.py --table                  # the analytic table for GPUs, R = 2 .. 64

**The rule** (the default run):

The model: ``--layers`` x Linear(W, W) with a ReLU between them (W = ``--width``), MSELoss against
random targets, SGD, a fixed global batch (``--batch``). As one stage (N = 1, one microbatch per
replica) and cut in two halves (N = 2, 1F1B, ``--microbatches`` per replica). Every configuration
runs in a fresh ``PipelineRunner`` (``start_method="forkserver"``, ``threads_per_stage=1``: pipeq
pins R x N stage processes round-robin on the cores) for ``--steps`` timed steps after a warm-up;
the configurations take turns in an order that rotates every round, and the figures are medians
over rounds of each run's median step time (the speedup: the median of each round's T_1 / T_2).
Per N:

- T_1: a step of R = 1 on the whole batch (the baseline);
- T_2: a step of R = 2 on the whole batch (each replica takes half; gradients all-reduced);
- T_comp: a step of R = 1 on half the batch: one replica's work on its shard, no synchronization;
- a probe in plain torch, R x N processes pinned as pipeq pins its stage processes, each with
  stage k's module and a shard, no pipeline messages:
  T_sync, stage k's ``pipeq.parallel.data.GradSync`` alone (flatten the gradients into buckets,
  all-reduce them in a torch process group over loopback gloo, copy them back: what a stage does
  before its optimizer step), all N stages at once;
  contention, a stage's compute of one step (forwards, backwards, optimizer step) while every
  replica computes / while only replica 0's stages do (alternate iterations);
  the slowest stage's medians.

and the tutorial's rule (synchronous SGD): R replicas taking R x B samples per step cost
T_comp + T_sync against R x T_comp for one process, so distribution pays while
T_sync / T_comp < R - 1. The rule assumes a replica computes as fast beside its siblings as
alone (contention 1) and that a batch twice as large takes twice as long (T_1 = 2 T_comp); both
are printed, and T_2 - T_comp: what a step really loses beside the compute of a shard.

This machine has 2 cores: R = 2 x N = 1 gives each replica a core, but R = 2 x N = 2 runs 4 busy
stage processes on 2 cores (two per core), so its replicas cannot compute at once and its
T_2 - T_comp is mostly contention, not synchronization.

Measured on a 2-vCPU VM shared with other jobs (defaults; load average ~2 from them), the
gradients all-reduced by torch.distributed's gloo (as they are again: bench/README.md has the
figures of this checkout)::

    $ python bench/bench_dp.py
     N  R=1 st/s  R=2 st/s  speedup     T_1     T_2  T_comp  T_sync T_2-T_comp T_1/T_comp T_sync/T_comp contention
     1     11.91     14.08    1.17x  84.0ms  71.0ms  47.0ms  23.4ms     24.0ms       1.79          0.50      1.04x
     2     11.83      8.15    0.68x  84.5ms 122.7ms  49.4ms  20.6ms     73.3ms       1.71          0.42      1.95x
    rule (synchronous SGD): distribution pays while T_sync / T_comp < R - 1 = 1
    N = 1, R = 2 (2 processes on 2 cores): T_sync / T_comp = 0.50 < 1: the rule says it pays (R T_comp / (T_comp + T_sync) = 1.34x)
       measured: R = 2 makes 1.17x the steps/s of R = 1: it pays; with the contention measured beside, T_1 / (T_comp x 1.04 + T_sync) = 1.16x
    N = 2, R = 2 (4 processes on 2 cores): T_sync / T_comp = 0.42 < 1: the rule says it pays (R T_comp / (T_comp + T_sync) = 1.41x)
       measured: R = 2 makes 0.68x the steps/s of R = 1: it does not pay; with the contention measured beside, T_1 / (T_comp x 1.95 + T_sync) = 0.72x

The all-reduce of 16 MiB of gradients over loopback gloo took ~20-25 ms against ~47 ms of
compute per shard: T_sync / T_comp ~ 0.5, inside the rule's bound. With one replica per core
(N = 1) data parallelism pays, less than the rule promises (1.17x, not 1.34x) because a batch of
256 costs 1.79 T_comp, not 2 (the rule's T_1 = R T_comp); T_1 / (T_comp + T_sync) predicts it.
With N = 2 the rule says it pays and it does not: R x N = 4 busy processes on 2 cores compute
at half speed (contention 1.95x), which the rule, made for one replica per machine, leaves out;
T_1 / (2 T_comp + T_sync) predicts the loss. Under heavier load from other jobs (load average
4-8) R = 2 x N = 1 measured 0.77x-0.87x: the figures move with the machine's load; compare the
rows of one run. (A second run at load ~1-2: 1.15x and 0.60x, T_sync / T_comp 0.51 and 0.45,
contention 1.02x and 1.99x.)

**The bytes** (``--bytes``): A pipeline of 2 stages, each ``--layers`` Linear(W, W) (W = ``--width``): a stage's
gradients are ``layers x (W^2 + W) x 4`` bytes (8.0 MiB at the defaults). Each replica trains on
``--batch`` samples per step (so a replica's own pipeline traffic is the same at every R), 1F1B, 4
microbatches, SGD, ``threads_per_stage=1``, ``transport="tcp"`` (every byte between processes on a
TCP socket, over loopback). For R = 1, 2 and 4 replicas, in a fresh process each: the median step
over ``--steps`` steps after a warm-up, and the bytes the stage processes' TCP sockets sent over them
(from before the first to after the last, every stage's work done: ``runner.stats()`` answers once
it is): ``bytes_sent`` of each socket from ``ss -tinpH`` (iproute2), whichever thread wrote it:
gloo's, ZeroMQ's I/O threads, the control channel. (A process's ``wchar`` would miss ZeroMQ's,
which sends with ``send(2)``, not ``write(2)``.)
*Bytes per replica per step* is a stage process's mean per step minus R = 1's (which sums nothing):
what the gradient sum sends. It is set against a ring all-reduce's ``2 (R - 1) / R`` times the
gradients and the old link's ``R - 1`` times (every replica sent its buckets to every other).
``--old REV`` measures the same at git revision REV (``auto``: the last one with pipeq's replica
link, ``pipeq/wire/replica_link.py``), checked out in a temporary worktree: the same script, that
revision's pipeq (``PYTHONPATH``).

**The table** (``--table``). For a stage of ``--params`` fp32 parameters and R = 2 .. 64 replicas: the bytes a
GPU sends per step (ring all-reduce, torch's NCCL: ``2 (R - 1) / R x 4P``; the old link:
``(R - 1) x 4P`` from host memory, after a device-to-host copy of ``4P`` and before adding ``R x 4P``
on the CPU and copying ``4P`` back), and their time at vendors' bandwidths: NVLink 4 on H100 SXM,
900 GB/s a GPU both ways together, 450 GB/s each way (NVIDIA H100 Tensor Core GPU datasheet);
InfiniBand NDR, 400 Gb/s = 50 GB/s each way per GPU with one ConnectX-7 per GPU (NVIDIA ConnectX-7
datasheet); the old link's device-host copies at PCIe 5.0 x16, 64 GB/s each way (PCI-SIG), its sends
at the host network's (InfiniBand NDR above). Bandwidth-only bounds: latency and the ring's steps
(2 (R - 1) of them) are left out, so small R and small stages do worse than the table says.

The figures this prints are in bench/README.md ("Data parallelism: torch's collectives against the
replica link"), with the command that printed them.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

import pipeq

WARMUP = 3


def make_stages(width: int, layers: int, n_stages: int, seed: int = 0) -> list[nn.Module]:
    """``layers`` Linear(width, width) with ReLUs between, cut into ``n_stages`` equal stages."""
    if layers % n_stages:
        raise ValueError(f"{layers} layers do not split into {n_stages} equal stages")
    torch.manual_seed(seed)
    mods: list[list[nn.Module]] = []
    for i in range(layers):
        mods.append([nn.Linear(width, width)] + ([nn.ReLU()] if i < layers - 1 else []))
    per = layers // n_stages
    return [nn.Sequential(*[m for block in mods[k * per:(k + 1) * per] for m in block])
            for k in range(n_stages)]


def n_params(width: int, layers: int) -> int:
    return layers * (width * width + width)


# -- steps/s of a runner ----------------------------------------------------------------------
def step_time(n_stages: int, replicas: int, batch: int, microbatches: int, width: int, layers: int,
              steps: int) -> float:
    """Median step time (s) of a fresh runner after WARMUP steps."""
    stages = make_stages(width, layers, n_stages)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    runner = pipeq.PipelineRunner(
        stages, nn.MSELoss(), functools.partial(torch.optim.SGD, lr=1e-4),
        schedule="1f1b", microbatches=microbatches, data_parallel=replicas,
        start_method="forkserver", threads_per_stage=1,
    )
    times = []
    with runner:
        for _ in range(WARMUP + steps):
            t0 = time.perf_counter()
            runner.step(x, y)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[WARMUP:])


# -- the probe: one stage's compute and its gradient sum, in plain torch ---------------------------
def _poll(done: Any, what: str) -> None:
    """How the probe's collectives wait (a stage process waits through its inbox)."""
    while not done():
        time.sleep(0.0002)



def _probe_worker(stage: int, replica: int, replicas: int, n_stages: int, core: int, ipc_dir: str,
                  addresses: "mp.Queue", peers: "mp.Queue", barrier: "mp.synchronize.Barrier",
                  shard: int, microbatches: int, width: int, layers: int, iters: int,
                  out: "mp.Queue") -> None:
    try:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, [core])
        torch.set_num_threads(1)
        import torch.distributed as dist

        from pipeq.parallel.data import GradSync
        from pipeq.parallel.mesh import ReplicaGroup

        module = make_stages(width, layers, n_stages)[stage]
        params = list(module.parameters())
        opt = torch.optim.SGD(params, lr=1e-4)
        g = torch.Generator().manual_seed(replica)
        sizes = [len(c) for c in torch.arange(shard).tensor_split(microbatches)]
        xs = [torch.randn(n, width, generator=g) for n in sizes]
        ys = [torch.randn(n, width, generator=g) for n in sizes]  # targets, or output gradients
        # stage k's replicate group, as in a stage process (pipeq.parallel.mesh): loopback gloo
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        sync = None
        if replicas > 1:
            group = ReplicaGroup(dist.FileStore(os.path.join(ipc_dir, "store"), -1), f"s{stage}", replica,
                                 torch.device("cpu"), _poll)
            group.form(range(replicas), "probe")
            sync = GradSync(params, group, replicas, hooks=False)
        addresses.put((replica * n_stages + stage, ""))
        peers.get(timeout=60)
        alone, beside, syncs = [], [], []
        for i in range(2 * (WARMUP + iters)):
            solo = i % 2 == 1  # every other iteration only replica 0's stages compute
            barrier.wait()  # every process of the probe lines up at the start of each iteration
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            if not solo or replica == 0:
                for x, y in zip(xs, ys):  # the stage's forwards and backwards of one step
                    if stage > 0:
                        x = x.detach().requires_grad_()  # it also computes its input's gradient
                    outp = module(x)
                    if stage == n_stages - 1:
                        (nn.functional.mse_loss(outp, y) * (len(x) / shard)).backward()
                    else:
                        outp.backward(y)
            t_compute = time.perf_counter() - t0
            if sync is not None and not solo:
                barrier.wait()  # time the gradient sum, not the partner's lateness
                t1 = time.perf_counter()
                sync.start()
                sync.finish()
                syncs.append(time.perf_counter() - t1)
            t2 = time.perf_counter()
            if not solo or replica == 0:
                opt.step()
            (alone if solo else beside).append(t_compute + time.perf_counter() - t2)
        barrier.wait()  # nobody leaves its group while another may still read from it
        out.put((stage, replica, (statistics.median(alone[WARMUP:]), statistics.median(beside[WARMUP:]),
                                  statistics.median(syncs[WARMUP:]) if syncs else 0.0)))
    except BaseException as exc:  # reported by the parent
        out.put((stage, replica, f"{type(exc).__name__}: {exc}"))


def probe(n_stages: int, replicas: int, shard: int, microbatches: int, width: int, layers: int,
          iters: int) -> tuple[float, float, float]:
    """(alone, beside, T_sync) from R x N processes pinned as pipeq pins its stage processes, each
    with stage k's module and a shard of ``shard`` samples, no pipeline messages, iterations
    alternating: a stage's work of one step (its forwards and backwards, its optimizer step) with
    every process computing ("beside") and with only replica 0's ("alone"); T_sync = stage k's
    ``pipeq.parallel.data.GradSync`` (flatten into buckets, all-reduce over loopback gloo, copy
    back), all N stages at once. The slowest stage's, medians over iterations (and
    replicas)."""
    from pipeq.wire.sockets import make_ipc_dir, remove_ipc_dir

    if hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
    else:
        cores = list(range(os.cpu_count() or 1))
    ctx = mp.get_context("forkserver")
    out, addresses = ctx.Queue(), ctx.Queue()
    total = replicas * n_stages
    barrier = ctx.Barrier(total)
    peers = [ctx.Queue() for _ in range(total)]
    ipc_dir = make_ipc_dir()
    procs = []
    for r in range(replicas):
        for k in range(n_stages):
            g = r * n_stages + k  # pinned as pipeq pins stage process g
            procs.append(ctx.Process(target=_probe_worker, daemon=True, args=(
                k, r, replicas, n_stages, cores[g % len(cores)], ipc_dir, addresses, peers[g], barrier,
                shard, microbatches, width, layers, iters, out)))
    for p in procs:
        p.start()
    got: dict[tuple[int, int], tuple[float, float, float]] = {}
    try:
        everyone: dict[int, str] = dict(addresses.get(timeout=120) for _ in procs)
        for q in peers:  # as the driver's PEERS does: every process learns the others' addresses
            q.put(everyone)
        for _ in procs:
            stage, replica, t = out.get(timeout=300)
            if isinstance(t, str):
                raise RuntimeError(f"probe, stage {stage} replica {replica}: {t}")
            got[(stage, replica)] = t
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        remove_ipc_dir(ipc_dir)
    alone = max(got[(k, 0)][0] for k in range(n_stages))
    beside = max(statistics.median(got[(k, r)][1] for r in range(replicas)) for k in range(n_stages))
    sync = max(statistics.median(got[(k, r)][2] for r in range(replicas)) for k in range(n_stages))
    return alone, beside, sync


# -- the bytes (--bytes) and the table (--table) ------------------------------------------------------
NVLINK, IB, PCIE = 450e9, 50e9, 64e9  # bytes/s each way (see the module)


def tcp_bytes_sent(pids: set[int]) -> dict[tuple[str, str], int]:
    """``bytes_sent`` of every TCP socket that one of ``pids`` holds, by (local, peer) address, from
    ``ss -tinpH`` (iproute2): what the kernel sent for each, whoever wrote it (gloo's threads,
    ZeroMQ's I/O threads, the control channel)."""
    ss = shutil.which("ss") or next((p for p in ("/usr/sbin/ss", "/sbin/ss") if os.access(p, os.X_OK)), None)
    if ss is None:
        raise RuntimeError("iproute2's `ss` is not installed (apt-get install iproute2): it counts the bytes")
    out = subprocess.run([ss, "-tinpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    sent: dict[tuple[str, str], int] = {}
    for head, info in zip(out[::2], out[1::2]):
        owners = {int(p) for p in re.findall(r"pid=(\d+)", head)}
        got = re.search(r"bytes_sent:(\d+)", info)
        if owners & pids and got:
            local, peer = head.split()[3:5]
            sent[(local, peer)] = int(got.group(1))
    return sent


def measure(replicas: int, width: int, layers: int, batch: int, steps: int) -> dict[str, float]:
    """One run of R = ``replicas`` (see the module): its median step (s) and the TCP bytes each stage
    process sent per step, averaged."""
    import torch
    from torch import nn

    import pipeq

    stages = make_stages(width, 2 * layers, 2)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(batch * replicas, width, generator=g), torch.randn(batch * replicas, width, generator=g))
            for _ in range(WARMUP + steps)]
    opt = functools.partial(torch.optim.SGD, lr=1e-3)
    with pipeq.PipelineRunner(stages, nn.MSELoss(), opt, "1f1b", 4, data_parallel=replicas, transport="tcp",
                              start_method="forkserver", threads_per_stage=1) as runner:
        for x, y in data[:WARMUP]:
            runner.step(x, y)
        pids = {p["pid"] for p in runner.stage_processes}
        runner.stats()  # every stage done with its steps (a step returns once its loss is in, before
        before = tcp_bytes_sent(pids)  # its first stages have summed their gradients)
        times = []
        for x, y in data[WARMUP:]:
            t0 = time.perf_counter()
            runner.step(x, y)
            times.append(time.perf_counter() - t0)
        runner.stats()
        after = tcp_bytes_sent(pids)
    sent = sum(n - before.get(sock, 0) for sock, n in after.items())
    return {"step_s": statistics.median(times), "bytes_per_process_step": sent / len(pids) / steps}


def measure_all(width: int, layers: int, batch: int, steps: int, pythonpath: str | None) -> dict[int, dict]:
    """R = 1, 2, 4, each in a fresh process (``pythonpath``: whose pipeq)."""
    out = {}
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    for r in (1, 2, 4):
        cmd = [sys.executable, os.path.abspath(__file__), "--measure", str(r), "--width", str(width), "--layers",
               str(layers), "--batch", str(batch), "--steps", str(steps)]
        got = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if got.returncode != 0:
            raise RuntimeError(f"R={r} failed:\n{got.stderr[-2000:]}")
        out[r] = json.loads(got.stdout.strip().splitlines()[-1])
    return out


def gradient_bytes(width: int, layers: int) -> int:
    return layers * (width * width + width) * 4


def report(name: str, runs: dict[int, dict], grads: int) -> list[dict[str, Any]]:
    rows = []
    base = runs[1]["bytes_per_process_step"]
    print(f"\n{name}: a stage's gradients {grads / 2**20:.1f} MiB")
    print(f"{'R':>3} {'step ms':>8} {'MiB/replica/step':>17} {'x ring':>7} {'x old link':>11}")
    for r, got in sorted(runs.items()):
        sent = got["bytes_per_process_step"] - base if r > 1 else 0.0
        ring, old = 2 * (r - 1) / r * grads, (r - 1) * grads
        rows.append({"impl": name, "replicas": r, "step_ms": 1000 * got["step_s"], "bytes_per_replica_step": sent,
                     "ring_bytes": ring, "old_link_bytes": old})
        ratio = f"{sent / ring:7.3f} {sent / old:11.3f}" if r > 1 else f"{'':>7} {'':>11}"
        print(f"{r:>3} {1000 * got['step_s']:>8.1f} {sent / 2**20:>17.2f} {ratio}")
    return rows


def table(params: float) -> list[dict[str, Any]]:
    """The analytic table for GPUs (see the module)."""
    g = 4 * params
    print(f"\nA stage of {params / 1e9:.2f}B fp32 parameters ({g / 1e9:.1f} GB of gradients), per GPU per step:")
    print(f"{'R':>3} {'ring GB':>8} {'old GB':>8} {'ring ms NVLink':>15} {'ring ms IB':>11} {'old ms (IB+PCIe)':>17}")
    rows = []
    for r in (2, 4, 8, 16, 32, 64):
        ring, old = 2 * (r - 1) / r * g, (r - 1) * g
        row = {"replicas": r, "ring_gb": ring / 1e9, "old_gb": old / 1e9, "ring_ms_nvlink": 1e3 * ring / NVLINK,
               "ring_ms_ib": 1e3 * ring / IB, "old_ms": 1e3 * (old / IB + 2 * g / PCIE)}
        rows.append(row)
        print(f"{r:>3} {row['ring_gb']:>8.1f} {row['old_gb']:>8.1f} {row['ring_ms_nvlink']:>15.1f} "
              f"{row['ring_ms_ib']:>11.1f} {row['old_ms']:>17.1f}")
    print("(bandwidth only: NVLink 450 GB/s and InfiniBand NDR 50 GB/s each way per GPU, PCIe 5.0 x16 64 GB/s; "
          "the old link also added R x the gradients on the CPU)")
    return rows


def _bytes_and_table(args: argparse.Namespace, layers: int, batch: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.bytes:
        grads = gradient_bytes(args.width, layers)
        out["measured"] = report("torch collectives (this checkout)",
                                 measure_all(args.width, layers, batch, args.steps, None), grads)
        if args.old:
            rev = old_revision(args.old)
            with tempfile.TemporaryDirectory() as where:
                tree = os.path.join(where, "old")
                subprocess.run(["git", "worktree", "add", "--detach", tree, rev], check=True, capture_output=True)
                try:
                    runs = measure_all(args.width, layers, batch, args.steps, tree)
                finally:
                    subprocess.run(["git", "worktree", "remove", "--force", tree], capture_output=True)
            out["measured"] += report(f"replica link ({rev})", runs, grads)
    if args.table:
        out["table"] = table(args.params)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def old_revision(spec: str) -> str:
    """The revision ``--old`` names (``auto``: the last one with pipeq/wire/replica_link.py)."""
    if spec != "auto":
        return spec
    gone = subprocess.run(["git", "rev-list", "-1", "HEAD", "--", "pipeq/wire/replica_link.py"], capture_output=True,
                          text=True, check=True).stdout.strip()
    return gone + "^"


# -- the run ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (after %d warm-up)" % WARMUP)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=256, help="the global batch (split over the replicas)")
    p.add_argument("--microbatches", type=int, default=4, help="per replica, for N = 2")
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2], help="the N to measure")
    p.add_argument("--bytes", action="store_true", help="the bytes and time of the replicas' sum at R = 1, 2, 4 "
                   "(--width, --steps; --layers and --batch per stage and replica: default 2 and 16)")
    p.add_argument("--old", metavar="REV", help="with --bytes: also git revision REV's pipeq ('auto': the replica "
                   "link's last)")
    p.add_argument("--table", action="store_true", help="the analytic table for GPUs")
    p.add_argument("--params", type=float, default=1.75e9, help="the table's stage size (parameters)")
    p.add_argument("--json", metavar="PATH", help="write every figure there")
    p.add_argument("--measure", type=int, metavar="R", help=argparse.SUPPRESS)  # (one --bytes run, in a fresh process)
    args = p.parse_args(argv)
    given = set(argv if argv is not None else sys.argv[1:])
    layers = args.layers if "--layers" in given else 2
    batch = args.batch if "--batch" in given else 16
    if args.measure:
        print(json.dumps(measure(args.measure, args.width, layers, batch, args.steps)))
        return {}
    if args.bytes or args.table:
        return _bytes_and_table(args, layers, batch)
    R = 2
    if args.batch % (2 * R):
        raise SystemExit("--batch must be a multiple of 4")
    mb = {n: 1 if n == 1 else args.microbatches for n in args.stages}
    grad_mb = 4 * n_params(args.width, args.layers) / 2**20
    per_replica = ", ".join(f"N = {n}: {mb[n]}" for n in args.stages)
    print(f"data parallelism: {args.layers} x Linear({args.width}, {args.width}) ({grad_mb:.1f} MiB of "
          f"gradients), global batch {args.batch}, R = 1 and {R}, N = {' and '.join(map(str, args.stages))} "
          f"(microbatches per replica: {per_replica}), {args.steps} steps x {args.rounds} rounds, "
          f"forkserver, 1 thread per process, {os.cpu_count()} cores", flush=True)

    # per N: T_1, T_2, T_comp (runners) and the probe (R = 2: work alone and beside, T_sync)
    jobs = [(n, what) for n in args.stages for what in ("T_1", "T_2", "T_comp", "probe")]
    got: dict[tuple[int, str], list] = {j: [] for j in jobs}
    shard = args.batch // R
    for r in range(args.rounds):
        order = jobs[r % len(jobs):] + jobs[:r % len(jobs)]
        for n, what in order:
            if what == "probe":
                t = probe(n, R, shard, mb[n], args.width, args.layers, args.steps)
            else:
                t = step_time(n, R if what == "T_2" else 1, shard if what == "T_comp" else args.batch,
                              mb[n], args.width, args.layers, args.steps)
            got[(n, what)].append(t)
        print(f"  round {r + 1}: " + "; ".join(
            f"N = {n}: T_1 {1e3 * got[(n, 'T_1')][-1]:.1f}, T_2 {1e3 * got[(n, 'T_2')][-1]:.1f}, "
            f"T_comp {1e3 * got[(n, 'T_comp')][-1]:.1f}, T_sync {1e3 * got[(n, 'probe')][-1][2]:.1f}"
            for n in args.stages) + " ms", flush=True)

    med = statistics.median
    result: dict = {}
    print(f"{'N':>2s} {'R=1 st/s':>9s} {'R=2 st/s':>9s} {'speedup':>8s} {'T_1':>7s} {'T_2':>7s} {'T_comp':>7s} "
          f"{'T_sync':>7s} {'T_2-T_comp':>10s} {'T_1/T_comp':>10s} {'T_sync/T_comp':>13s} {'contention':>10s}")
    for n in args.stages:
        t1, t2, tc = (med(got[(n, w)]) for w in ("T_1", "T_2", "T_comp"))
        alone, beside, ts = (med(p[i] for p in got[(n, "probe")]) for i in range(3))
        speedup = med(a / b for a, b in zip(got[(n, "T_1")], got[(n, "T_2")]))  # within each round
        res = {"steps_per_s_r1": 1 / t1, "steps_per_s_r2": 1 / t2, "speedup": speedup, "t1": t1, "t2": t2,
               "t_comp": tc, "t_sync": ts, "t_sync_indirect": t2 - tc, "ratio": ts / tc,
               "ratio_indirect": (t2 - tc) / tc, "work_alone": alone, "work_beside": beside,
               "contention": beside / alone, "rule_pays": ts / tc < R - 1, "pays": speedup > 1,
               "rule_speedup": R * tc / (tc + ts), "model_speedup": t1 / (tc * beside / alone + ts)}
        result[n] = res
        print(f"{n:2d} {1 / t1:9.2f} {1 / t2:9.2f} {speedup:7.2f}x {1e3 * t1:5.1f}ms {1e3 * t2:5.1f}ms "
              f"{1e3 * tc:5.1f}ms {1e3 * ts:5.1f}ms {1e3 * (t2 - tc):8.1f}ms {t1 / tc:10.2f} {ts / tc:13.2f} "
              f"{beside / alone:9.2f}x")
    print("(T_1, T_2: a step of R = 1, 2 on the whole batch; T_comp: of R = 1 on half of it; T_sync: the\n"
          " gradient all-reduce alone; contention: one shard's compute while the other replica computes\n"
          " its own / alone, plain torch in pinned processes)")
    print(f"rule (synchronous SGD): distribution pays while T_sync / T_comp < R - 1 = {R - 1}")
    for n in args.stages:
        res = result[n]
        print(f"N = {n}, R = {R} ({R * n} processes on {os.cpu_count()} cores): T_sync / T_comp = "
              f"{res['ratio']:.2f} {'<' if res['rule_pays'] else '>='} {R - 1}: the rule says it "
              f"{'pays' if res['rule_pays'] else 'does not pay'} (R T_comp / (T_comp + T_sync) = "
              f"{res['rule_speedup']:.2f}x)\n"
              f"   measured: R = 2 makes {res['speedup']:.2f}x the steps/s of R = 1: it "
              f"{'pays' if res['pays'] else 'does not pay'}; with the contention measured beside, "
              f"T_1 / (T_comp x {res['contention']:.2f} + T_sync) = {res['model_speedup']:.2f}x")
    return result


if __name__ == "__main__":
    main()
