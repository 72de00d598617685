"""Several stages per process in process mode: one OS process per pair of stages, equal to one process (data_parallel=2 with clipping, uneven microbatches, bf16 with recompute), traced, and a failure named by stage and chunk."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
from torch import nn

import pipeq
from models import Narrow, Raises, RefusesLoad, Widen, batches64, flat_state, reference_train, stages64
from runner_cases import assert_matches_reference

pytestmark = pytest.mark.timeout(240)

FAST = dict(start_method="forkserver", threads_per_stage=1)
SGD64 = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("schedule,n", [("zbv", 4), ("interleaved-1f1b", 4), ("zb-h2", 3)])
def test_data_parallel_2_with_clipping_equals_full_batch_training(schedule, n):
    stages = stages64(n)
    batches = batches64(2, batch=16)  # each replica: 8 samples in 4 microbatches
    with pipeq.PipelineRunner(copy.deepcopy(stages), nn.CrossEntropyLoss(), SGD64, schedule, 4, data_parallel=2,
                              clip_grad_norm=0.5, **FAST) as r:
        losses = [r.step(x, y) for x, y in batches]
        state = r.state_dict()
        pids = {w["stage"]: w["pid"] for w in r.stage_processes if w["replica"] == 0}
        memory = r.memory()
    if schedule == "zbv":  # V placement: stages 0 and 3 in one process, 1 and 2 in another
        assert pids[0] == pids[3] and pids[1] == pids[2] and pids[0] != pids[1]
    # every stage of every replica measured its first step in its process, as its plan predicts (the
    # stages of one process: one peak together); SGD's momentum: one buffer per parameter
    assert [(m.replica, m.stage) for m in memory] == [(r, k) for r in range(2) for k in range(n)]
    for m in memory:
        size = sum(p.numel() * p.element_size() for p in stages[m.stage].parameters())
        assert m.param_bytes == m.grad_bytes == m.optimizer_bytes == size and m.measured_step == 1, m
        assert m.activation_peak_bytes == pytest.approx(m.predicted_activation_bytes, rel=0.02), m
        assert m.process_activation_peak_bytes == pytest.approx(m.predicted_process_activation_bytes, rel=0.02), m
    held = {(m.replica, m.process): m.process_activation_peak_bytes for m in memory}
    assert all(held[m.replica, m.process] == m.process_activation_peak_bytes for m in memory)
    model, want = reference_train(stages, nn.CrossEntropyLoss(), SGD64, batches, clip=0.5)
    assert losses == pytest.approx(want, abs=1e-9)
    for name, ref in flat_state(model).items():
        torch.testing.assert_close(state[name], ref, atol=1e-9, rtol=0, msg=name)


@pytest.mark.parametrize("schedule,n", [("dualpipev", 4), ("interleaved-1f1b", 4), ("looped-bfs", 4), ("zb-h2", 3),
                                        ("v-half", 4), ("v-min", 6)])
def test_uneven_microbatches_equal_one_process_and_every_stage_is_traced(schedule, n, tmp_path):
    stages = stages64(n)
    batches = batches64(2)  # 4 microbatches of 3, 3, 2, 2
    path = tmp_path / "run.json"
    with pipeq.PipelineRunner(copy.deepcopy(stages), nn.CrossEntropyLoss(), SGD64, schedule, 4, trace=str(path),
                              **FAST) as r:
        losses = [r.step(x, y) for x, y in batches]
        state = r.state_dict()
    assert_matches_reference(stages, batches, losses, state, opt=SGD64, tol=1e-12)
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X" and e["cat"] == "forward"]
    assert {e["tid"] for e in events} == set(range(n))  # each stage's forwards, by stage


def test_bf16_with_recompute_gives_the_simulated_bits():
    stages = [nn.Sequential(nn.Linear(6, 16), nn.Tanh()), nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
              nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 4)]
    batches = [(x.float(), y) for x, y in batches64(2)]
    got = {}
    for mode, kw in (("simulated", {}), ("process", FAST)):
        with pipeq.PipelineRunner(copy.deepcopy(stages), nn.CrossEntropyLoss(), SGD64, "interleaved-1f1b", 4,
                                  mode=mode, precision="bf16", recompute=True, **kw) as r:
            got[mode] = ([r.step(x, y) for x, y in batches], r.state_dict())
    assert got["process"][0] == got["simulated"][0]
    assert all(torch.equal(got["process"][1][k], v) for k, v in got["simulated"][1].items())


def test_a_failing_stage_is_named_by_stage_and_chunk():
    stages = stages64(4)
    stages[2] = Raises(7).double()  # process 1's chunk 1 (V placement) raises in its forward
    with pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD64, "zbv", 4, **FAST) as r:
        with pytest.raises(pipeq.PipelineError, match=r"stage 2 \(chunk 1 of its process\)") as info:
            r.step(*batches64(1)[0])
    assert info.value.stage == 2


def test_a_send_failing_on_one_stage_of_a_process_names_that_stage():
    """Stage 2 (process 1's chunk 1, V placement) sends an activation over max_message_mb: stage 2
    is named, not stage 1, whose process it shares."""
    torch.manual_seed(0)
    stages = [nn.Linear(4, 8), nn.Linear(8, 8), Widen(50_000), Narrow(8, 4)]  # 8 x 50,000 floats: 1.5 MiB
    with pipeq.PipelineRunner(stages, nn.MSELoss(), SGD64, "zbv", 4, max_message_mb=1, **FAST) as r:
        with pytest.raises(pipeq.PipelineError, match=r"stage 2 \(chunk 1 of its process\).*over the 1 MiB cap") as info:
            r.step(torch.randn(4, 4), torch.randn(4, 4))
    assert info.value.stage == 2


def test_a_command_failing_on_one_stage_of_a_process_names_that_stage():
    """Stage 3 (process 0's chunk 1, V placement) cannot load the state it is given: stage 3 is
    named, not stage 0, whose process it shares."""
    torch.manual_seed(0)
    stages = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), RefusesLoad(4, 4)]
    with pipeq.PipelineRunner(stages, nn.MSELoss(), SGD64, "zbv", 4, **FAST) as r:
        state = r.state_dict()
        with pytest.raises(pipeq.PipelineError, match=r"stage 3 \(chunk 1 of its process\).*cannot load") as info:
            r.load_state_dict(state)
    assert info.value.stage == 3


def test_checkpoint_resume_in_processes_equals_an_uninterrupted_run(tmp_path):
    stages = stages64(4)
    batches = batches64(3)
    with pipeq.PipelineRunner(copy.deepcopy(stages), nn.CrossEntropyLoss(), SGD64, "zbv", 4, mode="simulated") as r:
        whole = [r.step(x, y) for x, y in batches]
        want = r.state_dict()
    with pipeq.PipelineRunner(copy.deepcopy(stages), nn.CrossEntropyLoss(), SGD64, "zbv", 4, **FAST) as r:
        first = [r.step(x, y) for x, y in batches[:1]]
        r.save(tmp_path / "ckpt")
    with pipeq.PipelineRunner(copy.deepcopy(stages), nn.CrossEntropyLoss(), SGD64, "zbv", 4, **FAST) as r:
        r.load(tmp_path / "ckpt")
        rest = [r.step(x, y) for x, y in batches[1:]]
        got = r.state_dict()
    assert first + rest == whole
    assert all(torch.equal(got[k], v) for k, v in want.items())
