"""What a plan holds (pipeq.schedules.memory): each stage's peak of microbatches in flight, counted
from F to B or W (an I keeps them), and each process's, in closed form for the classic schedules."""

from __future__ import annotations

import pytest

import pipeq.schedules as S
from pipeq.schedules import B, F, I, STEP, W
from pipeq.schedules.choose import peak_in_flight
from pipeq.schedules.memory import in_flight_peaks, process_peaks, stage_in_flight

pytestmark = pytest.mark.timeout(30)


def test_an_input_gradient_keeps_the_microbatch_until_its_weight_gradient():
    # one stage: F0 F1 I0 I1 W0 W1: two in flight until the first W; F0 B0 F1 B1: one
    assert stage_in_flight([[F(0), F(1), I(0), I(1), W(0), W(1), STEP]]) == [2]
    assert stage_in_flight([[F(0), I(0), W(0), F(1), I(1), W(1), STEP]]) == [1]
    assert stage_in_flight([[F(0), B(0), F(1), B(1), STEP]]) == [1]


@pytest.mark.parametrize("n, m", [(2, 4), (4, 8), (4, 3), (3, 7)])
def test_the_classic_schedules_hold_what_their_papers_say(n, m):
    assert in_flight_peaks("fill-drain", n, m) == [m] * n
    assert in_flight_peaks("1f1b", n, m) == [min(m, n - k) for k in range(n)]
    assert max(in_flight_peaks("zb-h1", n, m)) == min(m, n)  # 1F1B's peak (arXiv 2401.10241)


def test_a_process_of_two_stages_holds_their_sum_at_each_moment():
    lowered = S.build("zbv", 8, 8)
    where = S.process_stages("zbv", 8)
    per_stage = stage_in_flight(lowered, where)
    assert per_stage == in_flight_peaks("zbv", 8, 8)
    whole = process_peaks(lowered)  # in chunks
    assert all(max(per_stage[k] for k in held) <= whole[p] <= sum(per_stage[k] for k in held)
               for p, held in enumerate(where))
    # choose.peak_in_flight is the busiest process's, each chunk weighing 1/v: 1F1B's N for ZBV
    assert peak_in_flight(lowered, 2) == max(process_peaks(lowered, lambda p, c: 0.5)) == 4
    # weighted by bytes per microbatch: the process's peak in bytes
    weights = [[10.0, 1.0] for _ in where]
    assert process_peaks(lowered, lambda p, c: weights[p][c])[0] <= 10 * per_stage[0] + 1 * per_stage[7]


def test_pipeq_schedule_memory_prints_each_stages_peak(capsys):
    from pipeq.launch.cli import main

    assert main(["schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--memory"]) == 0
    out = capsys.readouterr().out
    assert [line.strip() for line in out.splitlines() if line.startswith("  stage ")] == [
        "stage 0: 4", "stage 1: 3", "stage 2: 2", "stage 3: 1"]
    assert main(["schedule", "v-half", "--stages", "4", "--microbatches", "8", "--memory"]) == 0
    out = capsys.readouterr().out
    assert "process 0 (stages 0, 7): 2 whole stages' microbatches at once, 0.50x 1F1B's 4" in out
    # auto's activation limit is --memory-limit; --memory with auto says so
    assert main(["schedule", "auto", "--stages", "4", "--microbatches", "8", "--memory-limit", "0.5"]) == 0
    assert "memory limit 0.5x 1F1B's" in capsys.readouterr().out
    assert main(["schedule", "auto", "--stages", "4", "--microbatches", "8", "--memory"]) == 2
    assert "--memory-limit X" in capsys.readouterr().err
