"""``schedule="auto"`` with ``auto_memory_limit``: the profile measures what each stage holds, the
choice keeps the schedules whose every process's predicted peak fits, says why in one line, and
the run it chose holds what was predicted (simulated mode: the same meter as process mode)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipeq
from pipeq.control.memory_limit import MemoryLimitError

pytestmark = pytest.mark.timeout(120)
SGD = functools.partial(torch.optim.SGD, lr=0.05)
WIDTH = 64


def _stages(n: int = 8) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH), nn.LayerNorm(WIDTH))
            for _ in range(n)]


def _data(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, WIDTH, generator=g), torch.randn(32, WIDTH, generator=g)) for _ in range(steps)]


def _run(schedule, limit=None, **more):
    with pipeq.PipelineRunner(_stages(), nn.MSELoss(), SGD, schedule, 16, mode="simulated", stages_per_process=2,
                              auto_memory_limit=limit, **more) as r:
        losses = [r.step(x, y) for x, y in _data()]
        return r, losses, r.memory(), r.state_dict()


def test_a_limit_that_zbv_and_interleaved_1f1b_exceed_but_v_half_meets(capsys):
    """Four processes of two stages each: with room for all, the ranking's bytes per schedule;
    a limit between V-Half's predicted peak and the 1F1B-like schedules' (ZBV, interleaved 1F1B)
    picks a schedule that fits, which trains as that schedule named and holds what was predicted."""
    roomy, _, _, _ = _run("auto", "64GiB")
    free = {r.name: r for r in roomy.auto_choice.rows}
    assert all(r.fits for r in free.values() if r.bytes is not None)
    assert free["v-min"].bytes < free["v-half"].bytes < min(free["zbv"].bytes, free["interleaved-1f1b"].bytes)
    limit = int((free["v-half"].bytes + min(free["zbv"].bytes, free["interleaved-1f1b"].bytes)) / 2)
    capsys.readouterr()
    runner, losses, memory, state = _run("auto", limit)
    choice = runner.auto_choice
    rows = {r.name: r for r in choice.rows}
    assert not rows["zbv"].fits and not rows["interleaved-1f1b"].fits
    assert choice.name in ("v-half", "v-min") and rows[choice.name].bytes <= limit
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith(f"chosen: {choice.name} ") and "per process" in said
    # what the chosen run holds, measured: each process's stages' state and activation peak
    held = {}
    for m in memory:
        held[m.process] = held.get(m.process, m.process_activation_peak_bytes) + m.state_bytes
    assert max(held.values()) <= limit * 1.02, (held, limit)
    _, direct, _, direct_state = _run(choice.name)
    assert losses == pytest.approx(direct, abs=1e-6)
    for k in state:
        torch.testing.assert_close(state[k], direct_state[k], atol=1e-6, rtol=0)


def test_a_limit_no_schedule_fits_names_the_least_any_needs():
    with pytest.raises(MemoryLimitError, match=r"least any needs: .* raise the limit"):
        _run("auto", "1KiB")


def test_without_a_first_step_the_limit_is_said_not_applied(capsys):
    with pipeq.PipelineRunner(_stages(), nn.MSELoss(), SGD, "auto", 4, mode="simulated",
                              auto_memory_limit="1GiB") as r:
        r.predict(torch.randn(4, WIDTH))
    assert "auto_memory_limit='1GiB' not applied" in capsys.readouterr().err
