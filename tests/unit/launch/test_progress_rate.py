"""What pipeq launch shows as it trains: samples/s as a moving average, epochs counted from 1."""

import io

import pytest

from pipeq.launch.progress import MovingRate, Progress, shown_epoch


def test_moving_rate_is_the_window_samples_over_its_seconds():
    rate = MovingRate(window=3)
    assert rate.add(32, 0.0) is None  # no time measured yet
    assert rate.add(32, 0.5) == pytest.approx(64 / 0.5)
    assert rate.add(32, 1.5) == pytest.approx(96 / 2.0)
    # the first step leaves the window: the last three steps only
    assert rate.add(64, 2.0) == pytest.approx((32 + 32 + 64) / (0.5 + 1.5 + 2.0))


def test_moving_rate_smooths_what_one_step_jumps():
    """The jumps one step's figure makes (a fast step after a drain, a slow one that fills the
    pipeline) move the average by a little only."""
    rate = MovingRate(window=20)
    steps = [(32, 0.01)] * 19 + [(32, 0.0004), (32, 0.003)]
    shown = [rate.add(n, t) for n, t in steps]
    own = [n / t for n, t in steps]
    assert max(own[-3:]) / min(own[-3:]) > 7
    assert max(shown[-3:]) / min(shown[-3:]) < 1.2


def test_quiet_lines_show_the_average():
    logged = []
    progress = Progress(quiet=True, stream=io.StringIO(), log_every=1, log=logged.append)
    progress.start(10, 0)
    progress.report({"step": 1, "epoch": 0, "loss": 1.0, "samples_per_s": 91320.0, "samples_per_s_avg": 8000.4})
    progress.report({"step": 2, "epoch": 0, "loss": 0.5, "samples_per_s": None})
    assert logged == ["step 1/10 loss 1.0000 8000 samples/s", "step 2/10 loss 0.5000 0 samples/s"]


@pytest.mark.parametrize("epoch, batch, shown", [(0, 0, 1), (0, 5, 1), (5, 3, 6), (5, 0, 5), (1, 0, 1)])
def test_epochs_are_shown_from_1(epoch, batch, shown):
    """A checkpoint's position (epoch from 0, the next batch's index): the step before it was in
    epoch ``shown`` (from 1); at an epoch's start, the step before ended the previous epoch."""
    assert shown_epoch(epoch, batch) == shown
