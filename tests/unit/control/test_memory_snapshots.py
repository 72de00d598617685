"""In-memory snapshots (``runner.keep_snapshots``): taken at the right steps, restored to the same training; the launch's keeper adopts only finished steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeq
from pipeq.control.snapshots import MemorySnapshot
from pipeq.launch.snapshots import Snapshots

pytestmark = pytest.mark.unit


def _stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.2)), nn.Linear(12, 12), nn.Linear(12, 3)]


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def _runner(schedule: str = "1f1b") -> pipeq.PipelineRunner:
    return pipeq.PipelineRunner(_stages(), nn.functional.cross_entropy, _adam, schedule, 4, mode="simulated",
                                lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, 0.5))


@pytest.mark.parametrize("schedule", ["1f1b", "async"])
def test_a_restored_snapshot_trains_on_exactly_as_the_uninterrupted_run(schedule):
    """Dropout's RNG, Adam's moments and the StepLR come back too: the same bits, the same losses.
    (Asynchronous 1F1B's stream is drained for its snapshot, so its reference drains there too.)"""
    data = _batches(9)
    with _runner(schedule) as whole:
        losses = list(whole.stream(data[:7])) + list(whole.stream(data[7:]))
        final = whole.state_dict()
    with _runner(schedule) as first:
        first.keep_snapshots(3, first_step=0)
        list(first.stream(data[:7]))
        snap = first.snapshot
    assert snap is not None and snap.step == (6 if schedule == "1f1b" else 7)  # async: once drained
    assert snap.nbytes > 0
    with _runner(schedule) as again:
        again.restore_snapshot(snap)
        rest = list(again.stream(data[snap.step:]))
        got = again.state_dict()
    assert rest == losses[snap.step:]
    assert all(torch.equal(final[k], got[k]) for k in final)


def test_snapshot_steps_count_from_first_step_and_bad_settings_are_refused():
    with _runner() as r:
        r.keep_snapshots(4, first_step=10)  # a run resumed at step 10: snapshots at 12, 16
        data = _batches(6)
        list(r.stream(data[:1]))
        r.predict(data[0][0])  # an evaluation's batches are no training steps
        list(r.stream(data[1:2]))
        at_12, after_12 = r.snapshot, r.state_dict()
        assert at_12.step == 12
        list(r.stream(data[2:]))
        assert r.snapshot.step == 16
        with _runner() as again:
            again.restore_snapshot(at_12)
            assert all(torch.equal(after_12[k], v) for k, v in again.state_dict().items())
        with pytest.raises(ValueError, match="snapshot_every must be a non-negative integer"):
            r.keep_snapshots(-1)
        wrong = MemorySnapshot(3, r.snapshot.stages[:2])
        with pytest.raises(ValueError, match="holds 2 stages, this runner 3"):
            r.restore_snapshot(wrong)


class _FakeRunner:
    def __init__(self) -> None:
        self.snapshot: MemorySnapshot | None = None
        self.every = None

    def keep_snapshots(self, every: int, first_step: int = 0) -> None:
        self.every = (every, first_step)


def test_the_keeper_adopts_a_snapshot_only_once_the_loop_has_finished_its_step():
    keeper, runner = Snapshots(2), _FakeRunner()
    keeper.attach(runner, 4)
    assert runner.every == (2, 4)
    keeper.finished(runner, 5, (0, 5))
    runner.snapshot = MemorySnapshot(6, [])
    keeper.adopt(runner, 5)  # step 6 not finished by the loop (its line unwritten): not yet
    assert keeper.newest() is None
    keeper.finished(runner, 6, (0, 6))
    assert keeper.newest()[0].step == 6 and keeper.newest()[1] == (0, 6)
    runner.snapshot = MemorySnapshot(8, [])
    keeper.finished(runner, 7, (1, 0))
    assert keeper.newest()[0].step == 6  # 8 unfinished
    assert Snapshots(0).newest() is None
