"""``memory_table``: the table ``pipeq launch`` logs after its first step, measured or not."""

from __future__ import annotations

import pytest

from pipeq.control.reports import StageMemory, memory_table

pytestmark = pytest.mark.timeout(30)


def test_the_title_names_the_measured_step():
    rows = [StageMemory(stage=k, replica=0, process=k, param_bytes=1024, grad_bytes=0, optimizer_bytes=0,
                        measured_step=3, microbatches=4, activation_peak_bytes=2048) for k in range(2)]
    text = memory_table(rows)
    assert text.splitlines()[0].startswith("memory per stage (activations: step 3's peak, measured")
    assert len(text.splitlines()) == 4  # the title, the header, a line per stage


def test_stages_that_measure_no_activations_say_so_rather_than_name_step_none():
    # (the research schedules' executors measure state bytes only: measured_step stays None)
    rows = [StageMemory(stage=k, replica=0, process=k, param_bytes=1024, grad_bytes=0, optimizer_bytes=0)
            for k in range(2)]
    title = memory_table(rows).splitlines()[0]
    assert "None" not in title and "not measured" in title, title
