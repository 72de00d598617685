"""Helpers of tests/process/test_shm.py and tests/unit/wire/test_shm_channels.py, some run in a process of their own: module-level, hence picklable,
and importing neither the test module nor conftest (which would start another fork server)."""

from __future__ import annotations

import contextlib
import os
import time

from pipeq.wire import shm
from pipeq.wire.shm import ShmConfig
from pipeq.wire.sockets import BindTo, make_ipc_dir, remove_ipc_dir
from one_stage import OneStage
from pipeq.testing import backend_of


def segment_names(prefix: str) -> list[str]:
    """The names in /dev/shm of run ``prefix``'s segments."""
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefix + "-"))


@contextlib.contextmanager
def transport_pair(slots: int = 4, min_bytes: int = 64 << 10, capacity: int = 64, control: str = "inproc://unused",
                   where: str | None = None):
    """Stage processes 0 and 1 in this process, wired both ways, with shared memory: (a, b, cfg).
    On exit: both closed, and not one segment of theirs left in /dev/shm. ``where``: the ipc
    directory (the caller's to remove), else one of their own."""
    own = where is None
    where = make_ipc_dir() if where is None else where
    cfg = ShmConfig(shm.run_prefix(where), slots=slots, max_bytes=256 << 20, min_bytes=min_bytes)
    a = OneStage(0, control, bind=BindTo.ipc(where), queue_capacity=capacity, shm=cfg)
    b = OneStage(1, control, bind=BindTo.ipc(where), queue_capacity=capacity, shm=cfg)
    done = False
    try:
        a.connect(b.addresses["forward"], None)
        b.connect(None, a.addresses["backward"])
        yield a, b, cfg
        done = True
    finally:
        a.close()
        b.close()
        left = segment_names(cfg.prefix)
        shm.remove_segments(cfg.prefix)
        if own:
            remove_ipc_dir(where)
    assert not (done and left), f"segments left behind by closed transports: {left}"


def complex128_over_zeromq(where: str) -> None:
    """Send complex128 tensors under the shared-memory threshold (so: in ZeroMQ frames) from
    stage process 0 to 1 (bound in ``where``) and check them; exits 0 if every one arrived
    intact, 1 if one did not. (A crash of the receiver shows as the process's signal.)"""
    import torch

    ok = True
    with transport_pair(slots=2, where=where) as (a, b, cfg):
        # 4095: 65,520 bytes, a frame with an allocation of its own; 1000 and 7: frames inside
        # ZeroMQ's receive buffer; 8192: 128 KiB, through a slot
        for mb, n in enumerate((4095, 1000, 7, 8192)):
            x = torch.randn(n, dtype=torch.complex128)
            a.send_activation(1, mb, [x])
            got = b.wait_data(b.forward_queue, 1, mb).tensors[0]
            ok &= bool(torch.equal(got.view(torch.uint8), x.view(torch.uint8)))  # bytes: no complex kernel
            ok &= bool(torch.equal(got * 1, x))  # computing on it, as the next stage would
    os._exit(0 if ok else 1)


def orphaning_driver(conn) -> None:
    """A driver whose stages (two, forked by the test process's fork server) exchange 128 KiB
    activations: sends ``(ipc_dir, stage pids)`` on ``conn``, waits for a word, then trains one
    step, which the test makes wait forever (it stops stage 1) and ends by SIGKILLing this process.

    Run as a fork of the test process, it inherits the connection to the test process's fork
    server (torch imported: no new interpreter, stages start in ~0.1 s), which is not its child:
    multiprocessing's check that the server still runs (a waitpid on it) would fail here, so it
    is skipped (the server runs: the test process started it and outlives this one)."""
    from multiprocessing import forkserver as mp_forkserver

    import functools

    import torch
    from torch import nn

    import pipeq
    import pipeq.control.forkserver

    pipeq.control.forkserver.start = lambda compiles=False: None
    mp_forkserver._forkserver.ensure_running = lambda: None  # type: ignore[method-assign]

    torch.manual_seed(0)
    runner = pipeq.PipelineRunner([nn.Linear(8, 1024), nn.Linear(1024, 3)], nn.CrossEntropyLoss(),
                                  functools.partial(torch.optim.SGD, lr=0.1), microbatches=2,
                                  heartbeat_timeout=60, start_method="forkserver")
    runner.start()
    conn.send((backend_of(runner).ipc_dir, [info["pid"] for info in runner.stage_processes]))
    conn.recv()
    runner.step(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    conn.send("the step ended")


def mapped_segments(pid: int, prefix: str) -> dict[str, bool]:
    """Run ``prefix``'s segments that process ``pid`` has mapped: name -> whether its name has
    been unlinked (the kernel shows such a mapping as ``... (deleted)``)."""
    out: dict[str, bool] = {}
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            line = line.rstrip("\n")
            deleted = line.endswith(" (deleted)")
            if deleted:
                line = line[: -len(" (deleted)")]
            path = line.split(maxsplit=5)[-1] if len(line.split(maxsplit=5)) == 6 else ""
            if path.startswith(f"{shm.SHM_DIR}/{prefix}-"):
                name = os.path.basename(path)
                out[name] = out.get(name, True) and deleted
    return out


def wait_until(cond, timeout: float, what: str):
    """Poll ``cond`` (a condition on another process or the file system, which has no event to
    wait on) until it is truthy; fail naming ``what`` after ``timeout`` s."""
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)
