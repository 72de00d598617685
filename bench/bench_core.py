#!/usr/bin/env python
"""pipeq core benchmarks: compute-bound MLP, schedule efficiency, transport bandwidth.

    python bench/bench_core.py                 # full run (~5-10 min on 2 cores)
    python bench/bench_core.py --quick         # smoke run (< 2 min)
    python bench/bench_core.py --only transport --repeats 7

Every measurement runs in fresh child processes (multiprocessing "spawn"), with torch's thread
count set explicitly in each; the parent only orchestrates and prints. pipeq itself runs inside a
child too (its stage processes are grandchildren), so a hang can be killed by a time-out. Children
get SIGKILL when this script dies (PR_SET_PDEATHSIG) and are terminated/killed when a section
fails or the script ends.

Module-level code must stay import-only: multiprocessing re-imports this file in every child
(and pipeq's stage processes unpickle the module-level stage classes from it).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from functools import partial
from typing import Any, Callable

import multiprocessing as mp
from multiprocessing.connection import wait as mp_wait

import torch
from torch import nn

from pipeq.testing import SleepStage

LR = 0.05  # large enough that the loss visibly moves (a cross-check between configs)
GLOO_WINDOW = 4
SLEEP_WIDTH = 16  # sleep-stage activations are (rows x 16) float32
SLEEP_MB_ROWS = 8  # rows per microbatch in the schedule probe (8 x 16 tensors)


# ==================================================================================================
# Stage modules (module level: picklable for pipeq's stage processes)
# ==================================================================================================
def make_stages(spec: tuple) -> list[nn.Module]:
    """spec = ("mlp", width, depth, n_stages) or ("sleep", n_stages, tf, tb). Deterministic."""
    if spec[0] == "mlp":
        _, width, depth, n = spec
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        per = len(layers) // n
        return [nn.Sequential(*layers[k * per:(k + 1) * per]) for k in range(n)]
    _, n, tf, tb = spec
    return [SleepStage(SLEEP_WIDTH, tf, tb) for _ in range(n)]  # pipeq.testing


def make_data(spec: tuple, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    width = spec[1] if spec[0] == "mlp" else SLEEP_WIDTH
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


# ==================================================================================================
# Child-process plumbing
# ==================================================================================================
def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _pin(rank: int) -> None:
    """Pin like pipeq's plan_devices does for one thread per stage: rank k -> core k mod ncpu."""
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        try:
            os.sched_setaffinity(0, [cores[rank % len(cores)]])
        except OSError:
            pass


def _threads(n: int) -> None:
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass


def _child_entry(fn: Callable, rank: int, world: int, conn: Any, args: tuple) -> None:
    _die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # lets `with runner:` clean up
    try:
        result = fn(rank, world, *args)
    except SystemExit:
        raise
    except BaseException:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # from here on a terminate() just ends us
        try:
            conn.send(("err", traceback.format_exc()))
        except Exception:
            pass
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    conn.send(("ok", result))
    conn.close()


class BenchError(RuntimeError):
    pass


_LIVE: list[mp.process.BaseProcess] = []


def _stop(procs: list) -> None:
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join(5.0)
    for p in procs:
        if p in _LIVE:
            _LIVE.remove(p)


def _become_subreaper() -> None:
    """Orphaned descendants (a stage process, a fork server, a resource tracker of a child we
    stopped) are re-parented to us instead of init, so that cleanup_children can end them."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _orphans() -> list[int]:
    me, keep = os.getpid(), set()
    try:
        from multiprocessing import resource_tracker

        keep.add(resource_tracker._resource_tracker._pid)  # ours: ends when we exit
    except Exception:
        pass
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) not in keep:
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
                if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                    found.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return found


def cleanup_children() -> None:
    _stop(list(_LIVE))
    deadline = time.monotonic() + 3.0  # re-parented descendants: let them finish, then kill
    while True:
        left = []
        for pid in _orphans():
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            if not done:
                left.append(pid)
        if not left:
            return
        if time.monotonic() > deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
            return
        time.sleep(0.05)


def run_group(label: str, fn: Callable, world: int, rank_args: Callable[[int], tuple], timeout: float) -> list:
    """Run fn(rank, world, *rank_args(rank)) in `world` fresh spawned processes; their results.
    (PIPEQ_BENCH_START=forkserver forks them from a warm fork server instead: the benches' smoke
    tests use it to skip an interpreter start and a torch import per child.)"""
    ctx = mp.get_context(os.environ.get("PIPEQ_BENCH_START", "spawn"))
    procs, pending = [], {}
    try:
        for r in range(world):
            recv_end, send_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child_entry, args=(fn, r, world, send_end, rank_args(r)),
                            name=f"bench-{label}-{r}", daemon=False)
            p.start()
            _LIVE.append(p)
            send_end.close()
            procs.append(p)
            pending[recv_end] = r
        results: list = [None] * world
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"{label}: timed out after {timeout:.0f} s "
                                 f"(ranks {sorted(pending.values())} never answered) -- hang?")
            for conn in mp_wait(list(pending), timeout=min(left, 1.0)):
                r = pending.pop(conn)
                try:
                    status, payload = conn.recv()
                except EOFError:
                    procs[r].join(2.0)
                    raise BenchError(f"{label}: rank {r} died without a result "
                                     f"(exit code {procs[r].exitcode})") from None
                if status == "err":
                    raise BenchError(f"{label}: rank {r} failed:\n{payload}")
                results[r] = payload
        for p in procs:
            p.join(10.0)
        return results
    finally:
        _stop(procs)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# ==================================================================================================
# Child bodies: training steps
# ==================================================================================================
def child_single(rank: int, world: int, spec: tuple, kind: str, threads: int, batch: int,
                 mbs: int, warmup: int, steps: int) -> dict:
    """One process: full-batch step, or the same microbatches accumulated (loss/m each)."""
    _threads(threads)
    model = nn.Sequential(*make_stages(spec))
    x, y = make_data(spec, batch)
    loss_fn = nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    xs, ys = x.chunk(mbs), y.chunk(mbs)
    times, losses = [], []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if kind == "full":
            loss = loss_fn(model(x), y)
            loss.backward()
            total = float(loss.detach())
        else:
            total = 0.0
            for xj, yj in zip(xs, ys):
                lj = loss_fn(model(xj), yj) / mbs
                lj.backward()
                total += float(lj.detach())
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(total)
    return {"times": times[warmup:], "losses": losses, "threads": torch.get_num_threads()}


def child_stage_only(rank: int, world: int, barrier: Any, spec: tuple, batch: int, mbs: int,
                     warmup: int, steps: int) -> dict:
    """Stage `rank`'s own work of one step (m forwards, m backwards, optimizer step), with every
    stage process running at once (a barrier per step) and no communication: what any 2-stage
    pipeline on this machine could at best do per stage, memory-bandwidth contention included."""
    _pin(rank)
    _threads(1)
    mod = make_stages(spec)[rank]
    x, y = make_data(spec, batch)
    xs, ys = x.chunk(mbs), y.chunk(mbs)
    loss_fn = nn.MSELoss()
    opt = torch.optim.SGD(mod.parameters(), lr=LR)
    times = []
    for _ in range(warmup + steps):
        barrier.wait(timeout=120)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        outs = []
        for xj in xs:
            inp = xj.detach().requires_grad_(rank > 0)
            outs.append((inp, mod(inp)))
        for j, (inp, out) in enumerate(outs):
            if rank == world - 1:
                (loss_fn(out, ys[j]) / mbs).backward()
            else:
                out.backward(torch.ones_like(out) * 1e-3)
        opt.step()
        times.append(time.perf_counter() - t0)
    return {"times": times[warmup:]}


def child_pipeq(rank: int, world: int, spec: tuple, schedules: list[str], batch: int, mbs: int,
                warmup: int, steps: int, transport: str, spin: float | None, start_method: str | None) -> dict:
    _threads(1)
    import inspect

    from pipeq import PipelineRunner

    kw: dict[str, Any] = {}
    params = inspect.signature(PipelineRunner).parameters
    if "start_method" in params:  # the library is evolving: pass it only where it exists
        if start_method:
            kw["start_method"] = start_method
        used = start_method or params["start_method"].default
    else:
        used = "forkserver (fixed)"
    if spin is not None:
        kw["spin"] = spin
    x, y = make_data(spec, batch)
    out = {}
    for name in schedules:
        t0 = time.perf_counter()
        runner = PipelineRunner(make_stages(spec), nn.MSELoss(), partial(torch.optim.SGD, lr=LR),
                                schedule=name, microbatches=mbs, threads_per_stage=1,
                                transport=transport, **kw)
        times, losses = [], []
        with runner:
            start_s = time.perf_counter() - t0
            for _ in range(warmup + steps):
                t1 = time.perf_counter()
                losses.append(runner.step(x, y))
                times.append(time.perf_counter() - t1)
            t2 = time.perf_counter()
        close_s = time.perf_counter() - t2
        out[name] = {"times": times[warmup:], "losses": losses, "start_s": start_s, "close_s": close_s,
                     "start_method": used}
    return out


def child_tdp(rank: int, world: int, port: int, spec: tuple, schedules: list[str], batch: int,
              mbs: int, warmup: int, steps: int) -> dict:
    """torch.distributed.pipelining on gloo: one rank per stage, 1 thread, pinned like pipeq."""
    _pin(rank)
    _threads(1)
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    try:
        mod = make_stages(spec)[rank]
        x, y = make_data(spec, batch)
        out = {}
        for name in schedules:
            stage = PipelineStage(mod, rank, world, torch.device("cpu"))
            sched = classes[name](stage, n_microbatches=mbs, loss_fn=nn.MSELoss())
            opt = torch.optim.SGD(mod.parameters(), lr=LR)
            times, losses = [], []
            dist.barrier()
            for _ in range(warmup + steps):
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                if rank == 0:
                    sched.step(x)
                elif rank == world - 1:
                    mb_losses: list = []
                    sched.step(target=y, losses=mb_losses, return_outputs=False)
                    losses.append(sum(float(v.detach()) for v in mb_losses) / len(mb_losses))
                else:
                    sched.step()
                opt.step()
                dist.barrier()
                times.append(time.perf_counter() - t0)
            out[name] = {"times": times[warmup:], "losses": losses}
            dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


# ==================================================================================================
# Child bodies: transport
# ==================================================================================================
def transport_plan(quick: bool, repeats: int) -> list[tuple[int, int, int]]:
    """(bytes per message, messages per round, timed rounds) per size."""
    sizes = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    target, cap, floor = ((64 << 20), 500, 2) if quick else ((256 << 20), 2000, 4)
    return [(s, max(floor, min(cap, math.ceil(target / s))), repeats) for s in sizes]


def child_zmq(rank: int, world: int, side: Any, proto: str, ipc_dir: str, plan: list,
              security: str | None = None, secret: Any = None) -> dict:
    """rank 1 receives (binds PULL + ack PUSH), rank 0 sends and times. pipeq's codec + tune_socket;
    with ``security`` ("encrypt" / "authenticate", tcp only) the sockets are secured as a stage's
    data sockets are (CURVE; or PLAIN + a per-message Poly1305 MAC, sealed and checked here)."""
    import zmq

    from pipeq.wire import codec
    from pipeq.wire.security import FrameMac, Gatekeeper, WireAuth, secure_client, secure_server
    from pipeq.wire.sockets import tune_process_allocator, tune_socket

    tune_process_allocator()  # as every pipeq stage process does at start
    _pin(rank)
    _threads(1)
    ctx = zmq.Context(io_threads=1)
    auth = WireAuth(secret, security) if security else None
    mac = FrameMac(auth, "F0") if security == "authenticate" else None
    socks = []
    gate = None
    try:
        if rank == 1:
            gate = Gatekeeper(ctx, auth) if auth is not None else None
            pull, ack = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
            socks += [pull, ack]
            eps = []
            for s, name in ((pull, "data"), (ack, "ack")):
                tune_socket(s)
                s.setsockopt(zmq.RCVTIMEO, 120_000)
                s.setsockopt(zmq.SNDTIMEO, 120_000)
                secure_server(s, auth, data=True)
                s.bind(f"ipc://{os.path.join(ipc_dir, name)}" if proto == "ipc" else "tcp://127.0.0.1:0")
                eps.append(s.getsockopt_string(zmq.LAST_ENDPOINT))
            side.send(eps)
            for size, n, rounds in plan:
                for _ in range(rounds + 1):  # +1: warm-up round
                    for _ in range(n):
                        frames = pull.recv_multipart(copy=False)
                        if mac is not None:
                            frames = mac.open(frames)
                            assert frames is not None, "a genuine message failed its MAC"
                        msg = codec.decode(frames)
                        assert msg.tensors[0].numel() * 4 == size
                        del msg, frames
                    ack.send(b"k")
            return {}
        ep_data, ep_ack = side.recv()
        push, ackin = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        socks += [push, ackin]
        for s, ep in ((push, ep_data), (ackin, ep_ack)):
            tune_socket(s)
            s.setsockopt(zmq.RCVTIMEO, 120_000)
            s.setsockopt(zmq.SNDTIMEO, 120_000)
            if auth is not None:
                secure_client(s, auth, ep, data=True)
            s.connect(ep)
        out = {}
        for size, n, rounds in plan:
            t = torch.ones(size // 4)

            def send_round() -> None:
                for i in range(n):
                    frames = codec.encode(codec.Kind.ACTIVATION, 0, i, [t])
                    push.send_multipart(mac.seal(frames) if mac is not None else frames, copy=False)
                ackin.recv()

            out[size] = _stream_rates(size, n, rounds, send_round)
        return out
    finally:
        for s in socks:
            s.close(linger=0)
        if gate is not None:
            gate.stop()
        ctx.term()


def _stream_rates(size: int, n: int, rounds: int, send_round: Callable[[], None]) -> list[float]:
    """GB/s of each of ``rounds`` timed rounds of ``n`` messages (after one warm-up round);
    ``send_round`` sends them and waits for the receiver's ack."""
    rates = []
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        send_round()
        dt = time.perf_counter() - t0
        if r:
            rates.append(size * n / dt / 1e9)
    return rates


def _windowed(n: int, window: int, post: Callable[[int], Any]) -> None:
    inflight: list = []
    for i in range(n):
        if len(inflight) == window:
            inflight.pop(0).wait()
        inflight.append(post(i))
    for w in inflight:
        w.wait()


def child_gloo(rank: int, world: int, port: int, plan: list, window: int) -> dict:
    """window 0: blocking dist.send / dist.recv into one reused buffer. window w > 0: up to w
    isend/irecv in flight (receiver rotates w reused buffers). The receiver acks each round."""
    import torch.distributed as dist

    _pin(rank)
    _threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))
    try:
        ack = torch.zeros(1)
        out = {}
        for size, n, rounds in plan:
            if rank == 1:
                bufs = [torch.empty(size // 4) for _ in range(max(1, window))]
                for _ in range(rounds + 1):
                    if window:
                        _windowed(n, window, lambda i: dist.irecv(bufs[i % window], src=0))
                    else:
                        for _ in range(n):
                            dist.recv(bufs[0], src=0)
                    dist.send(ack, dst=0)
                continue
            t = torch.ones(size // 4)

            def send_round() -> None:
                if window:
                    _windowed(n, window, lambda i: dist.isend(t, dst=1))
                else:
                    for _ in range(n):
                        dist.send(t, dst=1)
                dist.recv(ack, src=1)

            out[size] = _stream_rates(size, n, rounds, send_round)
        return out
    finally:
        dist.destroy_process_group()


def child_memcpy(rank: int, world: int, plan: list) -> dict:
    _threads(1)
    out = {}
    for size, n, rounds in plan:
        src, dst = torch.ones(size // 4), torch.empty(size // 4)
        dst.copy_(src)
        rates = []
        reps = max(n, 8)
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(reps):
                dst.copy_(src)
            rates.append(size * reps / (time.perf_counter() - t0) / 1e9)
        out[size] = rates
    return out


# ==================================================================================================
# Parent: sections
# ==================================================================================================
PROBLEMS: list[str] = []
SUMMARY: list[str] = []


def _attempt(label: str, thunk: Callable[[], Any]) -> Any:
    t0 = time.monotonic()
    try:
        res = thunk()
        print(f"  .. {label}: done in {time.monotonic() - t0:.1f} s ({_load()})", flush=True)
        return res
    except BenchError as exc:
        msg = str(exc)
        print(f"  !! {label}: FAILED after {time.monotonic() - t0:.1f} s: {msg}", flush=True)
        PROBLEMS.append(f"{label}: {msg.splitlines()[0]}" + (
            "\n      " + "\n      ".join(msg.splitlines()[-3:]) if len(msg.splitlines()) > 1 else ""))
        return None


def _verdict(value: float, target: float) -> str:
    if value != value:
        return "n/a"
    return "PASS" if value >= target else "FAIL"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)


def _g(v: float) -> str:
    return "-" if v is None or v != v else (f"{v:.3g}" if v < 100 else f"{v:.0f}")


def _f(v: float, nd: int = 2) -> str:
    return "-" if v is None or v != v else f"{v:.{nd}f}"


def section_compute(a: argparse.Namespace) -> None:
    W, batch, mbs, depth, n = a.width, 256, 8, 8, 2
    spec = ("mlp", W, depth, n)
    warmup, steps = (2, a.repeats or 5) if a.quick else (3, a.repeats or 16)
    rounds = 1 if a.quick else 2
    per_round = math.ceil(steps / rounds)
    to = 600.0
    print(f"\n=== [1] Compute-bound MLP: {depth} x (Linear({W},{W}) + ReLU), batch {batch}, {mbs} microbatches "
          f"of {batch // mbs}, SGD, MSELoss; 2 stages x {depth // n} layers ===")
    print(f"    {rounds} interleaved round(s) x ({warmup} warm-up + {per_round} timed steps) per config, each round in "
          f"fresh processes; steps/s = 1 / median step time; {_background()}\n", flush=True)
    res: dict[str, dict | None] = {}

    def merge(key: str, d: dict | None) -> None:
        if d is None:
            return
        if res.get(key) is None:
            res[key] = d
        else:
            res[key]["times"] += d["times"]  # type: ignore[index]

    for rnd in range(rounds):
        tag = f" [round {rnd + 1}/{rounds}]" if rounds > 1 else ""
        for key, kind, thr in (("a", "full", 1), ("b", "full", 2), ("c", "accum", 1)):
            merge(key, _attempt(f"({key}) single process {kind} {thr} thr{tag}", lambda: run_group(
                f"single-{key}", child_single, 1,
                lambda _r: (spec, kind, thr, batch, mbs, warmup, per_round), to)[0]))
        r = _attempt(f"(d) pipeq fill-drain + 1f1b{tag}", lambda: run_group(
            "pipeq-mlp", child_pipeq, 1,
            lambda _r: (spec, ["fill-drain", "1f1b"], batch, mbs, warmup, per_round, a.pipeq_transport, a.spin,
                        a.start_method), to)[0])
        if r:
            merge("pq-fd", r["fill-drain"])
            merge("pq-1f1b", r["1f1b"])
        barrier = mp.get_context("spawn").Barrier(n)
        r = _attempt(f"(f) no-comm bound: {n} stages at once{tag}", lambda: run_group(
            "stage-only", child_stage_only, n,
            lambda _r: (barrier, spec, batch, mbs, warmup, per_round), to))
        if r:  # per step the slower stage counts; a pipeline adds (N-1) fill/drain slots of m+N-1
            merge("f", {"times": [max(ts) * (mbs + n - 1) / mbs for ts in zip(*(d["times"] for d in r))],
                        "stage_ms": [med(d["times"]) * 1e3 for d in r]})
        port = free_port()
        r = _attempt(f"(e) TDP gloo GPipe + 1F1B{tag}", lambda: run_group(
            "tdp-mlp", child_tdp, n,
            lambda _r: (port, spec, ["gpipe", "1f1b"], batch, mbs, warmup, per_round), to))
        if r:
            for s in ("gpipe", "1f1b"):
                r[0][s]["losses"] = r[n - 1][s]["losses"]  # losses live on the last rank
            merge("tdp-gpipe", r[0]["gpipe"])
            merge("tdp-1f1b", r[0]["1f1b"])

    def sps(k: str) -> float:
        return 1.0 / med(res[k]["times"]) if res.get(k) else float("nan")

    labels = {
        "a": "(a) 1 process, 1 thread, full batch",
        "b": "(b) 1 process, 2 threads, full batch",
        "c": f"(c) 1 process, 1 thread, {mbs} microbatches accumulated",
        "pq-fd": "(d) pipeq fill-drain, 2 procs x 1 thread",
        "pq-1f1b": "(d) pipeq 1f1b, 2 procs x 1 thread",
        "tdp-gpipe": "(e) TDP ScheduleGPipe, gloo, 2 x 1 thread",
        "tdp-1f1b": "(e) TDP Schedule1F1B, gloo, 2 x 1 thread",
        "f": f"(f) bound: both stages' work at once, no comm, x {mbs + n - 1}/{mbs}",
    }
    rows = []
    for k, lab in labels.items():
        d = res.get(k)
        if not d:
            rows.append([lab, "FAILED", "-", "-", "-", "-", "-", "-"])
            continue
        t = [v * 1e3 for v in d["times"]]
        rows.append([lab, _f(sps(k)), _f(med(t), 1), f"{_f(pct(t, .1), 1)}-{_f(pct(t, .9), 1)}",
                     _f(sps(k) / sps("c")), _f(sps(k) / sps("a")),
                     f"{d['losses'][0]:.6f}" if d.get("losses") else "-",
                     f"{d['losses'][-1]:.6f}" if d.get("losses") else "-"])
    print()
    print(_table(["config", "steps/s", "med ms", "p10-p90 ms", "vs (c)", "vs (a)", "loss@1", "loss@last"], rows))
    if res.get("pq-fd"):
        _print_lifecycle(res["pq-fd"], res["pq-1f1b"])
    print("    loss@1 should agree across rows (same init, data and split); loss@last too (same number of updates).")
    if res.get("f"):
        alone = f"; alone, (c)/2 = {med(res['c']['times']) * 1e3 / 2:.1f} ms" if res.get("c") else ""
        print("    (f): per-stage step work with both stages running at once (shared caches/memory bandwidth): "
              + ", ".join(f"stage {k} {v:.1f} ms" for k, v in enumerate(res["f"]["stage_ms"])) + alone)
    ideal = 2 * mbs / (mbs + n - 1)
    ratio_rows = []
    for pq, tdp, nm in (("pq-fd", "tdp-gpipe", "fill-drain"), ("pq-1f1b", "tdp-1f1b", "1f1b")):
        vc, vt = sps(pq) / sps("c"), sps(pq) / sps(tdp)
        ratio_rows.append([f"pipeq {nm} / (c) same microbatches", _f(vc), f">= 1.60 (ideal {ideal:.2f})",
                           _verdict(vc, 1.6)])
        ratio_rows.append([f"pipeq {nm} / TDP same schedule", _f(vt), ">= 1.25", _verdict(vt, 1.25)])
        SUMMARY.append(f"compute  pipeq {nm:10s} / (c) = {_f(vc)} (>= 1.60: {_verdict(vc, 1.6)}); "
                       f"/ TDP = {_f(vt)} (>= 1.25: {_verdict(vt, 1.25)})")
    for pq, nm in (("pq-fd", "fill-drain"), ("pq-1f1b", "1f1b")):
        ratio_rows.append([f"pipeq {nm} / (a) 1 thread full batch", _f(sps(pq) / sps("a")), "info", ""])
        ratio_rows.append([f"pipeq {nm} / (b) 2 threads full batch", _f(sps(pq) / sps("b")), "info", ""])
    ratio_rows.append(["TDP GPipe / (c)", _f(sps("tdp-gpipe") / sps("c")), "info", ""])
    ratio_rows.append(["TDP 1F1B / (c)", _f(sps("tdp-1f1b") / sps("c")), "info", ""])
    ratio_rows.append(["(c) / (a): cost of 32-row microbatches", _f(sps("c") / sps("a")), "info", ""])
    ratio_rows.append(["(f) bound / (c): best a 2-stage pipeline can do here", _f(sps("f") / sps("c")), "info", ""])
    for pq, nm in (("pq-fd", "fill-drain"), ("pq-1f1b", "1f1b")):
        ratio_rows.append([f"pipeq {nm} / (f) bound", _f(sps(pq) / sps("f")), "info", ""])
    print()
    print(_table(["ratio", "value", "target", ""], ratio_rows), flush=True)


def _print_lifecycle(fd: dict, ofob: dict) -> None:
    print(f"    pipeq lifecycle (start_method {fd['start_method']}): start fill-drain {fd['start_s']:.2f} s, "
          f"1f1b {ofob['start_s']:.2f} s; close fill-drain {fd['close_s']:.2f} s, 1f1b {ofob['close_s']:.2f} s")


def _background(seconds: float = 0.5) -> str:
    """CPU busy share of the whole machine over a short idle moment (others' work: we run nothing)."""
    def snap() -> list[int]:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    try:
        v1 = snap()
        time.sleep(seconds)
        d = [b - a for a, b in zip(v1, snap())]
        total = max(1, sum(d[:8]))  # user nice system idle iowait irq softirq steal
        busy = 100.0 * (total - d[3] - d[4] - d[7]) / total
        steal = 100.0 * d[7] / total
    except (OSError, ValueError, IndexError):
        return "background CPU busy ?"
    warn = "  <-- WARNING: something else is using the CPU; numbers will be noisy" if busy > 15 or steal > 15 else ""
    return f"background CPU busy {busy:.0f}%, hypervisor steal {steal:.0f}% ({_load()}){warn}"


def _load() -> str:
    try:
        return "load avg %.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        return "load avg ?"


def _measure_sleep(t: float, n: int) -> float:
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        time.sleep(t)
        xs.append(time.perf_counter() - t0)
    return med(xs)


def section_schedule(a: argparse.Namespace) -> None:
    n, mbs = 4, 8
    batch = mbs * SLEEP_MB_ROWS
    warmup, steps = (2, a.repeats or 6) if a.quick else (3, a.repeats or 20)
    to = 600.0
    slots = mbs + n - 1
    print(f"\n=== [2] Schedule efficiency: {n} sleep stages, {mbs} microbatches of {SLEEP_MB_ROWS}x{SLEEP_WIDTH}, "
          f"ideal = (m+N-1)(t_f+t_b) = {slots} slots ===")
    print(f"    {warmup} warm-up + {steps} timed steps per config; pipeq and TDP ranks pinned stage k -> core k mod ncpu")
    print(f"    {_background()}\n", flush=True)
    for tf, tb in ((1e-3, 2e-3), (5e-3, 10e-3)):
        spec = ("sleep", n, tf, tb)
        sf, sb = _measure_sleep(tf, 40), _measure_sleep(tb, 40)
        ideal_nom = slots * (tf + tb)
        ideal_meas = slots * (sf + sb)
        print(f"  t_f = {tf * 1e3:g} ms, t_b = {tb * 1e3:g} ms: time.sleep({tf * 1e3:g} ms) really takes "
              f"{sf * 1e3:.3f} ms, time.sleep({tb * 1e3:g} ms) {sb * 1e3:.3f} ms (median of 40, this process)")
        print(f"  ideal nominal = {slots} x {(tf + tb) * 1e3:g} ms = {ideal_nom * 1e3:.1f} ms; "
              f"ideal with measured sleeps = {slots} x {(sf + sb) * 1e3:.2f} ms = {ideal_meas * 1e3:.1f} ms", flush=True)
        res: dict[str, dict | None] = {}
        r = _attempt(f"pipeq sleep {tf * 1e3:g}/{tb * 1e3:g} ms", lambda: run_group(
            "pipeq-sleep", child_pipeq, 1,
            lambda _r: (spec, ["fill-drain", "1f1b"], batch, mbs, warmup, steps, a.pipeq_transport, a.spin, a.start_method), to)[0])
        res["pipeq fill-drain"], res["pipeq 1f1b"] = (r["fill-drain"], r["1f1b"]) if r else (None, None)
        if r:
            _print_lifecycle(r["fill-drain"], r["1f1b"])
        port = free_port()
        r = _attempt(f"TDP sleep {tf * 1e3:g}/{tb * 1e3:g} ms", lambda: run_group(
            "tdp-sleep", child_tdp, n,
            lambda _r: (port, spec, ["gpipe", "1f1b"], batch, mbs, warmup, steps), to))
        res["TDP GPipe"], res["TDP 1F1B"] = (r[0]["gpipe"], r[0]["1f1b"]) if r else (None, None)
        rows = []
        for k, d in res.items():
            if not d:
                rows.append([k, "FAILED", "-", "-", "-", "-", "-", ""])
                continue
            t = med(d["times"])
            over = (t - ideal_meas) / slots
            v = t / ideal_nom
            target = "<= 1.30: " + ("PASS" if v <= 1.3 else "FAIL") if k.startswith("pipeq") else ""
            rows.append([k, _f(t * 1e3, 1), f"{_f(pct(d['times'], .1) * 1e3, 1)}-{_f(pct(d['times'], .9) * 1e3, 1)}",
                         _f(1 / t, 1), _f(v), _f(t / ideal_meas), _f(over * 1e3), target])
            if k.startswith("pipeq"):
                SUMMARY.append(f"schedule {tf * 1e3:g}/{tb * 1e3:g} ms {k:16s} = {v:.2f}x ideal nominal "
                               f"({t / ideal_meas:.2f}x measured-sleep ideal); target <= 1.30: "
                               f"{'PASS' if v <= 1.3 else 'FAIL'}")
        print()
        print(_table(["config", "med ms", "p10-p90 ms", "steps/s", "/ ideal nom", "/ ideal meas",
                      "extra ms/slot", "target (vs nominal)"], rows))
        print("    extra ms/slot = (median step - ideal with measured sleeps) / (m+N-1): per-slot overhead "
              "on the critical path\n", flush=True)


def section_transport(a: argparse.Namespace) -> None:
    repeats = a.repeats or (3 if a.quick else 5)
    plan = transport_plan(a.quick, repeats)
    to = 600.0
    print("\n=== [3] Transport: one-way float32 tensor stream between two processes (GB/s = 1e9 B/s, "
          f"median of {repeats} rounds after 1 warm-up round) ===")
    print("    pipeq wire: codec.encode -> PUSH send_multipart(copy=False) -> PULL recv_multipart(copy=False) -> "
          "codec.decode, sockets tuned by pipeq.wire.sockets.tune_socket")
    print(f"    gloo blk: blocking dist.send / dist.recv into a reused buffer; gloo w{GLOO_WINDOW}: isend/irecv with up to "
          f"{GLOO_WINDOW} in flight (rotating reused buffers)")
    print("    memcpy: dst.copy_(src) into a reused tensor, 1 thread, one process")
    print("    each round: a stream of N messages, then one ack from the receiver; timed on the sender")
    print(f"    {_background()}\n", flush=True)
    res: dict[str, dict | None] = {}
    ctx = mp.get_context("spawn")
    from pipeq.wire.keys import JobSecret

    secret = JobSecret.generate()
    for proto, security in (("ipc", None), ("tcp", None), ("tcp", "encrypt"), ("tcp", "authenticate")):
        ipc_dir = tempfile.mkdtemp(prefix="pipeq-bench-")
        name = f"pipeq {proto}" + (f" {security}" if security else "")
        try:
            a_end, b_end = ctx.Pipe()
            r = _attempt(name, lambda: run_group(
                f"zmq-{proto}", child_zmq, 2,
                lambda rank: (a_end if rank == 0 else b_end, proto, ipc_dir, plan, security, secret), to))
            res[name] = r[0] if r else None
            a_end.close()
            b_end.close()
        finally:
            for f in os.listdir(ipc_dir):
                try:
                    os.unlink(os.path.join(ipc_dir, f))
                except OSError:
                    pass
            os.rmdir(ipc_dir)
    for key, window in (("gloo", 0), ("gloo win", GLOO_WINDOW)):
        port = free_port()
        r = _attempt(f"{key} send/recv (window {window})", lambda: run_group(
            "gloo-p2p", child_gloo, 2, lambda _r: (port, plan, window), to))
        res[key] = r[0] if r else None
    r = _attempt("memcpy", lambda: run_group("memcpy", child_memcpy, 1, lambda _r: (plan,), to)[0])
    res["memcpy"] = r

    def g(k: str, size: int) -> float:
        d = res.get(k)
        return med(d[size]) if d and size in d else float("nan")

    rows = []
    for size, nmsg, _ in plan:
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        ipc, tcp, mc = g("pipeq ipc", size), g("pipeq tcp", size), g("memcpy", size)
        gb, gw = g("gloo", size), g("gloo win", size)
        gl = max(v for v in (gb, gw, -1.0) if v == v)  # the better gloo variant (the stricter target)
        gl = gl if gl > 0 else float("nan")
        target = ""
        if size >= 256 << 10:
            target = "ipc " + _verdict(ipc / gl, 1.0) + ", tcp " + _verdict(tcp / gl, 1.0)
            SUMMARY.append(f"transport {label:7s} pipeq ipc/gloo = {_f(ipc / gl)}, tcp/gloo = {_f(tcp / gl)} "
                           f"(vs the better gloo variant; >= 1.0: ipc {_verdict(ipc / gl, 1.0)}, "
                           f"tcp {_verdict(tcp / gl, 1.0)})")
        enc, mac = g("pipeq tcp encrypt", size), g("pipeq tcp authenticate", size)
        rows.append([label, str(nmsg), _g(ipc), _g(tcp), _g(enc), _g(mac), _g(gb), _g(gw), _g(mc), _f(ipc / gl),
                     _f(tcp / gl), _f(enc / tcp), _f(mac / tcp), _f(ipc / mc, 3), target])
        if size in (256 << 10, 4 << 20, 64 << 20):
            SUMMARY.append(f"transport {label:7s} tcp security: encrypt {_g(enc)} GB/s ({_f(enc / tcp)} of "
                           f"unauthenticated tcp), authenticate {_g(mac)} GB/s ({_f(mac / tcp)})")
    print()
    print(_table(["size", "msgs/round", "pipeq ipc", "tcp (no auth)", "tcp encrypt", "tcp authent.", "gloo blk",
                  f"gloo w{GLOO_WINDOW}", "memcpy", "ipc/gloo", "tcp/gloo", "encrypt/tcp", "authent./tcp",
                  "ipc/memcpy", "target >= 1.0 (>= 256 KiB)"], rows))
    print("    ipc/gloo and tcp/gloo divide by the better of the two gloo columns; 'tcp (no auth)' is the bare wire\n"
          "    (pipeq itself never opens an unauthenticated TCP port): encrypt = CURVE (the default),\n"
          "    authenticate = PLAIN handshake + a Poly1305 MAC per message (tcp_security='authenticate')", flush=True)


# ==================================================================================================
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fast smoke run (fewer steps and rounds)")
    p.add_argument("--only", action="append", choices=["compute", "schedule", "transport"],
                   help="run only this probe (repeatable); default all three")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed repetitions per measurement: steps (compute, schedule) or stream rounds "
                        "(transport); default 15/20/5, quick 5/6/3")
    p.add_argument("--width", type=int, default=1024, help="MLP width W for the compute probe (default 1024)")
    p.add_argument("--pipeq-transport", choices=["ipc", "tcp"], default="ipc",
                   help="PipelineRunner transport for the compute and schedule probes (default ipc)")
    p.add_argument("--start-method", choices=["spawn", "forkserver"], default=None,
                   help="PipelineRunner(start_method=...) if the library has it (default: the library's default; "
                        "--quick: forkserver)")
    p.add_argument("--spin", type=float, default=None,
                   help="PipelineRunner(spin=...) seconds (default: the library's default)")
    a = p.parse_args()
    if a.repeats is not None and a.repeats < 1:
        p.error("--repeats must be >= 1")
    sections = a.only or ["compute", "schedule", "transport"]
    if a.quick and a.start_method is None:
        a.start_method = "forkserver"  # stage start-up is not what is measured; keeps --quick quick

    def _term(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _term)
    _become_subreaper()
    t0 = time.monotonic()
    print(f"pipeq bench_core: torch {torch.__version__}, {os.cpu_count()} cpus "
          f"(affinity {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'}), "
          f"python {sys.version.split()[0]}, mode {'quick' if a.quick else 'full'}", flush=True)
    print(f"  at start: {_background()}", flush=True)
    try:
        for s in ("compute", "schedule", "transport"):
            if s in sections:
                {"compute": section_compute, "schedule": section_schedule, "transport": section_transport}[s](a)
    finally:
        cleanup_children()
        try:  # our own resource tracker would otherwise outlive us by a few ms
            from multiprocessing import resource_tracker

            resource_tracker._resource_tracker._stop()
        except Exception:
            pass
    print("\n=== Summary vs targets ===")
    for line in SUMMARY:
        print("  " + line)
    if PROBLEMS:
        print("\n=== Problems ===")
        for line in PROBLEMS:
            print("  " + line)
    print(f"\ntotal wall time {time.monotonic() - t0:.0f} s", flush=True)
    return 1 if PROBLEMS else 0


if __name__ == "__main__":
    sys.exit(main())
