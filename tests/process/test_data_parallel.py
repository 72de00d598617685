"""Data parallelism beside the pipeline: ``PipelineRunner(..., data_parallel=R)``.

R replicas of an N-stage pipeline (R x N processes); each replica trains on its shard of the
batch, every microbatch's loss weighted by its share of the whole batch, and stage k's gradients
are summed over the replicas before its optimizer steps. So a step must equal single-process
full-batch training; replicas must start (broadcast) and stay bit-identical; a failing replica
must end the run, named; and ``pipeq launch --data-parallel R`` (one host or two) must equal
full-batch training too.
"""

from __future__ import annotations

import copy
import functools
import gc
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import pipeq
from pipeq.testing import backend_of
from pipeq.checkpoint import StageLayout, flat_model, global_state
from pipeq.wire.messages import Kind
from pipeq.errors import PipelineError

from launch_util import (DIGITS_JOB, ROOT, SECRET, assert_same_state, free_port, launch_cmd, launch_here, metrics,
                         model_state, secret_env)
from attacker import listening_addresses
from models import Exits, Raises, flat_state, mlp_stages, reference_train

pytestmark = pytest.mark.timeout(300)

FAST = dict(start_method="forkserver")  # stages fork from a preloaded server: ~0.1 s each
MOMENTUM = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
ADAM = functools.partial(torch.optim.Adam, lr=0.01)
WIDTHS = (8, 16, 3)  # two stages: Linear(8, 16) + ReLU, Linear(16, 3)


def batches(n_steps: int, size: int, seed: int = 0, width: int = 8, classes: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, width, generator=g), torch.randint(0, classes, (size,), generator=g))
            for _ in range(n_steps)]


def train(stages, data, *, schedule="1f1b", microbatches=2, data_parallel=2, make_opt=MOMENTUM,
          loss_fn=None, **kw):
    """(state_dict, losses) after training on ``data`` through a process-mode runner."""
    runner = pipeq.PipelineRunner(stages, loss_fn or nn.CrossEntropyLoss(), make_opt, schedule,
                                  microbatches, data_parallel=data_parallel, **{**FAST, **kw})
    with runner:
        losses = [runner.step(x, y) for x, y in data]
        return runner.state_dict(), losses


def replica_state(runner: pipeq.PipelineRunner, r: int) -> dict[str, torch.Tensor]:
    """Replica r's parameters and buffers, keyed like ``state_dict()`` (which reads replica 0).

    There is no public API for this: ask processes r*N .. r*N+N-1 for GET_STATE directly, the
    way ``ProcessBackend.get_state`` asks replica 0's (through the tests' hook, :func:`pipeq.testing.backend_of`).
    """
    be = backend_of(runner)
    procs = [r * be.n_stages + k for k in range(be.n_stages)]
    got = be.ask_each(Kind.GET_STATE, Kind.STATE, f"replica {r}'s state", procs)
    per_stage = [(got[g].extra["names"], [t.clone() for t in got[g].tensors]) for g in procs]
    return dict(global_state(per_stage, [StageLayout(**lay) for lay in be.layouts()]))


def assert_close_states(a, b, atol=1e-5):
    assert list(a) == list(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)


def assert_equal_states(a, b):
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), (key, (a[key] - b[key]).abs().max())


# -- 1. full-batch equivalence ------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["fill-drain", "1f1b"])
def test_two_replicas_equal_single_process_full_batch_training(schedule):
    """R = 2, N = 2: four processes. (The default start method, spawn, with R = 2 is what
    ``pipeq launch --data-parallel 2`` runs: see the launch tests below.)"""
    stages = mlp_stages(WIDTHS, seed=0)
    data = batches(4, 16)
    ref, ref_losses = reference_train(stages, nn.CrossEntropyLoss(), MOMENTUM, data)
    sd, losses = train(stages, data, schedule=schedule, microbatches=2)
    assert_close_states(sd, flat_state(ref))
    assert losses == pytest.approx(ref_losses, abs=1e-5)  # the whole batch's loss, not a shard's
    # and training did something: the weights moved
    assert not torch.allclose(sd["2.weight"], stages[1].weight, atol=1e-3)


@pytest.mark.parametrize("security", ["encrypt", "authenticate"])
def test_two_replicas_over_tcp_equal_single_process_full_batch_training(security):
    """The gradients travel over tcp (CURVE, or PLAIN + a MAC per message) as they do between hosts."""
    stages = mlp_stages(WIDTHS, seed=0)
    data = batches(3, 16, seed=12)
    ref, ref_losses = reference_train(stages, nn.CrossEntropyLoss(), MOMENTUM, data)
    sd, losses = train(stages, data, transport="tcp", tcp_security=security)
    assert_close_states(sd, flat_state(ref))
    assert losses == pytest.approx(ref_losses, abs=1e-5)


def test_parameters_larger_than_a_data_frame_are_cut_across_buckets():
    """max_message_mb=1: stage 0's 1.5 MiB weight travels in two buckets (and so do its first
    replica's weights at start); three replicas add in replica order."""
    stages = mlp_stages((8, 49152, 3), seed=5)  # Linear(8, 49152): 1.5 MiB of float32 weights
    data = batches(2, 12, seed=13)
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    ref, ref_losses = reference_train(stages, nn.CrossEntropyLoss(), sgd, data)
    sd, losses = train(stages, data, make_opt=sgd, data_parallel=3, max_message_mb=1, microbatches=1)
    assert_close_states(sd, flat_state(ref))
    assert losses == pytest.approx(ref_losses, abs=1e-5)


def test_uneven_batch_with_adam_equals_full_batch_training():
    """25 samples: shards of 13 and 12, each in 3 microbatches (5+4+4, 4+4+4); Adam."""
    stages = mlp_stages(WIDTHS, seed=3)
    data = batches(3, 25, seed=1)
    ref, ref_losses = reference_train(stages, nn.CrossEntropyLoss(), ADAM, data)
    sd, losses = train(stages, data, schedule="fill-drain", microbatches=3, make_opt=ADAM)
    assert_close_states(sd, flat_state(ref))
    assert losses == pytest.approx(ref_losses, abs=1e-5)


def test_sum_reduction_loss_equals_full_batch_training():
    """A sum-reduced loss is not rescaled: the replicas' sums add up to the batch's sum."""
    stages = mlp_stages(WIDTHS, seed=4)
    data = batches(3, 10, seed=2)
    sgd = functools.partial(torch.optim.SGD, lr=0.01)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    ref, ref_losses = reference_train(stages, loss_fn, sgd, data)
    sd, losses = train(stages, data, microbatches=2, make_opt=sgd, loss_fn=loss_fn)
    assert_close_states(sd, flat_state(ref))
    assert losses == pytest.approx(ref_losses, abs=1e-4)


# -- 2. replicas start and stay identical ---------------------------------------------------------
def test_replicas_with_different_initial_weights_end_bit_identical():
    a, b = mlp_stages(WIDTHS, seed=0), mlp_stages(WIDTHS, seed=1)
    assert not torch.equal(a[1].weight, b[1].weight)
    x, y = batches(1, 12, seed=5)[0]

    def one_step(replicas):
        """(state_dict after one step, replica 1 before it, replica 0 and replica 1 after it)."""
        runner = pipeq.PipelineRunner([copy.deepcopy(s) for s in replicas], nn.CrossEntropyLoss(), MOMENTUM,
                                      "1f1b", 2, data_parallel=2, **FAST)
        with runner:
            before = replica_state(runner, 1)
            runner.step(x, y)
            return runner.state_dict(), before, replica_state(runner, 0), replica_state(runner, 1)

    mixed, r1_before, r0_after, r1_after = one_step([a, b])
    # replica 1 was built from seed 1's weights, but starts from replica 0's (the broadcast) ...
    assert_equal_states(r1_before, flat_state(a))
    # ... and after a step both replicas hold the very same bits
    assert_equal_states(r0_after, mixed)
    assert_equal_states(r1_after, mixed)
    # the same as if both had been built from replica 0's weights ...
    same, _, _, _ = one_step([a, copy.deepcopy(a)])
    assert_equal_states(mixed, same)
    # ... and not as if replica 0 had seed 1's: replica 0's weights are the ones that count
    other, _, _, _ = one_step([b, a])
    assert not any(torch.allclose(mixed[key], other[key]) for key in mixed)


def test_replicas_stay_bit_identical_and_load_state_dict_reaches_every_replica():
    stages = mlp_stages(WIDTHS, seed=0)
    data = batches(3, 14, seed=6)
    fresh = flat_state(mlp_stages(WIDTHS, seed=9))
    with pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), ADAM, "fill-drain", 3, data_parallel=2,
                              **FAST) as runner:
        for x, y in data:
            runner.step(x, y)
        assert_equal_states(replica_state(runner, 1), runner.state_dict())
        runner.load_state_dict(fresh)
        assert_equal_states(replica_state(runner, 0), fresh)
        assert_equal_states(replica_state(runner, 1), fresh)
        runner.step(*data[0])
        assert_equal_states(replica_state(runner, 1), replica_state(runner, 0))
        # predict reads replica 0 and is the plain model's output
        model = flat_model(copy.deepcopy(stages))
        model.load_state_dict(runner.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(runner.predict(data[1][0]), model(data[1][0]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("security", ["encrypt", "authenticate"])
def test_strangers_at_every_port_change_nothing(security):
    """Over tcp on one host, the stage processes listen on loopback only: the pipeline's sockets
    (which demand the job's keys) and the replicas' gloo group (torch's collectives, which
    authenticate nothing, so they bind to loopback alone). A local process that connects to every
    one of them and writes garbage (zeros, noise, a forged gradient bucket's bytes), before each
    step and after the last, neither breaks nor changes the run: it ends with the very parameters
    and losses of an unattacked run."""
    import socket

    stages = mlp_stages(WIDTHS, seed=0)
    data = batches(3, 16, seed=14)
    clean, clean_losses = train(stages, data, transport="tcp", tcp_security=security)
    strangers: list[socket.socket] = []

    def attack(runner) -> None:
        pids = [w["pid"] for w in runner.stage_processes]
        listening = listening_addresses(pids)
        assert listening and {addr for addr, _ in listening} == {"127.0.0.1"}, listening
        for _, port in listening:
            for garbage in (b"\x00" * 64, os.urandom(4096), torch.full((64,), 1e6).numpy().tobytes()):
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=5)
                    s.sendall(garbage)
                    strangers.append(s)
                except OSError:  # a listener that closed on the garbage
                    pass

    try:
        with pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), MOMENTUM, "1f1b", 2, data_parallel=2,
                                  transport="tcp", tcp_security=security, **FAST) as runner:
            losses = []
            for x, y in data:
                attack(runner)
                losses.append(runner.step(x, y))
            attack(runner)
            attacked, r1 = runner.state_dict(), replica_state(runner, 1)
    finally:
        for s in strangers:
            s.close()
    assert_equal_states(attacked, clean)
    assert_equal_states(r1, clean)
    assert losses == clean_losses


# -- 3. a failing replica ends the run, named -----------------------------------------------------
def _raising_replicas():
    """Replica 0's stage 1 never raises; replica 1's raises in its first forward."""
    base = [nn.Sequential(nn.Linear(8, 16), nn.ReLU())]
    fine = [copy.deepcopy(base[0]), Raises(16, after_calls=10**9)]
    bad = [copy.deepcopy(base[0]), Raises(16, after_calls=0)]
    return [fine, bad]


def test_a_raising_replica_stage_is_named():
    runner = pipeq.PipelineRunner(_raising_replicas(), nn.CrossEntropyLoss(), MOMENTUM, "1f1b", 2,
                                  data_parallel=2, **FAST)
    with runner:
        x, y = batches(1, 8, classes=16, seed=7)[0]
        t0 = time.monotonic()
        with pytest.raises(PipelineError) as info:
            runner.step(x, y)
        assert time.monotonic() - t0 < 10
        err = info.value
        assert (err.replica, err.stage) == (1, 1), str(err)
        assert str(err).startswith("replica 1, stage 1: "), str(err)
        assert "boom from the stage" in str(err)
        with pytest.raises(PipelineError, match="failed"):  # the run is over
            runner.step(x, y)


def _kill_replica_1_stage_1(wait: bool):
    """Kill replica 1's stage 1 after a good step; then step: the error must name that process."""
    data = batches(2, 8, seed=8)
    runner = pipeq.PipelineRunner(mlp_stages(WIDTHS, seed=0), nn.CrossEntropyLoss(), MOMENTUM, "1f1b", 2,
                                  data_parallel=2, **FAST)
    with runner:
        runner.step(*data[0])
        victim = backend_of(runner).procs[1 * 2 + 1]  # process r * N + k: replica 1, stage 1
        os.kill(victim.pid, signal.SIGKILL)
        end = time.monotonic() + 5
        while wait and victim.is_alive() and time.monotonic() < end:
            time.sleep(0.02)
        t0 = time.monotonic()
        with pytest.raises(PipelineError) as info:
            for _ in range(3):
                runner.step(*data[1])
        assert time.monotonic() - t0 < 10
        err = info.value
        assert (err.replica, err.stage) == (1, 1), str(err)
        assert str(err).startswith("replica 1, stage 1: "), str(err)
        assert "SIGKILL" in str(err) or "killed" in str(err), str(err)


def test_a_killed_replica_worker_found_dead_before_a_step_is_named():
    _kill_replica_1_stage_1(wait=True)


def test_a_killed_replica_worker_is_named_not_its_peer_in_the_all_reduce():
    """The step right after the kill: replica 0's stage 1 then waits for buckets that never come
    (until the driver ends the run); the dead process is at fault, not the survivor."""
    _kill_replica_1_stage_1(wait=False)


def test_a_replica_stage_that_exits_is_named():
    """Replica 1's stage 1 calls os._exit(7) in its first forward."""
    first = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    replicas = [[copy.deepcopy(first), Raises(16, after_calls=10**9)], [copy.deepcopy(first), Exits(16)]]
    runner = pipeq.PipelineRunner(replicas, nn.CrossEntropyLoss(), MOMENTUM, "1f1b", 2, data_parallel=2,
                                  **FAST)
    with runner:
        x, y = batches(1, 8, classes=16, seed=7)[0]
        with pytest.raises(PipelineError) as info:
            runner.step(x, y)
        err = info.value
        assert (err.replica, err.stage) == (1, 1), str(err)
        assert "code 7" in str(err), str(err)


# -- 4. interlocking with auxiliary heads -----------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_pairwise_with_aux_heads_equals_the_single_replica_run(reduction):
    """The heads' losses are weighted by their share of the whole batch (like the real loss) and
    the all-reduce covers the heads too. With reduction="sum" the weights are all 1, so that case
    checks the all-reduce alone; "mean" checks the weighting as well."""
    stages = mlp_stages((8, 16, 16, 3), seed=0)
    torch.manual_seed(1)
    heads = [nn.Linear(16, 3), nn.Linear(16, 3)]
    data = batches(4, 12, seed=9)
    sgd = functools.partial(torch.optim.SGD, lr=0.1 if reduction == "mean" else 0.01, momentum=0.9)

    def run(R):
        runner = pipeq.PipelineRunner(copy.deepcopy(stages), nn.CrossEntropyLoss(reduction=reduction), sgd,
                                      "pairwise", 2, aux_heads=copy.deepcopy(heads),
                                      aux_loss=nn.CrossEntropyLoss(reduction=reduction), data_parallel=R, **FAST)
        with runner:
            losses = [runner.step(x, y) for x, y in data]
            r1 = replica_state(runner, 1) if R > 1 else None
            return runner.state_dict(), losses, r1

    one, one_losses, _ = run(1)
    two, two_losses, r1 = run(2)
    assert_close_states(two, one, atol=1e-5 if reduction == "mean" else 1e-4)
    assert two_losses == pytest.approx(one_losses, abs=1e-5 if reduction == "mean" else 1e-4)
    assert_equal_states(r1, two)


def test_a_batch_smaller_than_the_replica_count_is_refused_and_the_run_goes_on():
    stages = mlp_stages(WIDTHS, seed=0)
    data = batches(1, 10, seed=10)
    ref, _ = reference_train(stages, nn.CrossEntropyLoss(), MOMENTUM, data)
    with pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), MOMENTUM, "1f1b", 2, data_parallel=2,
                              **FAST) as runner:
        with pytest.raises(ValueError, match="1 samples"):
            runner.step(torch.randn(1, 8), torch.tensor([0]))
        runner.step(*data[0])  # refused before anything was sent: the next step is the first
        assert_close_states(runner.state_dict(), flat_state(ref))


# -- 6. pipeq launch --data-parallel --------------------------------------------------------------------
STEPS = 6


@pytest.fixture(scope="module")
def digits_reference():
    """The digits job trained in this process on full batches (what its R = 1 launch gives)."""
    from pipeq.launch.job import load_job

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from examples.digits_job import layers

    job = load_job(DIGITS_JOB, {"steps": STEPS})
    torch.manual_seed(job.recipe.seed)  # the job builds its stages under this seed
    flat = layers()  # model.pt is keyed by these layers' indices
    data = list(job.batches(0))[:STEPS]
    model, losses = reference_train(flat, job.recipe.loss_fn(), job.recipe.optimizer_factory(), data)
    return model.state_dict(), losses


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``pipeq launch --data-parallel 2`` over two loopback "nodes" (node 1 runs replica 1's
    stages; node 0 runs in this process), both at once. (R = 2 on one host through the runner: the tests above; the
    launch path is the same.)"""
    base = tmp_path_factory.mktemp("launch")
    out = {name: str(base / name) for name in ("nodes", "node1")}
    steps = ("--steps", str(STEPS), "--data-parallel", "2", "--trusted-network")
    multi = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()))
    node1 = subprocess.Popen(launch_cmd(*steps, *multi, "--node-rank", "1", "--out", out["node1"]), cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=secret_env())  # the multi-host nodes need the job's secret
    results = {}
    before = os.environ.get("PIPEQ_SECRET")
    try:  # node 0 in this process (its stages fork from the session's fork server)
        os.environ["PIPEQ_SECRET"] = SECRET
        gc.disable()  # what still listens after the run must not depend on when the collector runs
        r = launch_here(*steps, *multi, "--node-rank", "0", "--out", out["nodes"])
        results["listening"] = listening_addresses([os.getpid()])
        gc.enable()
        results["nodes"] = (r.returncode, r.stdout, r.stderr)
        stdout, stderr = node1.communicate(timeout=240)
        results["node1"] = (node1.returncode, stdout, stderr)
    finally:
        gc.enable()
        if before is None:
            os.environ.pop("PIPEQ_SECRET", None)
        else:
            os.environ["PIPEQ_SECRET"] = before
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    return out, results


def _losses(out: str) -> list[float]:
    return [line["loss"] for line in metrics(out) if "loss" in line]


def test_launch_data_parallel_over_two_nodes_equals_full_batch_training(launched, digits_reference):
    out, results = launched
    for name in ("nodes", "node1"):
        assert results[name][0] == 0, results[name][2]
    assert "started stage(s) [3, 4, 5]" in results["node1"][2]  # replica 1's three stages: node 1's
    # node 0 ran in this process and hosted the rendezvous store: its port closed with the run
    assert results["listening"] == []
    ref, ref_losses = digits_reference
    assert_same_state(model_state(out["nodes"]), ref, atol=1e-5)
    assert _losses(out["nodes"]) == pytest.approx(ref_losses, abs=1e-5)


def test_replicas_across_hosts_are_refused_without_a_trusted_network(tmp_path):
    """torch's collectives authenticate nothing: a multi-host launch with replicas is refused
    before any process starts, naming the setting, unless the job says its network is trusted."""
    multi = ("--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(free_port()))
    before = os.environ.get("PIPEQ_SECRET")
    os.environ["PIPEQ_SECRET"] = SECRET
    try:
        r = launch_here("--steps", "1", "--data-parallel", "2", *multi, "--out", str(tmp_path / "out"))
    finally:
        if before is None:
            os.environ.pop("PIPEQ_SECRET", None)
        else:
            os.environ["PIPEQ_SECRET"] = before
    assert r.returncode == 2, r.stderr
    assert "trusted_network" in r.stderr and "Traceback" not in r.stderr, r.stderr


# -- 7. traces ----------------------------------------------------------------------------------------
def test_traced_data_parallel_run_has_both_replicas(tmp_path):
    path = tmp_path / "dp.json"
    steps, mb = 2, 2
    with pipeq.PipelineRunner(mlp_stages(WIDTHS), nn.CrossEntropyLoss(), MOMENTUM, "1f1b", mb,
                              data_parallel=2, trace=str(path), **FAST) as runner:
        for x, y in batches(steps, 12, seed=11):
            runner.step(x, y)
    t = json.loads(path.read_text())
    names = {e["pid"]: e["args"]["name"] for e in t["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "replica 0", 1: "replica 1"}
    events = [e for e in t["traceEvents"] if e["ph"] == "X"]
    for pid in (0, 1):
        for k in (0, 1):
            for step in range(1, steps + 1):
                mine = [e for e in events if e["pid"] == pid and e["tid"] == k and e["args"]["step"] == step]
                for cat in ("forward", "backward"):
                    got = sorted(e["args"]["microbatch"] for e in mine if e["cat"] == cat)
                    assert got == list(range(mb)), (pid, k, step, cat)
                assert sum(e["cat"] == "step" for e in mine) == 1, (pid, k, step)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_single_host_run_with_replicas_listens_on_loopback_only(transport):
    """Data parallelism on one host opens no port beyond loopback (it used to put a gradient
    store on every interface): over ipc its only TCP ports are the replicas' gloo group's, on
    loopback; over tcp the pipeline's sockets are there too."""
    runner = pipeq.PipelineRunner(mlp_stages(), nn.CrossEntropyLoss(), MOMENTUM, "1f1b", 2,
                                  data_parallel=2, transport=transport, **FAST)
    (x, y), = batches(1, 8)
    with runner:
        runner.step(x, y)
        pids = [os.getpid()] + [p["pid"] for p in runner.stage_processes]
        ports = listening_addresses(pids)
    assert {addr for addr, _ in ports} == {"127.0.0.1"}, ports
    if transport == "tcp":
        assert len(ports) >= 1 + 2 * 2 * 2  # control + (forward, backward) per process, and gloo's


# -- 8. what the replicas' sum sends -------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_replica_sends_what_a_ring_all_reduce_sends():
    """The bytes each stage process's TCP sockets send per step (``ss``'s ``bytes_sent``: every
    thread's sends, gloo's and ZeroMQ's, over ``transport="tcp"``), less those of one replica (the pipeline's own traffic: each replica trains on as many
    samples), are what a ring all-reduce of the stage's gradients sends: 2 (R - 1) / R times them,
    within 5% (the link it replaced sent R - 1 times them). bench/bench_dp.py --bytes measures it
    so, and prints it for R = 2 and 4."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import bench_dp
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    width, layers = 256, 2
    grads = bench_dp.gradient_bytes(width, layers)  # each stage's: 0.5 MiB
    base = bench_dp.measure(1, width, layers, batch=8, steps=4)["bytes_per_process_step"]
    for r in (2, 4):
        sent = bench_dp.measure(r, width, layers, batch=8, steps=4)["bytes_per_process_step"] - base
        ring = 2 * (r - 1) / r * grads
        assert abs(sent - ring) <= 0.05 * ring, (r, sent / ring)
