#!/usr/bin/env python
"""pipeq same-host benchmark (issue 16): payloads at memory speed, hops at socket speed.

    python bench/bench_samehost.py                      # full run (about 3 min on 2 cores, estimated)
    python bench/bench_samehost.py --quick              # smoke run (about 85 s on 2 cores)
    python bench/bench_samehost.py --quick --only throughput --only rtt
    python bench/bench_samehost.py --only sleep --repeats 30
    python bench/bench_samehost.py --only rtt --round-trips 20000

Four probes, side by side in one run, then one summary table of every target with PASS/FAIL and
the background load seen at the start and at the end (the machine is shared: compare the rows of
one run, not figures from another run). Every ratio is computed from this run's measurements.
After each probe the CPU time other processes used meanwhile is printed (the machine's busy time
from /proc/stat minus this run's own, its reaped descendants included; fork servers and other
strays are reaped first): the 0.5 s idle snapshot of ``bench_core._background`` misses work that
starts in the middle of a probe, and a probe where others took more than 10% of the machine is
marked "disturbed".

[1] throughput -- one-way GB/s (1e9 B/s) of float32 tensors of 256 KiB, 4 MiB and 64 MiB between
    two processes pinned to a core each (rank k -> core k mod ncpu), 1 torch thread each:
      pipeq ipc        two ``pipeq.wire.transport.ProcessTransport`` (one stage each) bound on ipc (a private directory
                       from ``make_ipc_dir``): process 0 ``send_activation``s, process 1
                       ``wait_data(forward_queue, step, i)``s each message in order. When this
                       checkout's ProcessTransport takes ``shm=`` (and ``pipeq.wire.shm`` imports) the
                       column passes ``shm=ShmConfig(prefix="pipeq-bench-<pid>-<random>", slots=4, max_bytes=256 MiB)``
                       and a second column, "pipeq ipc, zmq frames", runs the same without it
                       (the before/after in one run); otherwise it is labelled "(no shm)".
      tcp encrypt      the same transports bound on tcp 127.0.0.1 with
      tcp authenticate ``WireAuth(JobSecret.generate(), mode)``: CURVE, or PLAIN + a Poly1305 MAC
                       per message. Never given ``shm=``: these columns are the socket path, what
                       a hop between hosts costs.
      gloo blk / w4    ``bench_core.child_gloo``: blocking send/recv into a reused buffer, and
                       isend/irecv with 4 in flight; ratios use the better of the two.
      memcpy           ``bench_core.child_memcpy``: ``dst.copy_(src)`` of the same size, 1 thread.
    A round = the sender streams n messages (``bench_core.transport_plan``: 64 MiB per round in
    --quick, 256 MiB otherwise, at most 500 / 2000 messages, at least 2 / 4), then waits for a
    one-message ack (a ``send_gradient`` back); timed on the sender; median of the timed rounds
    after two warm-up rounds for pipeq (the first timed 64 MiB round after a smaller size was
    often several times slower: the receiver's heap growing; gloo receives into reused buffers
    and memcpy reuses its tensors, so bench_core's single warm-up stays for them). The sender
    rotates 3 tensors whose first and last elements mark which one it is (it never writes a
    tensor after sending it): the receiver checks the shape and both marks of every message, and
    every element in the first warm-up round, so a payload overwritten or mixed up on the way
    (e.g. a shared-memory slot reused too early) fails the run.
    Both processes call ``tune_process_allocator()`` first, as stage processes do, and the queue
    capacity is far above a round, so a message never waits for room.
    **Targets:** 64 MiB pipeq ipc >= 0.5x memcpy; 4 MiB pipeq ipc >= 2x the better gloo.

[2] rtt -- small-message round trip, 16 float32 (64 bytes of payload), two pinned processes,
    median / p10 / p90 in microseconds over --round-trips round trips after 200 warm-up ones:
      pipeq ipc        A.send_activation -> B.wait_data(B.forward_queue) -> B.send_gradient(x + 1)
                       -> A.wait_data(A.backward_queue), spin_s=0.01 (PipelineRunner's default
                       ``spin``), shm= as in [1] when it exists; values checked on both sides.
      pipeq ipc spin 0 the same with spin_s=0 (info: a blocked wait's wake-up, every hop).
      raw pyzmq        bare PUSH/PULL over ipc with pipeq's socket options (``tune_socket``), one
                       64-byte frame each way, received the way wait_data does (spin 10 ms on a
                       non-blocking recv, yielding the core): libzmq's share without pipeq's.
      AF_UNIX          a raw SOCK_SEQPACKET pair (one connected socket each), blocking
                       send / recv_into of 64 bytes: the floor any same-host socket has.
      gloo             blocking dist.send / dist.recv of the same tensor.
    For pipeq, two parts of the round trip are timed too: "A send" (A's send_activation call)
    and "B turn" (B, from wait_data's return to send_gradient's return, x + 1 included).
    **Target:** pipeq ipc median <= 150 us.

[3] sleep -- bench_core's schedule probe: 4 ``pipeq.testing.SleepStage`` stages, forward/backward
    1/2 ms and 5/10 ms, 8 microbatches of 8x16: median step time over the ideal (m+N-1)(tf+tb),
    nominal and with the ``time.sleep`` durations measured here, pipeq fill-drain and 1f1b
    (``PipelineRunner``, process mode, its default spin) beside torch.distributed.pipelining
    GPipe and 1F1B on gloo. **Target:** pipeq <= 1.3x the nominal ideal at 1/2 ms (5/10 ms: info).

[4] mlp -- bench_core's compute probe, reduced to what issue 16 asks: 8 x (Linear(1024) + ReLU),
    batch 256, 8 microbatches, 2 stages, SGD, MSELoss: pipeq fill-drain and 1f1b steps/s over the
    no-communication bound measured in the same run (``child_stage_only``: each stage's own work
    of a step in two pinned processes at once, no communication, x (m+N-1)/m). Info, no target.
    With --quick's 5 timed steps the bound itself moved by about 10% between runs (a ratio above
    1.0 is the bound's noise, not pipeq beating it); use the full run or --repeats 16 for it.

--quick: fewer rounds, steps and round trips, forkserver for PipelineRunner's stages (start-up is
not what is measured). --repeats N: timed rounds in [1], timed steps in [3] and [4];
--round-trips N: timed round trips in [2] (default 5000, --quick 2000). Children are
fresh spawned processes (``bench_core.run_group``: killed on a time-out or when this script
dies); a failed measurement is listed under "Problems" and the exit code is 1. Shared-memory
segments left in /dev/shm under this run's prefix are removed and reported as a problem.

Module-level code must stay import-only: multiprocessing re-imports this file in every child.
"""

from __future__ import annotations

import argparse
import inspect
import os
import secrets
import socket
import struct
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import multiprocessing as mp

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import bench_core as bc  # noqa: E402  (bench/ on the path first)
from bench_core import _attempt, _f, _g, _pin, _table, _threads, med, pct, run_group  # noqa: E402

SIZES = (256 << 10, 4 << 20, 64 << 20)
PATTERNS = 3  # the sender rotates this many distinct tensors per size
WARMUP_ROUNDS = 2  # pipeq streams: the first round checks every element, the second settles the allocator
RTT_FLOATS = 16  # 64 bytes of payload
RTT_WARMUP = 200
SPIN_S = 0.01  # PipelineRunner's default spin
MAX_FRAME = 256 << 20
TIMEOUT = 300.0

SUMMARY: list[list[str]] = []  # [probe, measured, target, verdict]


# ==================================================================================================
# Shared memory: passed only where this checkout has it
# ==================================================================================================
def shm_config_class() -> Any:
    """``pipeq.wire.shm.ShmConfig`` if ProcessTransport takes ``shm=`` and pipeq.wire.shm imports, else None."""
    from pipeq.wire.transport import ProcessTransport

    if "shm" not in inspect.signature(ProcessTransport).parameters:
        return None
    try:
        from pipeq.wire.shm import ShmConfig
    except ImportError:
        return None
    return ShmConfig


def _sweep_shm(prefix: str) -> int:
    """Remove what a run left in /dev/shm under ``prefix``; how many there were."""
    left = 0
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return 0
    for name in names:
        if name.startswith(prefix):
            left += 1
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
    return left


# ==================================================================================================
# Child bodies: two stage processes' transports (one stage each: chunk 0)
# ==================================================================================================
def _wire(rank: int, side: Any, mode: str, ipc_dir: str, secret: Any, shm_prefix: str | None,
          spin_s: float, capacity: int) -> tuple[Any, Any]:
    """Process ``rank``'s ProcessTransport (one stage: chunk 0), wired to the other one: 0 sends
    activations to 1, 1 sends gradients to 0. Rank 1 also hosts the control server (nothing is ever sent on it).
    ``mode``: "ipc", or the tcp security mode ("encrypt" / "authenticate")."""
    from pipeq.wire.control_link import ControlServer
    from pipeq.wire.security import WireAuth
    from pipeq.wire.sockets import BindTo, tune_process_allocator
    from pipeq.wire.transport import ProcessTransport

    tune_process_allocator()  # as a stage process does, before any of ZeroMQ's threads exist
    _pin(rank)  # pinned first: ZeroMQ's I/O thread inherits the affinity
    _threads(1)
    if mode == "ipc":
        bind, auth = BindTo.ipc(ipc_dir), None
    else:
        bind, auth = BindTo.tcp("127.0.0.1"), WireAuth(secret, mode)
    kw: dict[str, Any] = {}
    if shm_prefix:
        shm_cls = shm_config_class()
        if shm_cls is None:
            raise RuntimeError("shm requested, but ProcessTransport takes no shm= here")
        kw["shm"] = shm_cls(prefix=shm_prefix, slots=4, max_bytes=MAX_FRAME)  # one run: both ends name the same segments
    ctrl = None
    if rank == 1:
        ctrl = ControlServer(bind, auth)
        side.send(ctrl.address)
        control_addr = ctrl.address
    else:
        control_addr = side.recv()
    tr = ProcessTransport([rank], control_addr, bind=bind, queue_capacity=capacity, spin_s=spin_s, auth=auth,
                          max_frame_bytes=MAX_FRAME, **kw)
    side.send(tr.addresses(0))
    peer = side.recv()
    if rank == 0:
        tr.connect(0, peer["forward"], None)
    else:
        tr.connect(0, None, peer["backward"])
    return tr, ctrl


def _finish(rank: int, side: Any) -> None:
    """Rank 0 has its last answer: let rank 1 close only now (closing drops unsent messages)."""
    if rank == 0:
        side.send("done")
    else:
        side.recv()


def _close(tr: Any, ctrl: Any) -> None:
    if tr is not None:
        tr.close()
    if ctrl is not None:
        ctrl.close()


def _patterns(numel: int) -> list[torch.Tensor]:
    """PATTERNS tensors 0, 1, 2, ... numel-1 whose first and last elements are -1 - j."""
    out = []
    for j in range(PATTERNS):
        t = torch.arange(numel, dtype=torch.float32)
        t[0] = t[-1] = -1.0 - j
        out.append(t)
    return out


def child_stream(rank: int, world: int, side: Any, mode: str, ipc_dir: str, secret: Any,
                 shm_prefix: str | None, plan: list) -> dict:
    """[1]: rank 0 streams each round's messages and waits for rank 1's ack; GB/s per round."""
    capacity = max(n for _, n, _ in plan) + 64
    tr = ctrl = None
    try:
        tr, ctrl = _wire(rank, side, mode, ipc_dir, secret, shm_prefix, SPIN_S, capacity)
        out: dict[int, list[float]] = {}
        step = 0
        for size, n, rounds in plan:
            numel = size // 4
            if rank == 1:
                ref = torch.arange(numel, dtype=torch.float32)
                for r in range(rounds + WARMUP_ROUNDS):
                    step += 1
                    for i in range(n):
                        msg = tr.wait_activation(0, step, i)
                        mark = -1.0 - (i % PATTERNS)
                        ok = len(msg.tensors) == 1 and msg.tensors[0].numel() == numel
                        if ok:
                            v = msg.tensors[0]
                            a = v.numpy()
                            ok = a[0] == mark and a[-1] == mark and (r > 0 or torch.equal(v[1:-1], ref[1:-1]))
                            del v, a
                        if not ok:
                            raise AssertionError(f"{mode} {size} B, step {step}, message {i}: payload is not what was "
                                                 f"sent (shapes {[tuple(t.shape) for t in msg.tensors]})")
                        del msg
                    tr.send_gradient(0, step, 0, [torch.full((1,), float(n))])
                del ref
                continue
            ts = _patterns(numel)
            rates = []
            for r in range(rounds + WARMUP_ROUNDS):
                step += 1
                t0 = time.perf_counter()
                for i in range(n):
                    tr.send_activation(0, step, i, [ts[i % PATTERNS]])
                ack = tr.wait_gradient(0, step, 0)
                dt = time.perf_counter() - t0
                if ack.tensors[0].item() != n:
                    raise AssertionError(f"ack of step {step} says {ack.tensors[0].item()}, not {n}")
                if r >= WARMUP_ROUNDS:
                    rates.append(size * n / dt / 1e9)
            out[size] = rates
            del ts
        _finish(rank, side)
        return out if rank == 0 else {}
    finally:
        _close(tr, ctrl)


def child_rtt_pipeq(rank: int, world: int, side: Any, ipc_dir: str, shm_prefix: str | None, spin_s: float,
                    count: int) -> dict:
    """[2]: A.send_activation -> B.wait_data -> B.send_gradient(x + 1) -> A.wait_data; on A."""
    tr = ctrl = None
    try:
        tr, ctrl = _wire(rank, side, "ipc", ipc_dir, None, shm_prefix, spin_s, 64)
        x = torch.zeros(RTT_FLOATS)
        times, parts = [], []  # parts: A's send_activation call; B's wait_data return -> send_gradient return
        for k in range(RTT_WARMUP + count):
            if rank == 0:
                x.fill_(float(k))  # the previous message was answered: nobody reads x any more
                t0 = time.perf_counter()
                tr.send_activation(0, k, 0, [x])
                t1 = time.perf_counter()
                reply = tr.wait_gradient(0, k, 0)
                t2 = time.perf_counter()
                y = reply.tensors[0]
                if y.numel() != RTT_FLOATS or y[0].item() != k + 1 or y[-1].item() != k + 1:
                    raise AssertionError(f"round trip {k}: got {y.tolist()}")
                if k >= RTT_WARMUP:
                    times.append(t2 - t0)
                    parts.append(t1 - t0)
            else:
                msg = tr.wait_activation(0, k, 0)
                t0 = time.perf_counter()
                v = msg.tensors[0]
                tr.send_gradient(0, k, 0, [v + 1])
                if k >= RTT_WARMUP:
                    parts.append(time.perf_counter() - t0)
                if v.numel() != RTT_FLOATS or v[0].item() != k or v[-1].item() != k:  # off the critical path
                    raise AssertionError(f"round trip {k}: got {v.tolist()}")
        _finish(rank, side)
        return {"us": [t * 1e6 for t in times], "part_us": [t * 1e6 for t in parts]}
    finally:
        _close(tr, ctrl)


def child_rtt_zmq(rank: int, world: int, side: Any, ipc_dir: str, count: int) -> dict:
    """[2]: bare pyzmq PUSH/PULL over ipc with pipeq's socket options, one 64-byte frame each way,
    receiving as wait_data does (spin on a non-blocking recv for SPIN_S, yielding; then block)."""
    import zmq

    from pipeq.wire.sockets import tune_process_allocator, tune_socket

    tune_process_allocator()
    _pin(rank)
    _threads(1)
    ctx = zmq.Context(io_threads=1)
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        for s in (pull, push):
            tune_socket(s)
            s.setsockopt(zmq.RCVTIMEO, 120_000)
            s.setsockopt(zmq.SNDTIMEO, 120_000)
        pull.bind(f"ipc://{os.path.join(ipc_dir, f'raw{rank}')}")
        side.send(pull.getsockopt_string(zmq.LAST_ENDPOINT))
        push.connect(side.recv())

        def recv() -> bytes:
            end = time.perf_counter() + SPIN_S
            while time.perf_counter() < end:
                try:
                    return pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    os.sched_yield()
            return pull.recv()

        buf = bytearray(RTT_FLOATS * 4)
        times = []
        for k in range(RTT_WARMUP + count):
            if rank == 0:
                struct.pack_into("<Q", buf, 0, k)
                t0 = time.perf_counter()
                push.send(buf)
                got = recv()
                dt = time.perf_counter() - t0
                if len(got) != len(buf) or struct.unpack_from("<Q", got)[0] != k + 1:
                    raise AssertionError(f"round trip {k}: {len(got)} bytes")
                if k >= RTT_WARMUP:
                    times.append(dt)
            else:
                got = recv()
                (c,) = struct.unpack_from("<Q", got)
                struct.pack_into("<Q", buf, 0, c + 1)
                push.send(buf)
                if len(got) != len(buf) or c != k:
                    raise AssertionError(f"round trip {k}: {len(got)} bytes, counter {c}")
        _finish(rank, side)
        return {"us": [t * 1e6 for t in times]}
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()


def child_rtt_unix(rank: int, world: int, side: Any, path: str, count: int) -> dict:
    """[2]: raw AF_UNIX SOCK_SEQPACKET, blocking, 64 bytes each way (a counter + 1 on the way back)."""
    _pin(rank)
    _threads(1)
    socks = []
    try:
        if rank == 1:
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            socks.append(srv)
            srv.bind(path)
            srv.listen(1)
            side.send("ready")
            conn, _ = srv.accept()
        else:
            side.recv()
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            conn.connect(path)
        socks.append(conn)
        conn.settimeout(120)
        buf = bytearray(RTT_FLOATS * 4)
        times = []
        for k in range(RTT_WARMUP + count):
            if rank == 0:
                struct.pack_into("<Q", buf, 0, k)
                t0 = time.perf_counter()
                conn.send(buf)
                got = conn.recv_into(buf)
                dt = time.perf_counter() - t0
                if got != len(buf) or struct.unpack_from("<Q", buf)[0] != k + 1:
                    raise AssertionError(f"round trip {k}: {got} bytes, counter {struct.unpack_from('<Q', buf)[0]}")
                if k >= RTT_WARMUP:
                    times.append(dt)
            else:
                got = conn.recv_into(buf)
                (c,) = struct.unpack_from("<Q", buf)
                struct.pack_into("<Q", buf, 0, c + 1)
                conn.send(buf)
                if got != len(buf) or c != k:
                    raise AssertionError(f"round trip {k}: {got} bytes, counter {c}")
        _finish(rank, side)
        return {"us": [t * 1e6 for t in times]}
    finally:
        for s in socks:
            s.close()


def child_rtt_gloo(rank: int, world: int, port: int, count: int) -> dict:
    """[2]: blocking dist.send / dist.recv of 16 float32, the receiver adds 1 and sends it back."""
    import torch.distributed as dist

    _pin(rank)
    _threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    try:
        x = torch.zeros(RTT_FLOATS)
        times = []
        for k in range(RTT_WARMUP + count):
            if rank == 0:
                x.fill_(float(k))
                t0 = time.perf_counter()
                dist.send(x, dst=1)
                dist.recv(x, src=1)
                dt = time.perf_counter() - t0
                if x[0].item() != k + 1 or x[-1].item() != k + 1:
                    raise AssertionError(f"round trip {k}: got {x.tolist()}")
                if k >= RTT_WARMUP:
                    times.append(dt)
            else:
                dist.recv(x, src=0)
                x.add_(1)
                dist.send(x, dst=0)
        dist.barrier()
        return {"us": [t * 1e6 for t in times]}
    finally:
        dist.destroy_process_group()


# ==================================================================================================
# Parent: sections
# ==================================================================================================
def _target(probe: str, value: float, shown: str, target: str, ok: bool | None) -> str:
    verdict = "n/a" if value != value else ("info" if ok is None else ("PASS" if ok else "FAIL"))
    SUMMARY.append([probe, shown, target, verdict])
    return verdict


def _size_label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def _pair(label: str, fn: Any, args: tuple, shm_prefix: str | None = None) -> Any:
    """Two processes with a duplex pipe between them (rank 0 gets one end, rank 1 the other)."""
    ctx = mp.get_context("spawn")
    a_end, b_end = ctx.Pipe()
    try:
        r = _attempt(label, lambda: run_group(label.replace(" ", "-"), fn, 2,
                                              lambda rank: (a_end if rank == 0 else b_end, *args), TIMEOUT))
    finally:
        a_end.close()
        b_end.close()
        if shm_prefix:
            left = _sweep_shm(shm_prefix)
            if left:
                bc.PROBLEMS.append(f"{label}: {left} shared-memory segment(s) named {shm_prefix}* were left in "
                                   "/dev/shm (removed)")
    return r


def _shm_prefix() -> str:
    return f"pipeq-bench-{os.getpid()}-{secrets.token_hex(4)}"


def section_throughput(a: argparse.Namespace, shm: bool) -> None:
    from pipeq.wire.keys import JobSecret
    from pipeq.wire.sockets import make_ipc_dir, remove_ipc_dir

    repeats = a.repeats or (3 if a.quick else 5)
    plan = [p for p in bc.transport_plan(a.quick, repeats) if p[0] in SIZES]
    ipc_label = "pipeq ipc (shm)" if shm else "pipeq ipc (no shm)"
    print(f"\n=== [1] Throughput: one-way float32 stream, GB/s = 1e9 B/s, median of {repeats} rounds after "
          f"{WARMUP_ROUNDS} warm-up rounds (gloo, memcpy: 1) ===")
    print("    pipeq: ProcessTransport.send_activation -> wait_activation in order, ack = one send_gradient "
          "back; both pinned, 1 thread")
    print(f"    {ipc_label}: bound on ipc" + (", shm=ShmConfig(prefix=..., slots=4, max_bytes=256 MiB)" if shm else
                                             "  [this checkout's ProcessTransport takes no shm=]"))
    print(f"    {_background_line()}\n", flush=True)
    secret = JobSecret.generate()
    res: dict[str, dict | None] = {}
    configs = [(ipc_label, "ipc", shm)]
    if shm:
        configs.append(("pipeq ipc, zmq frames", "ipc", False))
    configs += [("pipeq tcp encrypt", "encrypt", False), ("pipeq tcp authenticate", "authenticate", False)]
    for name, mode, use_shm in configs:
        ipc_dir = make_ipc_dir()
        prefix = _shm_prefix() if use_shm else None
        try:
            r = _pair(name, child_stream, (mode, ipc_dir, secret, prefix, plan), prefix)
        finally:
            remove_ipc_dir(ipc_dir)
        res[name] = r[0] if r else None
    for key, window in (("gloo blk", 0), (f"gloo w{bc.GLOO_WINDOW}", bc.GLOO_WINDOW)):
        port = bc.free_port()
        r = _attempt(f"{key} send/recv", lambda: run_group("gloo-p2p", bc.child_gloo, 2,
                                                            lambda _r: (port, plan, window), TIMEOUT))
        res[key] = r[0] if r else None
    r = _attempt("memcpy", lambda: run_group("memcpy", bc.child_memcpy, 1, lambda _r: (plan,), TIMEOUT))
    res["memcpy"] = r[0] if r else None

    def g(k: str, size: int) -> float:
        d = res.get(k)
        return med(d[size]) if d and size in d else float("nan")

    cols = [c[0] for c in configs] + ["gloo blk", f"gloo w{bc.GLOO_WINDOW}", "memcpy"]
    rows = []
    for size, n, _ in plan:
        lab = _size_label(size)
        ipc, mc = g(ipc_label, size), g("memcpy", size)
        gl = max((v for v in (g("gloo blk", size), g(f"gloo w{bc.GLOO_WINDOW}", size)) if v == v),
                 default=float("nan"))
        extra = []
        if shm:
            zf = g("pipeq ipc, zmq frames", size)
            extra = [_f(zf / mc), _f(ipc / zf)]
        rows.append([lab, str(n), *(_g(g(c, size)) for c in cols), _f(size / ipc / 1e3, 0), _f(ipc / mc),
                     _f(ipc / gl), *extra])
        if size == 64 << 20:
            _target("[1] 64 MiB pipeq ipc / memcpy", ipc / mc, f"{_f(ipc / mc)}x ({_g(ipc)} / {_g(mc)} GB/s)",
                    ">= 0.50x", ipc / mc >= 0.5)
        if size == 4 << 20:
            _target("[1] 4 MiB pipeq ipc / best gloo", ipc / gl, f"{_f(ipc / gl)}x ({_g(ipc)} / {_g(gl)} GB/s)",
                    ">= 2.00x", ipc / gl >= 2.0)
    at = " / ".join(_size_label(sz) for sz, _, _ in plan)
    for c, _, _ in configs:
        vals = [g(c, size) for size, _, _ in plan]
        _target(f"[1] {c}, GB/s at {at}", next((v for v in vals if v == v), float("nan")),
                " / ".join(_g(v) for v in vals), "", None)
    if shm:
        vals = [g(ipc_label, size) / g("pipeq ipc, zmq frames", size) for size, _, _ in plan]
        _target(f"[1] pipeq ipc, shm / zmq frames at {at}", next((v for v in vals if v == v), float("nan")),
                " / ".join(_f(v) + "x" for v in vals), "", None)
    heads = ["size", "msgs/round", *cols, "ipc us/msg", "ipc/memcpy", "ipc/gloo"]
    if shm:
        heads += ["zmq frames/memcpy", "shm/zmq frames"]
    print()
    print(_table(heads, rows))
    print("    ipc us/msg = size / pipeq ipc GB/s: the time one message takes in the stream; ipc/gloo divides by the "
          "better gloo column\n    targets: 64 MiB ipc/memcpy >= 0.5, 4 MiB ipc/gloo >= 2", flush=True)


def section_rtt(a: argparse.Namespace, shm: bool) -> None:
    from pipeq.wire.sockets import make_ipc_dir, remove_ipc_dir

    count = a.round_trips or (2000 if a.quick else 5000)
    label = "pipeq ipc (shm)" if shm else "pipeq ipc (no shm)"
    zmq_label = f"raw pyzmq PUSH/PULL ipc, spin {SPIN_S * 1e3:g} ms"
    print(f"\n=== [2] Small-message round trip: {RTT_FLOATS} float32 ({RTT_FLOATS * 4} B), {count} round trips "
          f"after {RTT_WARMUP}, two pinned processes, microseconds ===")
    print(f"    pipeq: A.send_activation -> B.wait_data -> B.send_gradient(x + 1) -> A.wait_data; spin_s={SPIN_S} "
          "(PipelineRunner's default)")
    print("    'A send' = A's send_activation call, 'B turn' = B from wait_data's return to send_gradient's return "
          "(medians; both inside the round trip)")
    print(f"    {_background_line()}\n", flush=True)
    res: dict[str, dict | None] = {}
    for name, spin in ((label, SPIN_S), (f"{label}, spin_s=0", 0.0)):
        ipc_dir = make_ipc_dir()
        prefix = _shm_prefix() if shm else None
        try:
            r = _pair(name, child_rtt_pipeq, (ipc_dir, prefix, spin, count), prefix)
        finally:
            remove_ipc_dir(ipc_dir)
        res[name] = {**r[0], "send_us": r[0]["part_us"], "turn_us": r[1]["part_us"]} if r else None
    ipc_dir = make_ipc_dir()
    try:
        r = _pair("pyzmq ipc", child_rtt_zmq, (ipc_dir, count))
    finally:
        remove_ipc_dir(ipc_dir)
    res[zmq_label] = r[0] if r else None
    tmp = tempfile.mkdtemp(prefix="pipeq-bench-unix-")
    try:
        r = _pair("AF_UNIX seqpacket", child_rtt_unix, (os.path.join(tmp, "s"), count))
    finally:
        for f in os.listdir(tmp):
            os.unlink(os.path.join(tmp, f))
        os.rmdir(tmp)
    res["raw AF_UNIX SOCK_SEQPACKET, blocking"] = r[0] if r else None
    port = bc.free_port()
    r = _attempt("gloo send/recv", lambda: run_group("gloo-rtt", child_rtt_gloo, 2, lambda _r: (port, count),
                                                      TIMEOUT))
    res["gloo send/recv"] = r[0] if r else None
    unix = res.get("raw AF_UNIX SOCK_SEQPACKET, blocking")
    base = med(unix["us"]) if unix else float("nan")
    rows = []
    for k, d in res.items():
        if not d:
            rows.append([k, "FAILED", "-", "-", "-", "-", "-", "-"])
            continue
        us = d["us"]
        rows.append([k, _f(med(us), 1), _f(pct(us, .1), 1), _f(pct(us, .9), 1), _f(pct(us, .99), 1),
                     _f(med(us) / base), _f(med(d.get("send_us", [])), 1), _f(med(d.get("turn_us", [])), 1)])
    print()
    print(_table(["path", "median us", "p10 us", "p90 us", "p99 us", "/ AF_UNIX", "A send us", "B turn us"], rows),
          flush=True)
    d = res.get(label)
    m = med(d["us"]) if d else float("nan")
    _target("[2] small-message RTT pipeq ipc, median", m,
            f"{_f(m, 1)} us (p10 {_f(pct(d['us'], .1), 1)}, p90 {_f(pct(d['us'], .9), 1)})" if d else "FAILED",
            "<= 150 us", m <= 150)
    if d:
        _target("[2] RTT pipeq: A send_activation / B turnaround", m,
                f"{_f(med(d['send_us']), 1)} / {_f(med(d['turn_us']), 1)} us", "", None)
    for k in (f"{label}, spin_s=0", zmq_label, "raw AF_UNIX SOCK_SEQPACKET, blocking", "gloo send/recv"):
        d = res.get(k)
        v = med(d["us"]) if d else float("nan")
        _target(f"[2] RTT {k}, median", v, f"{_f(v, 1)} us", "", None)


def section_sleep(a: argparse.Namespace) -> None:
    n, mbs = 4, 8
    batch = mbs * bc.SLEEP_MB_ROWS
    warmup, steps = (2, a.repeats or 6) if a.quick else (3, a.repeats or 20)
    slots = mbs + n - 1
    print(f"\n=== [3] Sleep stages: {n} x SleepStage, {mbs} microbatches of {bc.SLEEP_MB_ROWS}x{bc.SLEEP_WIDTH}, "
          f"ideal = (m+N-1)(t_f+t_b) = {slots} slots; {warmup} warm-up + {steps} timed steps ===")
    print(f"    {_background_line()}\n", flush=True)
    for tf, tb in ((1e-3, 2e-3), (5e-3, 10e-3)):
        spec = ("sleep", n, tf, tb)
        sf, sb = bc._measure_sleep(tf, 40), bc._measure_sleep(tb, 40)
        ideal_nom, ideal_meas = slots * (tf + tb), slots * (sf + sb)
        tag = f"{tf * 1e3:g}/{tb * 1e3:g} ms"
        print(f"  {tag}: time.sleep takes {sf * 1e3:.3f} / {sb * 1e3:.3f} ms here; ideal nominal "
              f"{ideal_nom * 1e3:.1f} ms, with measured sleeps {ideal_meas * 1e3:.1f} ms", flush=True)
        res: dict[str, dict | None] = {}
        r = _attempt(f"pipeq sleep {tag}", lambda: run_group(
            "pipeq-sleep", bc.child_pipeq, 1,
            lambda _r: (spec, ["fill-drain", "1f1b"], batch, mbs, warmup, steps, "ipc", None, a.start_method),
            600.0)[0])
        res["pipeq fill-drain"], res["pipeq 1f1b"] = (r["fill-drain"], r["1f1b"]) if r else (None, None)
        port = bc.free_port()
        r = _attempt(f"TDP sleep {tag}", lambda: run_group(
            "tdp-sleep", bc.child_tdp, n, lambda _r: (port, spec, ["gpipe", "1f1b"], batch, mbs, warmup, steps),
            600.0))
        res["TDP GPipe"], res["TDP 1F1B"] = (r[0]["gpipe"], r[0]["1f1b"]) if r else (None, None)
        rows = []
        for k, d in res.items():
            if not d:
                rows.append([k, "FAILED", "-", "-", "-", "-"])
                if k.startswith("pipeq"):
                    _target(f"[3] sleep {tag} {k} / ideal", float("nan"), "FAILED", "<= 1.30x", False)
                continue
            t = med(d["times"])
            rows.append([k, _f(t * 1e3, 1), f"{_f(pct(d['times'], .1) * 1e3, 1)}-{_f(pct(d['times'], .9) * 1e3, 1)}",
                         _f(t / ideal_nom), _f(t / ideal_meas), _f((t - ideal_meas) / slots * 1e3)])
            if k.startswith("pipeq"):
                v = t / ideal_nom
                _target(f"[3] sleep {tag} {k} / ideal", v, f"{_f(v)}x ({_f(t / ideal_meas)}x measured-sleep ideal)",
                        "<= 1.30x" if tf == 1e-3 else "(<= 1.30x)", v <= 1.3 if tf == 1e-3 else None)
        print()
        print(_table(["config", "med ms", "p10-p90 ms", "/ ideal nom", "/ ideal meas", "extra ms/slot"], rows))
        print("    extra ms/slot = (median step - measured-sleep ideal) / (m+N-1): overhead per critical-path slot\n",
              flush=True)


def section_mlp(a: argparse.Namespace) -> None:
    W, depth, n, batch, mbs = 1024, 8, 2, 256, 8
    spec = ("mlp", W, depth, n)
    warmup, steps = (2, a.repeats or 5) if a.quick else (3, a.repeats or 16)
    rounds = 1 if a.quick else 2
    per_round = -(-steps // rounds)
    print(f"\n=== [4] MLP: {depth} x (Linear({W}) + ReLU), batch {batch}, {mbs} microbatches, {n} stages; "
          f"{rounds} round(s) x ({warmup} warm-up + {per_round} timed steps) ===")
    print(f"    {_background_line()}\n", flush=True)
    res: dict[str, dict] = {}

    def merge(key: str, d: dict | None) -> None:
        if d is not None:
            res.setdefault(key, {"times": []})["times"] += d["times"]
            if "losses" in d:
                res[key].setdefault("losses", d["losses"])
            if "stage_ms" in d:
                res[key].setdefault("stage_ms", []).append(d["stage_ms"])

    for rnd in range(rounds):
        tag = f" [round {rnd + 1}/{rounds}]" if rounds > 1 else ""
        r = _attempt(f"pipeq MLP fill-drain + 1f1b{tag}", lambda: run_group(
            "pipeq-mlp", bc.child_pipeq, 1,
            lambda _r: (spec, ["fill-drain", "1f1b"], batch, mbs, warmup, per_round, "ipc", None, a.start_method),
            600.0)[0])
        if r:
            merge("fill-drain", r["fill-drain"])
            merge("1f1b", r["1f1b"])
        barrier = mp.get_context("spawn").Barrier(n)
        r = _attempt(f"no-comm bound{tag}", lambda: run_group(
            "stage-only", bc.child_stage_only, n, lambda _r: (barrier, spec, batch, mbs, warmup, per_round), 600.0))
        if r:
            merge("bound", {"times": [max(ts) * (mbs + n - 1) / mbs for ts in zip(*(d["times"] for d in r))],
                            "stage_ms": [med(d["times"]) * 1e3 for d in r]})

    def sps(k: str) -> float:
        return 1.0 / med(res[k]["times"]) if res.get(k) else float("nan")

    rows = []
    for k, lab in (("fill-drain", "pipeq fill-drain"), ("1f1b", "pipeq 1f1b"),
                   ("bound", f"bound: both stages' work at once, no comm, x {mbs + n - 1}/{mbs}")):
        d = res.get(k)
        if not d:
            rows.append([lab, "FAILED", "-", "-", "-"])
            continue
        t = [v * 1e3 for v in d["times"]]
        rows.append([lab, _f(sps(k)), _f(med(t), 1), f"{_f(pct(t, .1), 1)}-{_f(pct(t, .9), 1)}",
                     _f(sps(k) / sps("bound"))])
    print()
    print(_table(["config", "steps/s", "med ms", "p10-p90 ms", "/ bound"], rows))
    if res.get("bound"):
        per = [med([s[j] for s in res["bound"]["stage_ms"]]) for j in range(n)]
        print("    per-stage work of a step with both stages running at once: "
              + ", ".join(f"stage {j} {v:.1f} ms" for j, v in enumerate(per)))
    if res.get("fill-drain") and res.get("1f1b"):
        l1, l2 = res["fill-drain"]["losses"], res["1f1b"]["losses"]
        print(f"    loss@1 fill-drain {l1[0]:.6f}, 1f1b {l2[0]:.6f} (must agree); loss@last {l1[-1]:.6f}, {l2[-1]:.6f}")
    for k in ("fill-drain", "1f1b"):
        v = sps(k) / sps("bound")
        _target(f"[4] MLP pipeq {k} / no-comm bound", v, f"{_f(v)}x ({_f(sps(k))} / {_f(sps('bound'))} steps/s)",
                "", None)
    print(flush=True)


def _background_line() -> str:
    return bc._background()


def _cpu_snapshot() -> tuple[float, float, float]:
    """(machine busy CPU seconds, CPU seconds of this process and its reaped descendants, monotonic s)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        # user + nice + system: irq/softirq time (loopback traffic) is charged to no process, ours or not
        busy = (v[0] + v[1] + v[2]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        busy = float("nan")
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system, time.monotonic()


def _others(before: tuple[float, float, float], after: tuple[float, float, float]) -> tuple[str, float]:
    """What the rest of the machine used between two snapshots (every descendant of ours reaped by then)."""
    wall = max(1e-9, after[2] - before[2])
    other = max(0.0, (after[0] - before[0]) - (after[1] - before[1]))
    share = 100.0 * other / (wall * (os.cpu_count() or 1))
    warn = "  <-- disturbed: compare with care" if share > 10 else ""
    return f"other processes used {other:.1f} CPU-s in {wall:.0f} s ({share:.0f}% of the machine){warn}", share


# ==================================================================================================
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fast smoke run (about 85 s)")
    p.add_argument("--only", action="append", choices=["throughput", "rtt", "sleep", "mlp"],
                   help="run only this probe (repeatable); default all four")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed stream rounds [1] (default 5, quick 3), timed steps [3] (20, quick 6) and [4] (16, "
                        "quick 5)")
    p.add_argument("--round-trips", type=int, default=None, help="timed round trips [2] (default 5000, quick 2000)")
    a = p.parse_args()
    if a.repeats is not None and a.repeats < 1:
        p.error("--repeats must be >= 1")
    if a.round_trips is not None and a.round_trips < 1:
        p.error("--round-trips must be >= 1")
    a.start_method = "forkserver" if a.quick else None  # as bench_core: stage start-up is not measured
    sections = a.only or ["throughput", "rtt", "sleep", "mlp"]

    def _term(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    import signal

    signal.signal(signal.SIGTERM, _term)
    bc._become_subreaper()
    t0 = time.monotonic()
    shm = shm_config_class() is not None
    print(f"pipeq bench_samehost: torch {torch.__version__}, {os.cpu_count()} cpus "
          f"(affinity {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'}), "
          f"python {sys.version.split()[0]}, mode {'quick' if a.quick else 'full'}, "
          f"shared memory in ProcessTransport: {'yes (shm=ShmConfig)' if shm else 'no (shm= not in this checkout)'}",
          flush=True)
    start_bg = _background_line()
    print(f"  at start: {start_bg}", flush=True)
    usage: list[str] = []
    try:
        for s in ("throughput", "rtt", "sleep", "mlp"):
            if s in sections:
                before = _cpu_snapshot()
                if s in ("throughput", "rtt"):
                    {"throughput": section_throughput, "rtt": section_rtt}[s](a, shm)
                else:
                    {"sleep": section_sleep, "mlp": section_mlp}[s](a)
                bc.cleanup_children()  # reaps stray descendants (fork servers), so that their CPU time counts as ours
                line, _ = _others(before, _cpu_snapshot())
                usage.append(f"{s:10s} {line}")
                print(f"  [{s}] {line}", flush=True)
    finally:
        bc.cleanup_children()
        try:  # our own resource tracker would otherwise outlive us by a few ms
            from multiprocessing import resource_tracker

            resource_tracker._resource_tracker._stop()
        except Exception:
            pass
    end_bg = bc._background()
    print("\n=== Summary (issue 16) ===")
    rows = sorted(SUMMARY, key=lambda r: (r[0][:3], r[3] == "info"))  # per probe, its targets first
    print(_table(["probe", "measured", "target", "verdict"], rows) if rows else "  (nothing measured)")
    print(f"\n  background at start: {start_bg}\n  background at end:   {end_bg}")
    print("  CPU used by other processes during each probe (machine busy time minus this run's own):")
    for line in usage:
        print(f"    {line}")
    if bc.PROBLEMS:
        print("\n=== Problems ===")
        for line in bc.PROBLEMS:
            print("  " + line)
    print(f"\ntotal wall time {time.monotonic() - t0:.0f} s", flush=True)
    return 1 if bc.PROBLEMS else 0


if __name__ == "__main__":
    sys.exit(main())
