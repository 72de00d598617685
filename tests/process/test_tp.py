"""Tensor parallelism inside a stage: ``PipelineRunner(..., tensor_parallel=T, tp_plan=plans)``.

Every stage runs on T processes (shards) whose Linear layers are split by torch's DTensor
(``"colwise"`` / ``"rowwise"`` entries of the stage's plan). So a step must still equal
single-process full-batch training (losses, every tensor of the state, predict), also with
data parallelism beside it; checkpoints hold whole tensors under the usual flat names and load
at another T; bad plans and unsupported combinations are refused before any process starts;
and a shard that dies is named (replica, stage, shard) with nothing left running.
"""

from __future__ import annotations

import copy
import functools
import os
import signal
import socket
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import pipeq
from strays import wait_no_strays
from pipeq.checkpoint import flat_model
from pipeq.errors import PipelineError
from models import TP_PLAN, RaisesOnShard, ShardedLinear, UpDown, flat_state, reference_train, reverse_drain, tp_stages

pytestmark = pytest.mark.timeout(300)

FAST = dict(start_method="forkserver")  # stages fork from a preloaded server: ~0.1 s each
MOMENTUM = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
ADAM = functools.partial(torch.optim.Adam, lr=0.01)
TOL = dict(atol=1e-5, rtol=1e-5)
CLASSES = 4


def batches(n_steps: int, size: int, seed: int = 0, width: int = 8, classes: int = CLASSES):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, width, generator=g), torch.randint(0, classes, (size,), generator=g))
            for _ in range(n_steps)]


def reference(stages, make_opt, data, model=None, opt=None):
    """Plain single-process training of the flat model on full batches (:func:`models.reference_train`):
    (model, optimizer, losses). ``model`` and ``opt``: go on training those (default: a copy of
    ``stages``, a fresh optimizer)."""
    if model is None:
        model = flat_model(copy.deepcopy(stages))  # parameter names: runner.state_dict()'s
        opt = make_opt(model.parameters())
    model, losses = reference_train([], nn.CrossEntropyLoss(), make_opt, data, model=model, opt=opt)
    return model, opt, losses


def assert_close_states(got, want):
    assert list(got) == list(want)
    for key in want:
        assert got[key].shape == want[key].shape, key
        torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m, key=key: f"{key}: {m}")


def assert_equal_states(got, want):
    assert list(got) == list(want)
    for key in want:
        assert got[key].shape == want[key].shape, key
        assert torch.equal(got[key], want[key]), (key, (got[key] - want[key]).abs().max())


def assert_moved(state, stages):
    """Training changed every parameter (so matching the reference is not matching the start)."""
    start = flat_state(stages)
    for key in start:
        assert not torch.allclose(state[key], start[key], atol=1e-4), key


def eval_output(model, x):
    with torch.no_grad():
        return model.eval()(x)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a zombie is dead, just not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def where(info):
    return [(w["replica"] or 0, w["stage"], w["shard"]) for w in info]


def assert_numbering(info, replicas, n_stages, shards):
    """stage_processes: the leads (shard 0) first, numbered replica * n_stages + stage, then the rest."""
    n_leads = replicas * n_stages
    assert len(info) == n_leads * shards
    assert where(info[:n_leads]) == [(r, k, 0) for r in range(replicas) for k in range(n_stages)]
    assert sorted(where(info[n_leads:])) == [(r, k, s) for r in range(replicas) for k in range(n_stages)
                                             for s in range(1, shards)]
    assert len({w["pid"] for w in info}) == len(info)


# -- 1. T = 2: equal to single-process full-batch training ---------------------------------------------
@pytest.fixture(scope="module", params=["fill-drain", "1f1b", reverse_drain], ids=["fill-drain", "1f1b", "own"])
def tp_run(request):
    """4 steps of tp_stages at T = 2 (4 processes), batches of 10 in 3 microbatches (4 + 3 + 3);
    the runner is closed before the tests look (the autouse no-stray check runs after each).
    The Linear layers are ShardedLinear: a forward fails unless its weight really is split."""
    stages = tp_stages(seed=0, probe=True)
    data = batches(4, 10, seed=1)
    x_eval = torch.randn(7, 8, generator=torch.Generator().manual_seed(2))
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), MOMENTUM, request.param, 3,
                                  tensor_parallel=2, tp_plan=TP_PLAN, **FAST)
    with runner:
        info = [dict(w) for w in runner.stage_processes]
        losses = [runner.step(x, y) for x, y in data]
        memory = runner.memory()
        state = runner.state_dict()
        pred = runner.predict(x_eval)
    model, _, ref_losses = reference(stages, MOMENTUM, data)
    return SimpleNamespace(stages=stages, info=info, losses=losses, state=state, pred=pred, memory=memory,
                           ref_losses=ref_losses, ref_state=model.state_dict(), ref_pred=eval_output(model, x_eval))


def test_every_stage_runs_on_two_shards(tp_run):
    assert_numbering(tp_run.info, replicas=1, n_stages=2, shards=2)


def test_memory_counts_what_each_shard_holds(tp_run):
    """runner.memory() counts a DTensor's local part (shard 0's): half of each split weight and of a
    colwise Linear's bias (a rowwise one's bias is whole on every shard), its gradient and momentum alike."""
    assert [(m.stage, m.replica) for m in tp_run.memory] == [(0, 0), (1, 0)]
    for m, stage, plan in zip(tp_run.memory, tp_run.stages, TP_PLAN):
        split = [(p, name.endswith("weight") or plan[name.split(".")[0]] == "colwise")
                 for name, p in stage.named_parameters()]
        local = sum(p.numel() * p.element_size() // (2 if halved else 1) for p, halved in split)
        assert m.param_bytes == m.grad_bytes == m.optimizer_bytes == local, m
        assert m.measured_step == 1 and m.activation_peak_bytes > 0, m


def test_losses_equal_full_batch_training(tp_run):
    assert len(tp_run.losses) == 4
    assert tp_run.losses == pytest.approx(tp_run.ref_losses, abs=1e-5, rel=1e-5)


def test_state_dict_is_whole_and_equals_full_batch_training(tp_run):
    """Every key of the flat model, at its full (unsharded) shape, equal to the reference's."""
    assert_close_states(tp_run.state, tp_run.ref_state)
    assert_moved(tp_run.state, tp_run.stages)


def test_predict_is_whole_and_equals_the_trained_model(tp_run):
    """7 samples in 3 microbatches; stage 1 ends in a colwise Linear: its output is gathered."""
    assert tp_run.pred.shape == (7, CLASSES)
    torch.testing.assert_close(tp_run.pred, tp_run.ref_pred, **TOL)


# -- 2. T = 2 beside data parallelism --------------------------------------------------------------------
def test_two_replicas_of_two_sharded_stages_equal_full_batch_training():
    """R = 2, N = 2, T = 2: 8 processes; 11 samples (replica shards of 6 and 5, each in 2
    microbatches). Stage 1 is not an nn.Sequential: its plan names its children "up", "down"."""
    torch.manual_seed(4)
    stages = [nn.Sequential(ShardedLinear(8, 16, 0), nn.ReLU(), ShardedLinear(16, 8, 1)), UpDown(8, 16, CLASSES)]
    plan = [{"0": "colwise", "2": "rowwise"}, {"up": "colwise", "down": "rowwise"}]
    data = batches(3, 11, seed=5)
    x_eval = torch.randn(5, 8, generator=torch.Generator().manual_seed(6))
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), MOMENTUM, "1f1b", 2, data_parallel=2,
                                  tensor_parallel=2, tp_plan=plan, **FAST)
    with runner:
        assert_numbering(runner.stage_processes, replicas=2, n_stages=2, shards=2)
        losses = [runner.step(x, y) for x, y in data]
        state = runner.state_dict()
        pred = runner.predict(x_eval)
    model, _, ref_losses = reference(stages, MOMENTUM, data)
    assert losses == pytest.approx(ref_losses, abs=1e-5, rel=1e-5)
    assert list(state)[-4:] == ["3.up.weight", "3.up.bias", "3.down.weight", "3.down.bias"]
    assert_close_states(state, model.state_dict())
    assert_moved(state, stages)
    torch.testing.assert_close(pred, eval_output(model, x_eval), **TOL)


# -- 2b. T = 2 with two stages per process -------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["zbv", "interleaved-1f1b"])
def test_two_stages_per_process_of_two_shards_equal_full_batch_training(schedule):
    """4 stages, 2 per process (V placement: process 0 holds stages 0 and 3; looped: 0 and 2), each
    process on 2 shards (4 processes): both stages of a process split over the one mesh its
    shards share, every command and message of both shared by shard 0 with the chunk it is for.
    The Linear layers are ShardedLinear: a forward fails unless its weight really is split."""
    torch.manual_seed(3)
    stages = [nn.Sequential(ShardedLinear(8, 16, 0), nn.ReLU(), ShardedLinear(16, 8, 1)) for _ in range(3)]
    stages.append(nn.Sequential(ShardedLinear(8, 16, 0), nn.ReLU(), ShardedLinear(16, CLASSES, 1)))
    plan = [{"0": "colwise", "2": "rowwise"}] * 4
    data = batches(3, 12, seed=9)
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), ADAM, schedule, 4, tensor_parallel=2,
                                  tp_plan=plan, stages_per_process=2, **FAST)
    with runner:
        info = runner.stage_processes
        losses = [runner.step(x, y) for x, y in data]
        state = runner.state_dict()
    assert len({w["pid"] for w in info}) == 4  # 2 processes x 2 shards, each holding 2 stages
    model, _, ref_losses = reference(stages, ADAM, data)
    assert losses == pytest.approx(ref_losses, abs=1e-5, rel=1e-5)
    assert_close_states(state, model.state_dict())
    assert_moved(state, stages)


# -- 3. checkpoints: whole tensors, loaded at another T ------------------------------------------------------
@pytest.fixture(scope="module")
def saved_at_t2(tmp_path_factory):
    """2 steps of Adam at T = 2, then runner.save; and the reference of all 4 steps."""
    stages = tp_stages(seed=7)
    data = batches(4, 10, seed=8)
    directory = str(tmp_path_factory.mktemp("tp-ckpt") / "at2")
    with pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), ADAM, "1f1b", 3, tensor_parallel=2,
                              tp_plan=TP_PLAN, **FAST) as runner:
        for x, y in data[:2]:
            runner.step(x, y)
        state = runner.state_dict()
        runner.save(directory, meta={"steps": 2})
    model, opt, ref_losses = reference(stages, ADAM, data[:2])
    half = SimpleNamespace(state=copy.deepcopy(model.state_dict()),
                           optim={name: {k: v.clone() for k, v in opt.state[p].items()}
                                  for name, p in model.named_parameters()})
    model, opt, more = reference(stages, ADAM, data[2:], model=model, opt=opt)  # goes on: uninterrupted
    return SimpleNamespace(stages=stages, data=data, directory=directory, state=state, half=half,
                           ref_losses=ref_losses + more, ref_state=model.state_dict())


def test_a_checkpoint_holds_whole_tensors_under_the_flat_names(saved_at_t2):
    """The model and the Adam state on disk: unsharded, named as without tensor parallelism,
    equal to the reference's after 2 steps."""
    from pipeq.checkpoint import load

    ckpt = load(saved_at_t2.directory)
    assert ckpt.meta == {"steps": 2}
    assert ckpt.n_stages == 2
    assert_close_states(ckpt.model, saved_at_t2.half.state)
    assert_equal_states(ckpt.model, saved_at_t2.state)
    assert sorted(ckpt.optim) == sorted(saved_at_t2.half.optim)
    for name, want in saved_at_t2.half.optim.items():
        got = ckpt.optim[name]["state"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert got[key].shape == want[key].shape, (name, key)
            # Adam's second moments are ~1e-6: an absolute 1e-5 would pass anything; scale to the tensor
            torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5 * float(want[key].abs().max()),
                                       msg=lambda m, n=name, k=key: f"{n} {k}: {m}")
        assert float(got["step"]) == float(want["step"]) == 2.0, name


@pytest.mark.parametrize("shards", [1, 4])
def test_a_checkpoint_saved_at_t2_loads_and_trains_on_at(shards, saved_at_t2):
    """Fresh runners (other initial weights) at T = 1 (no plan) and T = 4 (every size divides by 4)
    load it: the very same state; 2 more steps equal the uninterrupted reference's steps 3 and 4,
    which needs Adam's moments and step count to have survived the resharding."""
    ck = saved_at_t2
    fresh = tp_stages(seed=99)
    tp = dict(tensor_parallel=shards, tp_plan=TP_PLAN) if shards > 1 else {}
    with pipeq.PipelineRunner(fresh, nn.CrossEntropyLoss(), ADAM, "fill-drain", 3, **tp, **FAST) as runner:
        assert len(runner.stage_processes) == 2 * shards
        assert runner.load(ck.directory) == {"steps": 2}
        assert_equal_states(runner.state_dict(), ck.state)
        losses = [runner.step(x, y) for x, y in ck.data[2:]]
        state = runner.state_dict()
    assert losses == pytest.approx(ck.ref_losses[2:], abs=1e-5, rel=1e-5)
    assert_close_states(state, ck.ref_state)


# -- 5. a killed shard is named, and nothing is left behind --------------------------------------------------------
@pytest.mark.parametrize("replicas, wait", [(1, True), (1, False), (2, False)])
def test_a_killed_shard_is_named_and_no_process_survives(replicas, wait):
    """SIGKILL shard 1 of stage 1 (of replica 1 with R = 2) after a good step; ``wait``: until it
    is gone before the next step, else right away (its peers may be blamed first: they must not be)."""
    data = batches(2, 8, seed=9)
    runner = pipeq.PipelineRunner(tp_stages(), nn.CrossEntropyLoss(), MOMENTUM, "1f1b", 2, tensor_parallel=2,
                                  tp_plan=TP_PLAN, data_parallel=replicas, **FAST)
    with runner:
        runner.step(*data[0])
        info = runner.stage_processes
        assert_numbering(info, replicas, n_stages=2, shards=2)
        pids = [w["pid"] for w in info]
        victim = next(w["pid"] for w in info if where([w]) == [(replicas - 1, 1, 1)])
        os.kill(victim, signal.SIGKILL)
        end = time.monotonic() + 5
        while wait and alive(victim) and time.monotonic() < end:
            time.sleep(0.02)
        t0 = time.monotonic()
        with pytest.raises(PipelineError) as caught:
            for _ in range(3):
                runner.step(*data[1])
        assert time.monotonic() - t0 < 15
    err = caught.value
    prefix = "stage 1, shard 1: " if replicas == 1 else "replica 1, stage 1, shard 1: "
    assert str(err).startswith(prefix), str(err)
    assert (err.stage, err.shard) == (1, 1), str(err)
    assert err.replica == (None if replicas == 1 else 1), str(err)
    assert "SIGKILL" in str(err) or "killed" in str(err), str(err)
    assert not wait_no_strays(5.0), "processes outlived the failure"
    assert not [p for p in pids if alive(p)], "a stage or shard process is still there"
    with pytest.raises(PipelineError):
        runner.step(*data[1])  # the run is over


@pytest.mark.parametrize("shard", [0, 1, None])
def test_a_raising_shard_is_named_with_its_error(shard):
    """Stage 1's first Linear (colwise) raises in its first forward on one shard (None: on both);
    the error names that stage and shard and carries the shard's own message and traceback."""
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)),
              nn.Sequential(RaisesOnShard(8, 16, shard), nn.ReLU(), nn.Linear(16, CLASSES))]
    plan = [{"0": "colwise", "2": "rowwise"}, {"0": "colwise", "2": "rowwise"}]
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), MOMENTUM, "1f1b", 2, tensor_parallel=2,
                                  tp_plan=plan, **FAST)
    x, y = batches(1, 8, seed=10)[0]
    with runner:
        pids = [w["pid"] for w in runner.stage_processes]
        t0 = time.monotonic()
        with pytest.raises(PipelineError) as caught:
            runner.step(x, y)
        assert time.monotonic() - t0 < 10
    err = caught.value
    assert err.stage == 1 and err.replica is None, str(err)
    if shard is None:
        assert err.shard in (0, 1), str(err)
    else:
        assert err.shard == shard, str(err)
    assert str(err).startswith(f"stage 1, shard {err.shard}: "), str(err)
    assert f"boom from shard {err.shard}" in str(err), str(err)
    assert err.remote_traceback and "models.py" in err.remote_traceback, str(err)
    assert not wait_no_strays(5.0), "processes outlived the failure"
    assert not [p for p in pids if alive(p)], "a stage or shard process is still there"


def test_shards_listen_on_loopback_only_and_survive_strangers():
    """A local process that connects to the shards' listening sockets and writes garbage must
    neither break nor change the run."""
    from attacker import listening_addresses

    stages = tp_stages(seed=0)
    data = batches(4, 10, seed=3)
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), MOMENTUM, "1f1b", 2, tensor_parallel=2,
                                  tp_plan=TP_PLAN, **FAST)
    strangers = []
    try:
        with runner:
            losses = [runner.step(*data[0])]
            pids = [w["pid"] for w in runner.stage_processes]
            listening = listening_addresses(pids)
            assert listening, "no listening socket found: is /proc/net/tcp readable?"
            assert {addr for addr, _ in listening} == {"127.0.0.1"}, listening
            for _, port in listening:
                for garbage in (b"\x00" * 64, os.urandom(4096), b"\xff" * 16):
                    s = socket.create_connection(("127.0.0.1", port), timeout=5)
                    s.sendall(garbage)
                    strangers.append(s)
            losses += [runner.step(x, y) for x, y in data[1:]]
            state = runner.state_dict()
    finally:
        for s in strangers:
            s.close()
    model, _, ref_losses = reference(stages, MOMENTUM, data)
    assert losses == pytest.approx(ref_losses, abs=1e-5, rel=1e-5)
    assert_close_states(state, model.state_dict())


# -- 8. a plan of torch's style objects, and a callable plan --------------------------------------------
def test_style_objects_and_a_callable_plan_equal_full_batch_training():
    """tp_plan also takes torch's ParallelStyle objects (stage 0) and a callable
    ``(stage_module, mesh) -> module`` (stage 1), with the probe layers proving the split."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from models import split_by_hand

    stages = tp_stages(seed=4, probe=True)
    data = batches(3, 10, seed=5)
    plan = [{"0": ColwiseParallel(), "2": RowwiseParallel()}, split_by_hand]
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), MOMENTUM, "1f1b", 3, tensor_parallel=2,
                                  tp_plan=plan, **FAST)
    with runner:
        losses = [runner.step(x, y) for x, y in data]
        state = runner.state_dict()
    model, _, ref_losses = reference(stages, MOMENTUM, data)
    assert losses == pytest.approx(ref_losses, abs=1e-5, rel=1e-5)
    assert_close_states(state, model.state_dict())
