"""The shapes between stages, checked on the meta device at the first batch, before it is sent
(pipeq.control.shape_check): a mismatch names both stages and shapes at once; anything the check
cannot judge falls back quietly to the stages' own errors. No process runs here."""

from __future__ import annotations

import functools
import time

import pytest
import torch
from torch import nn

import pipeq
from pipeq.control import shape_check
from pipeq.control.driver import ProcessBackend
from pipeq.runtime.simulated import SimulatedBackend

SGD = functools.partial(torch.optim.SGD, lr=0.1)
MISMATCH = r"^stage 0 returns \(4, 64\) float32, but stage 1 expects \(\*, 128\): "


def mismatched() -> list[nn.Module]:
    return [nn.Sequential(nn.Linear(8, 64), nn.ReLU()), nn.Linear(128, 3)]


def xy(batch: int = 16):
    return torch.randn(batch, 8), torch.randint(0, 3, (batch,))


def never(*args, **kwargs):
    raise AssertionError("the batch was sent (or a stage process started) before the shapes were checked")


@pytest.fixture
def no_processes(monkeypatch):
    """Process mode with nothing started or sent: the check must answer before either."""
    for name in ("start", "close"):
        monkeypatch.setattr(ProcessBackend, name, lambda self, *args: None)
    monkeypatch.setattr(ProcessBackend, "submit", never)
    import torch._dynamo  # noqa: F401 - what warm_up() imports while the stages start: time the check alone


def test_a_mismatch_between_stages_names_both_before_the_batch_is_sent(no_processes):
    runner = pipeq.PipelineRunner(mismatched(), nn.CrossEntropyLoss(), SGD, microbatches=4, start_method="forkserver")
    with runner:
        t0 = time.perf_counter()
        with pytest.raises(pipeq.PipelineError, match=MISMATCH) as info:
            runner.step(*xy())
        elapsed = time.perf_counter() - t0
    assert elapsed < 1.0, f"the shape check took {elapsed:.2f} s"
    assert info.value.stage == 1
    assert "(checked on the meta device before the first batch was sent)" in str(info.value)


def test_with_schedule_auto_it_answers_before_any_process_starts(monkeypatch, no_processes):
    monkeypatch.setattr(ProcessBackend, "start", never)
    runner = pipeq.PipelineRunner(mismatched(), nn.CrossEntropyLoss(), SGD, schedule="auto", microbatches=4,
                                  start_method="forkserver")
    with runner, pytest.raises(pipeq.PipelineError, match=MISMATCH):
        runner.step(*xy())


def test_the_first_batch_of_a_stream_is_checked(monkeypatch):
    monkeypatch.setattr(SimulatedBackend, "submit", never)
    runner = pipeq.PipelineRunner(mismatched(), nn.CrossEntropyLoss(), SGD, microbatches=4, mode="simulated")
    with runner, pytest.raises(pipeq.PipelineError, match=MISMATCH):
        list(runner.stream([xy(), xy()]))


def test_matching_stages_train_untouched_and_draw_no_random_number():
    stages = [nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5)), nn.LayerNorm(16), nn.Linear(16, 3)]
    before = [{k: v.clone() for k, v in s.state_dict().items()} for s in stages]
    x = torch.randn(4, 8)
    rng = torch.get_rng_state()
    shape_check.check_stages(stages, x)
    assert torch.equal(torch.get_rng_state(), rng)
    for stage, state in zip(stages, before):
        for k, v in stage.state_dict().items():
            assert v.device.type == "cpu" and torch.equal(v, state[k]), k


class Picks(nn.Module):
    """A data-dependent shape: what the meta device cannot know."""

    def forward(self, x):
        return x[x > 0]


@pytest.mark.parametrize("stages, x", [
    ([nn.Linear(8, 6), nn.Linear(6, 3)], torch.randn(4, 5)),  # stage 0 refusing x: its process says so
    ([nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 3))], torch.randn(4, 8)),  # fine
    ([nn.Embedding(10, 8), nn.Linear(8, 3)], torch.randint(0, 10, (4,))),  # integer input, fine
    ([nn.Linear(8, 8), nn.Sequential(nn.Flatten(), nn.BatchNorm1d(5))], torch.randn(4, 8)),  # meta cannot tell
])
def test_what_it_cannot_judge_passes_quietly(stages, x):
    shape_check.check_stages(stages, x)


def test_stages_of_your_own_classes_are_not_run_in_the_driver(monkeypatch):
    # a forward of your own may sleep, exit or talk to other processes: only torch's and pipeq's layers run
    monkeypatch.setattr(shape_check, "check_stages", never)
    torch.manual_seed(0)
    model = pipeq.PipelineRunner([nn.Linear(8, 8), Picks(), nn.Linear(5, 3)], nn.MSELoss(), SGD, mode="simulated")
    with model, pytest.raises(pipeq.PipelineError) as info:  # the stage's own error: no check ran here
        model.step(torch.randn(16, 8), torch.randn(16, 3))
    assert info.value.stage == 2
    assert not shape_check.checkable([nn.Sequential(nn.Linear(8, 8), Picks())])
    assert shape_check.checkable(mismatched())


def test_stage_inputs_or_a_recipe_skip_the_check():
    def make():
        return pipeq.PipelineRunner(mismatched(), nn.CrossEntropyLoss(), SGD, microbatches=4, mode="simulated")

    with make() as checked, pytest.raises(pipeq.PipelineError, match=MISMATCH):
        checked.step(*xy())  # these stages are checked ...
    with make() as runner, pytest.raises(pipeq.PipelineError) as info:  # ... unless stage_inputs are given
        runner.step(*xy(), stage_inputs={})  # stage_inputs: the stages' own error, as before
    assert "returns (4, 64)" not in str(info.value) and info.value.stage == 1


class Reader(nn.Module):
    """Tokens -> (B, T, 8) features -> 3 logits per sequence: averaged over the length, or, with
    ``fixed``, flattened into one Linear of ``fixed`` x 8 inputs (a length the model fixes)."""

    def __init__(self, fixed: int | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8 * (fixed or 1), 3)
        self.fixed = fixed

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.emb(idx)))
        return self.head(h.flatten(1) if self.fixed else h.mean(1))


def tokens(T: int, batch: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 40, (batch, T), generator=g), torch.randint(0, 3, (batch,), generator=g)


def test_a_traced_split_is_checked_and_a_first_batch_of_another_length_passes(monkeypatch):
    """Traced from length 32, the first batch of length 24 (then 40) is checked on the meta device
    and trains: a legal change of length is never refused."""
    checked = []
    real = shape_check.check_stages
    monkeypatch.setattr(shape_check, "check_stages", lambda stages, x: checked.append(x.shape) or real(stages, x))
    torch.manual_seed(0)
    model = Reader()
    stages = pipeq.split(model, (tokens(32)[0][:2],), split_points=["mix"])
    assert stages.dynamic == {"idx": {0: (2, None), 1: (2, None)}}
    with pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD, microbatches=4, mode="simulated") as runner:
        x, y = tokens(24)
        assert runner.step(x, y) == pytest.approx(nn.CrossEntropyLoss()(model(x), y).item(), abs=1e-6)
        runner.step(*tokens(40, seed=1))
    assert checked == [(4, 24)]  # the first batch's first microbatch, once


def test_a_length_the_model_fixes_is_said_at_split_time_and_refused_in_the_driver():
    """The split says the length is fixed; a batch of another length is refused in the driver,
    naming stage, input, dimension and why, before anything is sent: the pipeline goes on."""
    torch.manual_seed(0)
    model = Reader(fixed=32)
    stages = pipeq.split(model, (tokens(32)[0][:2],), split_points=["mix"])
    assert stages.static == {"idx": {1: 32}}  # said at split time
    with pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD, microbatches=4, mode="simulated") as runner:
        with pytest.raises(ValueError, match=r"^split stage 0: input 'idx' has size 24 in dim 1, but the trace fixed "
                                             r"that dimension at 32 \(the model's code fixes it"):
            runner.step(*tokens(24))
        with pytest.raises(ValueError, match=r"input 'idx' has size 1 in dim 1"):
            runner.predict(tokens(1)[0])
        x, y = tokens(32)
        assert runner.step(x, y) == pytest.approx(nn.CrossEntropyLoss()(model(x), y).item(), abs=1e-6)
