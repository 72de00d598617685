"""Shared-memory payloads (pipeq.wire.shm, issue 16): the same numbers as one process, every dtype and
layout intact, back-pressure that blocks and recovers (and yields to EXIT), forged slot references
refused, and no segment left in /dev/shm when a stage or the driver is SIGKILLed.

Slot usage is proven from outside the stage processes: a slot segment stays mapped in both of
its processes after the receiver unlinked its name, so ``/proc/<pid>/maps`` lists it as
``/dev/shm/<prefix>-<channel>-<slot>-<gen> (deleted)``.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import pytest
import torch
from torch import nn

import pipeq
from pipeq.testing import backend_of
from strays import wait_no_strays
from models import flat_state, reference_train
from pipeq.wire import shm
from pipeq.wire.sockets import make_ipc_dir, remove_ipc_dir
from shm_helpers import mapped_segments, segment_names, wait_until

FAST = dict(start_method="forkserver")
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
WIDTH = 1024  # 33 rows x 1024 float32 = 132 KiB per microbatch: over shm's 64 KiB threshold


# -- helpers ----------------------------------------------------------------------------------
def channels(names) -> set[str]:
    """``{"F0", "B1", ...}`` of segment names ``<prefix>-<channel>-<slot>-<gen>``."""
    return {n.rsplit("-", 3)[1] for n in names}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def big_stages(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(16, WIDTH), nn.ReLU()),
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
            nn.Linear(WIDTH, 3)]


def big_batches(n: int, batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 16, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(n)]


# -- 1. the same numbers as one process, through the slots --------------------------------------
def train(schedule: str, data, mode: str = "process", shm_slots: int = 4, microbatches: int = 3):
    """Losses, predict output and state of a 3-stage run; in process mode also, read while it
    runs, the run's segments each stage has mapped and the names left in /dev/shm."""
    runner = pipeq.PipelineRunner(big_stages(), nn.CrossEntropyLoss(), SGD, schedule=schedule,
                                  microbatches=microbatches, mode=mode, shm_slots=shm_slots, threads_per_stage=1,
                                  **(FAST if mode == "process" else {}))
    maps: list[dict[str, bool]] = []
    names: list[str] = []
    with runner:
        losses = [runner.step(x, y) for x, y in data]
        out = runner.predict(data[0][0])
        state = runner.state_dict()  # every stage answered: every message sent has been taken
        if mode == "process":
            prefix = shm.run_prefix(backend_of(runner).ipc_dir)
            maps = [mapped_segments(info["pid"], prefix) for info in runner.stage_processes]
            names = segment_names(prefix)
    if mode == "process":
        assert not segment_names(prefix)
    return losses, out, state, maps, names


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["fill-drain", "1f1b"])
def test_training_through_shared_memory_equals_one_process(schedule):
    data = big_batches(3, 100)  # 3 microbatches of 34, 33, 33 rows: uneven, each over 64 KiB
    losses, out, state, maps, names = train(schedule, data)

    # the big activations and gradients went through slots: each channel's segments are mapped
    # in both its processes, their names already unlinked by the receiver; nothing else is there
    assert [channels(m) for m in maps] == [{"F0", "B1"}, {"F0", "B1", "F1", "B2"}, {"F1", "B2"}], maps
    for k, m in enumerate(maps):
        assert all(m.values()), f"stage {k} maps segments whose name was never unlinked: {m}"
    assert names == [], "names left in /dev/shm after every message was taken"

    # the numbers are those of plain single-process training (full batches) ...
    model, ref_losses = reference_train(big_stages(), nn.CrossEntropyLoss(), SGD, data)
    assert losses == pytest.approx(ref_losses, abs=1e-6, rel=0)
    ref_state = flat_state(model)
    assert list(state) == list(ref_state)
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, atol=1e-6, rtol=0, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(out, model(data[0][0]), atol=1e-6, rtol=0)

    # ... and bit for bit those of the same microbatched schedule in this one process
    sim_losses, sim_out, sim_state, _, _ = train(schedule, data, mode="simulated")
    assert losses == sim_losses
    assert torch.equal(out, sim_out)
    assert all(torch.equal(state[k], sim_state[k]) for k in sim_state)

    # without shared memory no segment is mapped, and training computes the same bits. (Not
    # predict: there a stage computes on the received tensor in place, a ZeroMQ frame at an
    # address that is not 16-byte aligned, and MKL's products round 1 ulp differently for it;
    # training copies its inputs to leaves of its own first. See the transport's _decode.)
    losses0, out0, state0, maps0, _ = train(schedule, data, shm_slots=0)
    assert maps0 == [{}, {}, {}]
    assert losses == losses0
    assert all(torch.equal(state[k], state0[k]) for k in state0)
    torch.testing.assert_close(out, out0, atol=1e-6, rtol=0)


@pytest.mark.timeout(30)
def test_complex128_in_a_zeromq_frame_does_not_crash_the_receiver():
    """complex128 under the shared-memory threshold travels in a ZeroMQ frame, which a receiver
    uses in place (or clones, under 64 KiB when unaligned); a frame of its own allocation (over
    8 KiB) lies at 8 mod 16 here, and torch's complex<double> kernels (clone, arithmetic) crash
    with SIGSEGV on an address that is not 16-byte aligned. Run in a process of its own: the
    crash must fail this test, not end the test session."""
    import multiprocessing as mp

    from shm_helpers import complex128_over_zeromq

    where = make_ipc_dir()  # ours: a crashed receiver cannot remove it
    p = mp.get_context("forkserver").Process(target=complex128_over_zeromq, args=(where,))
    p.start()
    try:
        p.join(20)
    finally:
        if p.exitcode is None:
            p.kill()
            p.join()
        shm.remove_segments(shm.run_prefix(where))
        remove_ipc_dir(where)
    assert p.exitcode == 0, ("the receiver of complex128 tensors in ZeroMQ frames "
                             + (f"was killed by signal {-p.exitcode}" if p.exitcode and p.exitcode < 0
                                else f"exited with {p.exitcode}"))


# -- 3, 4. SIGKILL leaves no segment behind ----------------------------------------------------
@pytest.mark.timeout(60)
def test_sigkilled_stage_leaves_no_segment_behind():
    """Stage 1 is stopped before its first message, so stage 0's slots keep their names (no one
    mapped them); it is then SIGKILLed. The run fails naming it, and the driver's clean-up by
    prefix removes the names (stage 0 is SIGKILLed by the teardown: it cleans up nothing)."""
    torch.manual_seed(0)
    runner = pipeq.PipelineRunner([nn.Linear(8, WIDTH), nn.Linear(WIDTH, 3)], nn.CrossEntropyLoss(), SGD,
                                  microbatches=2, heartbeat_timeout=60, **FAST)
    seen: list[str] = []
    prefix = ""
    with pytest.raises(pipeq.PipelineError, match="killed by SIGKILL") as info:
        with runner:
            prefix = shm.run_prefix(backend_of(runner).ipc_dir)
            victim = runner.stage_processes[1]["pid"]
            os.kill(victim, signal.SIGSTOP)

            def kill_when_sent():
                try:  # stage 0's two activations (32 x 1024 floats each) sit in named slots
                    seen.extend(wait_until(lambda: len(segment_names(prefix)) >= 2 and segment_names(prefix),
                                           10, "stage 0's slots"))
                finally:
                    os.kill(victim, signal.SIGKILL)

            killer = threading.Thread(target=kill_when_sent)
            killer.start()
            try:
                runner.step(torch.randn(64, 8), torch.randint(0, 3, (64,)))
            finally:
                killer.join(15)
    assert info.value.stage == 1
    assert channels(seen) == {"F0"} and len(seen) == 2, seen
    assert segment_names(prefix) == [], "a SIGKILLed stage's run left segments in /dev/shm"
    assert not wait_no_strays(5.0)


@pytest.mark.timeout(60)
def test_sigkilled_driver_leaves_no_segment_behind():
    """A driver (a process of its own, forked from this one; its stages come from the fork
    server) is SIGKILLed while stage 0's activations wait in named slots for a stopped stage 1.
    Stage 0 sees its driver gone and removes the run's segments (stage 1 cannot have: it is still
    stopped); then stage 1, continued, exits too. Nothing survives."""
    import multiprocessing as mp

    from shm_helpers import orphaning_driver

    conn, child_conn = mp.Pipe()
    driver = mp.get_context("fork").Process(target=orphaning_driver, args=(child_conn,))
    driver.start()
    pids: list[int] = []
    try:
        wait_until(lambda: conn.poll(0.05) or not driver.is_alive(), 30, "the driver to start its stages")
        assert conn.poll(), f"the driver failed to start its stages (exit code {driver.exitcode})"
        ipc_dir, pids = conn.recv()
        prefix = shm.run_prefix(ipc_dir)
        assert len(pids) == 2 and prefix.startswith("pipeq-")
        os.kill(pids[1], signal.SIGSTOP)
        conn.send("step")
        seen = wait_until(lambda: len(segment_names(prefix)) >= 2 and segment_names(prefix), 10,
                          "stage 0's slots")
        assert channels(seen) == {"F0"}
        driver.kill()
        driver.join(10)
        assert driver.exitcode == -signal.SIGKILL
        wait_until(lambda: not alive(pids[0]), 10, "stage 0 to see its driver gone")
        assert segment_names(prefix) == [], "the orphaned stage left the run's segments behind"
        assert alive(pids[1])  # still stopped: the clean-up was stage 0's
        os.kill(pids[1], signal.SIGCONT)
        wait_until(lambda: not alive(pids[1]), 10, "stage 1 to see its driver gone")
        assert segment_names(prefix) == []
        assert not os.path.exists(ipc_dir), "the orphaned stages left their ipc files behind"
    finally:
        driver.kill()
        driver.join()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


class Slow(nn.Module):
    """Sleeps in its forward: its stage drains its inbound channel only between microbatches."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return x


@pytest.mark.timeout(60)
def test_stats_count_sends_that_waited_for_a_slot():
    # one slot: stage 0's third activation of a step finds it still full while stage 1 sleeps
    torch.manual_seed(0)
    stages = [nn.Linear(256, 256), nn.Sequential(Slow(), nn.Linear(256, 4))]
    x, y = torch.randn(8 * 128, 256), torch.randn(8 * 128, 4)  # 128 KiB activations per microbatch
    with pipeq.PipelineRunner(stages, nn.MSELoss(), functools.partial(torch.optim.SGD, lr=0.1),
                              schedule="fill-drain", microbatches=8, shm_slots=1, **FAST) as r:
        r.step(x, y)
        stats = r.stats()
    assert stats[0]["shm_waits"] >= 1, stats
    assert all(type(s["shm_waits"]) is int for s in stats)
    sim = pipeq.PipelineRunner(stages, nn.MSELoss(), functools.partial(torch.optim.SGD, lr=0.1),
                               schedule="fill-drain", microbatches=8, mode="simulated")
    with sim:
        assert [s["shm_waits"] for s in sim.stats()] == [0, 0]
