"""Job files with tensor parallelism refused before anything starts: a bad plan, nodes that disagree on the plan."""

from __future__ import annotations

import os
import re

import pytest

from tp_jobs import JOB, _in_tests, _launch

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("plan, message", [
    ('[{ "0" = "colwise" }, {}]', "tp_plan has 2 plans for 3 stages"),
    ('[{ "1" = "colwise" }, {}, {}]', "stage 0's plan: submodule '1'"),
    ('[{ "0" = "sideways" }, {}, {}]', "unknown style 'sideways'"),
    ('[{ "0" = 2 }, {}, {}]', "tp_plan[0] must be a table"),
    ('[{}, {}, { "" = "colwise" }]', "out_features=3 over tensor_parallel=2"),
])
def test_job_file_bad_plan_refused_before_start(tmp_path, capfd, plan, message) -> None:
    job = tmp_path / "bad.toml"
    job.write_text(re.sub(r"tp_plan = .*", f"tp_plan = {plan}", JOB))
    assert _in_tests(_launch(str(job), str(tmp_path / "out"))) == 2
    assert message in capfd.readouterr().err
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")


def test_nodes_must_agree_on_the_plan() -> None:
    """A node's agent compares node 0's job identity with its own: a plan that differs (or a
    plan on one side only) makes them differ, so the node is refused, naming ``tp_plan``."""
    from pipeq.control.processes import job_identity

    plan = [{"0": "colwise"}, {"0": "rowwise"}, {}]
    same = job_identity(b"", "1f1b", None, [dict(p) for p in plan])
    assert job_identity(b"", "1f1b", None, plan) == same
    assert job_identity(b"", "1f1b", None, [{"0": "rowwise"}, {"0": "rowwise"}, {}]) != same
    assert job_identity(b"", "1f1b", None, None) != same
    assert "tp_plan" not in job_identity(b"", "1f1b")  # identities of runs without it are unchanged
