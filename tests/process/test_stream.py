"""``runner.stream(batches)``: the pipeline stays full across batches and the numbers do not change."""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
from torch import nn

import pipeq
from models import Raises, TutorialStage0, TutorialStage1
from stream_cases import FAST, MOMENTUM, batches, model_for


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


# -- asynchronous 1F1B streams for real: the tutorial's two-stage pipeline (seed 000) --------------
def tutorial_batches(n: int, seed: int = 40):
    """The tutorial's data (320 samples, 16 features, 0/1 targets) and its batch order: 32 rows at a
    time, cycling; its slicing makes the last batch of each pass x[288:-1], 31 rows."""
    torch.manual_seed(seed)
    x = torch.rand(320, 16)
    y = torch.randint(0, 2, (320, 1)).float()
    out = []
    for i in range(n):
        start, end = i * 32 % 320, (i + 1) * 32 % 320
        end = -1 if end == 0 else end
        out.append((x[start:end], y[start:end]))
    return out


def tutorial_replay(stages, data, lr=0.5, warmup=3):
    """The tutorial's loop, replayed in one process: clock ticks; on each tick stage 0 either
    forwards the next batch or backpropagates the oldest gradient that came back (and steps), and
    stage 1 alternates forward and backward (and steps); stage 0 forwards ``warmup`` batches before
    it starts alternating. Returns stage 1's loss of each batch, in order."""
    s0, s1 = copy.deepcopy(stages)
    opt0, opt1 = torch.optim.SGD(s0.parameters(), lr=lr), torch.optim.SGD(s1.parameters(), lr=lr)
    to_stage1, to_backward1, back_to_stage0 = [], [], []
    losses = []
    forward0, forward1, sent = True, False, 0
    while len(losses) < len(data):
        if forward0:
            if sent < len(data):
                xb, yb = data[sent]
                to_stage1.append((s0(xb), yb))
                sent += 1
        elif back_to_stage0:
            out0 = back_to_stage0.pop(0)
            opt0.zero_grad()
            out0.backward(out0.grad)
            opt0.step()
        if forward1:
            if to_stage1:
                out0, yb = to_stage1.pop(0)
                to_backward1.append((s1(out0), out0, yb))
        elif to_backward1:
            out1, out0, yb = to_backward1.pop(0)
            opt1.zero_grad()
            loss = nn.functional.binary_cross_entropy(out1, yb)
            loss.backward(inputs=[*s1.parameters(), out0], retain_graph=True)
            back_to_stage0.append(out0)
            opt1.step()
            losses.append(loss.item())
        if sent >= warmup:
            forward0 = not forward0
        forward1 = not forward1
    return losses


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "n"), [("simulated", 1200), ("process", 300)])
def test_async_stream_replays_the_tutorial_pipeline(mode, n):
    torch.manual_seed(1)
    stages = [TutorialStage0(), TutorialStage1()]
    data = tutorial_batches(n)
    want = tutorial_replay(stages, data)
    runner = pipeq.PipelineRunner(copy.deepcopy(stages), nn.BCELoss(), functools.partial(torch.optim.SGD, lr=0.5),
                                  pipeq.schedules.AsyncOneFOneB(warmup=3), 1, mode=mode, **FAST)
    with runner:
        got = list(runner.stream(data))
    assert len(got) == n
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-6
    assert sum(got[-20:]) < sum(got[:20])  # and it learns


@pytest.mark.timeout(120)
def test_report_gives_a_streamed_runs_throughput_against_its_bound(tmp_path):
    """A traced stream is recognised as one (steps sent before the previous loss came back) and
    compared with the schedule's streamed bound; a step loop with the step-loop bound."""
    from pipeq.trace import report
    from pipeq.testing import SleepStage
    from pipeq.trace.format import load_trace

    found = {}
    for how in ("stream", "step"):
        # sleeps long enough that a busy machine (other tests on other xdist workers) adds
        # little to the measured costs: both bounds are computed from their own run's costs
        stages = [SleepStage(4, 0.01, 0.02) for _ in range(3)]
        path = tmp_path / f"{how}.json"
        runner = pipeq.PipelineRunner(stages, nn.MSELoss(), MOMENTUM, "local", 2, trace=str(path), **FAST,
                                      aux_heads=[nn.Identity(), nn.Identity()], aux_loss=nn.MSELoss())
        data = [(torch.randn(4, 4), torch.randn(4, 4)) for _ in range(10)]
        with runner:
            if how == "stream":
                list(runner.stream(data))
            else:
                [runner.step(x, y) for x, y in data]
        got = report.analyze(load_trace(path), skip_first=1)
        found[how] = got.throughput
        text = report.format_report(got)
        assert f"({'streamed' if how == 'stream' else 'step loop'})" in text and "bound with these costs" in text
    assert found["stream"].streamed and not found["step"].streamed
    # the schedule allows more streamed than in a loop of steps (no flush), with the same costs
    assert found["stream"].bound_steps_per_s > 1.2 * found["step"].bound_steps_per_s
    for t in found.values():
        assert t.steps_per_s > 0 and len(t.costs_ms) == 3
        assert all(f > 7.5 and b > 17.5 for f, b, _ in t.costs_ms)  # the sleeps, measured


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["1f1b", "async"])
def test_stage_stuck_in_a_stream_names_the_batch_and_microbatch(schedule):
    # stage 1's 7th forward (3 microbatches a batch: batch 3's microbatch 0) sleeps 60 s. With
    # asynchronous 1F1B microbatches are numbered across batches: the report still names the
    # batch's own step and microbatch. Stages 0 and 2 (waiting for it) are not blamed.
    import time

    from strays import wait_no_strays
    from models import StallsOnce

    stages = [nn.Linear(8, 8), StallsOnce(8, call=7, seconds=60), nn.Linear(8, 3)]
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), MOMENTUM, schedule=schedule, microbatches=3,
                                  step_timeout=1, heartbeat_interval=0.25, **FAST)
    with pytest.raises(pipeq.PipelineError, match=r"stuck: has been in F\(step 3, microbatch 0\)") as info:
        with runner:
            t0 = time.monotonic()
            list(runner.stream(batches(6)))
    assert info.value.stage == 1
    assert time.monotonic() - t0 < 10
    assert not wait_no_strays(5.0)
