"""``runner.stream(batches)``: the pipeline stays full across batches and the numbers do not change."""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
from torch import nn

import pipeq
from pipeq.al import build_al
from models import Raises, mlp_stages

FAST = dict(start_method="forkserver")
MOMENTUM = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
ADAM = functools.partial(torch.optim.Adam, lr=0.01)
WIDTHS = (8, 12, 12, 10, 3)  # four stages


def batches(n: int, size: int = 12, seed: int = 0, width: int = 8, classes: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, width, generator=g), torch.randint(0, classes, (size,), generator=g))
            for _ in range(n)]


def model_for(schedule: str):
    """(stages, optimizer, extra runner kwargs) for one schedule of the equality list."""
    if schedule == "al":
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(8, 12), nn.ReLU()), nn.Linear(12, 10), nn.Sequential(nn.Linear(10, 8), nn.Tanh())]
        return build_al(blocks, [12, 10, 8], 3, label_widths=[6, 5, 5]), None, ADAM, {}
    stages = mlp_stages(WIDTHS, seed=1)
    kw = {}
    if schedule in ("global", "local", "pairwise", "nwise"):
        torch.manual_seed(2)
        kw["aux_heads"] = [nn.Linear(w, 3) for w in WIDTHS[1:-1]]
    return stages, nn.CrossEntropyLoss(), MOMENTUM, kw


def schedule_arg(schedule: str):
    return pipeq.schedules.Interlock("nwise", distance=2) if schedule == "nwise" else schedule


def run(schedule: str, mode: str, data, *, streamed: bool, microbatches: int = 3):
    stages, loss_fn, opt, kw = model_for(schedule)
    runner = pipeq.PipelineRunner(copy.deepcopy(stages), loss_fn, opt, schedule_arg(schedule), microbatches,
                                  mode=mode, **FAST, **copy.deepcopy(kw))
    with runner:
        losses = list(runner.stream(data)) if streamed else [runner.step(x, y) for x, y in data]
        return losses, runner.state_dict()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["simulated", "process"])
@pytest.mark.parametrize("schedule", ["fill-drain", "1f1b", "global", "local", "pairwise", "nwise", "al"])
def test_streaming_changes_speed_never_numbers(schedule, mode):
    data = batches(6)
    data[4] = (data[4][0][:5], data[4][1][:5])  # a short batch: fewer samples than elsewhere
    want_losses, want_state = run(schedule, mode, data, streamed=False)
    losses, state = run(schedule, mode, data, streamed=True)
    assert losses == pytest.approx(want_losses, abs=1e-6)
    assert state.keys() == want_state.keys()
    for name in state:
        torch.testing.assert_close(state[name], want_state[name], atol=1e-6, rtol=0)


def train_runner(**kw):
    stages, loss_fn, opt, _ = model_for("1f1b")
    return pipeq.PipelineRunner(stages, loss_fn, opt, "1f1b", 3, **FAST, **kw)


@pytest.mark.timeout(120)
def test_break_finishes_what_was_taken_and_the_runner_goes_on():
    data = batches(8)
    taken = []

    def source():
        for item in data:
            taken.append(item)
            yield item

    with train_runner(mode="process") as runner:
        got = []
        for loss in runner.stream(source(), in_flight=3):
            got.append(loss)
            if len(got) == 2:
                break
        assert len(taken) == 4  # two handed out, two more were in flight when the loop broke
        # the runner is consistent and usable: its state is that of the batches taken, in order
        after_break = runner.state_dict()
        rest = [runner.step(x, y) for x, y in data[len(taken):]]
        final = runner.state_dict()
    with train_runner(mode="simulated") as ref:
        want = [ref.step(x, y) for x, y in taken]
        ref_after_break = ref.state_dict()
        want_rest = [ref.step(x, y) for x, y in data[len(taken):]]
        ref_final = ref.state_dict()
    assert got == pytest.approx(want[:2], abs=1e-6)
    assert rest == pytest.approx(want_rest, abs=1e-6)
    for name in final:
        torch.testing.assert_close(after_break[name], ref_after_break[name], atol=1e-6, rtol=0)
        torch.testing.assert_close(final[name], ref_final[name], atol=1e-6, rtol=0)


@pytest.mark.timeout(120)
def test_consistent_state_mid_stream_and_a_dataloader():
    x = torch.randn(60, 8, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 3, (60,), generator=torch.Generator().manual_seed(4))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=12)
    with train_runner(mode="process") as runner:
        stream = runner.stream(loader)
        first = list(itertools.islice(stream, 2))
        middle = runner.state_dict()  # drains what is in flight; the stream goes on after it
        rest = list(stream)
    with train_runner(mode="simulated") as ref:
        want = [ref.step(xb, yb) for xb, yb in loader]
    assert first + rest == pytest.approx(want, abs=1e-6) and len(want) == 5
    assert all(torch.isfinite(t).all() for t in middle.values())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["process", "simulated"])
@pytest.mark.parametrize("schedule", ["1f1b", "local"])
def test_a_failure_mid_stream_is_raised_at_its_batch_naming_the_stage(schedule, mode):
    """Stage 1 raises in the 4th batch: the three before it are handed out, then the error."""
    torch.manual_seed(0)
    stages = [nn.Linear(8, 8), Raises(8, after_calls=9), nn.Linear(8, 3)]  # 3 microbatches a batch
    kw = {"aux_heads": [nn.Linear(8, 3), nn.Linear(8, 3)]} if schedule == "local" else {}
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), MOMENTUM, schedule, 3, mode=mode, **FAST, **kw)
    got = []
    with pytest.raises(pipeq.PipelineError, match="boom from the stage") as info:
        with runner:
            for loss in runner.stream(batches(8), in_flight=4):
                got.append(loss)
    assert info.value.stage == 1
    assert len(got) == 3 and all(isinstance(v, float) for v in got)


def test_in_flight_is_checked():
    runner = train_runner(mode="simulated")
    with runner:
        for bad in (0, -1, 1.5):
            with pytest.raises(ValueError, match="in_flight must be a positive integer"):
                runner.stream(batches(2), in_flight=bad)
        with pytest.raises(ValueError, match="queue_capacity"):
            runner.stream(batches(2), in_flight=100)
