"""Every restart stays on record in metrics.jsonl: one that resumes from step 0 (the file trimmed
to it), one whose stages failed again as they started, one after which the run gave up."""

from __future__ import annotations

import json

from pipeq.errors import PipelineError
from pipeq.launch.metrics import MetricsLog
from pipeq.launch.restarts import Restarts


def records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def test_restarts_that_resume_from_step_0_keep_every_earlier_record(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    log, restarts = MetricsLog(str(path)), Restarts(20, str(path), lambda line: None)
    for n in range(20):  # each attempt trains two steps, then a stage is killed (no checkpoint yet)
        log.trim(0)  # what a TrainingLoop does as it starts from step 0
        restarts.resumed(0, "start")
        with log:
            log.write({"step": 1, "loss": 1.0})
            log.write({"step": 2, "loss": 1.0})
        assert restarts.again(PipelineError(f"stage process (pid {1000 + n}) was killed by SIGKILL", 1), 3 + n % 2)
    log.trim(0)
    restarts.resumed(0, "start")
    got = records(path)
    assert [r["restart"] for r in got] == list(range(1, 21))
    assert all(r["resumed_from"] == 0 and r["state_from"] == "start" for r in got)


def test_a_trim_to_a_later_step_keeps_the_restart_records_of_any_step(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 1.0}, {"restart": 1, "step": 2, "resumed_from": 2},
             {"step": 3, "loss": 1.0}, {"restart": 2, "step": 3, "resumed_from": 3}, {"step": 4, "loss": 1.0}]
    path.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    MetricsLog(str(path)).trim(1)  # a restart that found only the checkpoint of step 1
    assert records(path) == [lines[0], lines[2], lines[4]]


def test_a_restart_whose_stages_fail_again_as_they_start_is_on_record(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    restarts = Restarts(2, str(path), lambda line: None)
    assert restarts.again(PipelineError("stage process (pid 11) was killed by SIGKILL", 1), 31)
    # restart 1's stages fail as they start: no resume, its record written all the same
    assert restarts.again(PipelineError("timed out after 60 s waiting for READY (start)"), 31)
    # and restart 2's: the run gives up (2 restarts), with both on record
    assert not restarts.again(PipelineError("stage process (pid 13) was killed by SIGKILL", 0), 31)
    got = records(path)
    assert [r["restart"] for r in got] == [1, 2]
    assert all(r["resumed_from"] is None and r["unfinished_step"] == 31 for r in got)
    assert got[0]["error"].endswith("SIGKILL") and got[0]["start_failed"].startswith("timed out after 60 s")
    assert got[1]["error"].startswith("timed out") and got[1]["start_failed"].endswith("SIGKILL")


def test_a_restart_the_launch_never_resumed_is_on_record(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    restarts = Restarts(3, str(path), lambda line: None)
    assert restarts.again(PipelineError("stage process (pid 11) was killed by SIGKILL", 1), 8)
    restarts.ended(130)  # Ctrl-C as its stages started
    restarts.ended(130)  # (once)
    got = records(path)
    assert len(got) == 1 and got[0]["resumed_from"] is None and got[0]["step"] == 7
    assert got[0]["start_failed"] == "the launch ended (exit code 130) before it resumed"


def test_a_failure_is_the_same_whatever_the_pid_of_the_process(tmp_path) -> None:
    said: list[str] = []
    restarts = Restarts(5, str(tmp_path / "metrics.jsonl"), said.append)
    assert restarts.again(PipelineError("stage process (pid 4242) was killed by SIGSEGV", 1), 29)
    restarts.resumed(20)
    assert not restarts.again(PipelineError("stage process (pid 4317) was killed by SIGSEGV", 1), 29)
    assert said[-1].startswith("step 29 failed twice in a row with the same error")


def test_a_kill_from_outside_twice_at_the_same_step_is_two_faults(tmp_path) -> None:
    """SIGKILL (an operator, the OOM killer, a chaos script) says nothing of the stage: the same
    step killed twice restarts again, as long as restarts are left."""
    restarts = Restarts(5, str(tmp_path / "metrics.jsonl"), lambda line: None)
    assert restarts.again(PipelineError("stage process (pid 4242) was killed by SIGKILL", 1), 10)
    restarts.resumed(8)
    assert restarts.again(PipelineError("stage process (pid 4300) was killed by SIGKILL", 1), 10)


def test_a_line_cut_short_by_a_full_disk_or_a_kill_does_not_stop_a_resume(tmp_path) -> None:
    """metrics.jsonl's last line half written: a trim (any step, 0 too) drops it, losses skip it."""
    path = tmp_path / "metrics.jsonl"
    for step in (0, 2):
        path.write_text('{"step": 1, "epoch": 0, "loss": 2.0}\n{"restart": 1, "step": 1}\n'
                        '{"step": 2, "epoch": 0, "loss": 1.5}\n{"step": 3, "epoch": 0, "lo')
        log = MetricsLog(str(path))
        assert log.losses(0) == [2.0, 1.5]
        log.trim(step)
        assert [ln.get("step") for ln in records(path)] == ([1] if step == 0 else [1, 1, 2])


def test_a_start_that_fails_after_a_resume_names_the_step_it_would_have_trained(tmp_path) -> None:
    from types import SimpleNamespace

    from pipeq.launch.trainer import Trainer

    out = tmp_path / "run"
    found = out / "checkpoints" / "step-00000030"
    found.mkdir(parents=True)
    (found / "manifest.json").write_text(json.dumps({"meta": {"step": 30}}))
    trainer = Trainer(SimpleNamespace(out=str(out), snapshot_every=0), None)
    assert trainer._failed_step() == 1  # the run's first start
    trainer.resume = True  # a restart, its stages failed as they started: it would have trained step 31
    assert trainer._failed_step() == 31


HUNG = "no heartbeat for 2.0 s (heartbeat_timeout=2.0); the stage is hung or unreachable"


def test_a_node_lost_twice_at_the_same_step_is_two_faults_not_a_bug(tmp_path) -> None:
    """A failure from outside (a node lost: its agent gone, its host cut off, as the regroup
    found) never counts as "the same step failed twice"; the same hang on nodes that all
    stayed still does."""
    said: list[str] = []
    restarts = Restarts(5, str(tmp_path / "metrics.jsonl"), said.append)
    assert restarts.again(PipelineError(HUNG, stage=1), 4, lost_nodes=[1])
    restarts.resumed(2)
    assert restarts.again(PipelineError(HUNG, stage=1), 4, lost_nodes=[1])
    restarts.resumed(2)
    # a lost node's failure is not the first of two either: the same hang once more, no node lost
    assert restarts.again(PipelineError(HUNG, stage=1), 4)
    restarts.resumed(2)
    assert not restarts.again(PipelineError(HUNG, stage=1), 4)  # twice on healthy nodes: a bug
    assert said[-1].startswith("step 4 failed twice in a row with the same error")


def test_the_launch_regroups_before_it_judges_a_repeated_failure(tmp_path) -> None:
    """Multi-host: node 0's regroup says which nodes were lost before :meth:`Restarts.again`
    judges the failure; node 1 lost twice at step 4 restarts twice, with both on record."""
    from types import SimpleNamespace

    from pipeq.launch.elastic import GIVE_UP, GO, Decision
    from pipeq.launch.trainer import Trainer

    def launch(*decisions: Decision) -> tuple[list[bool], list[str], Trainer]:
        out = tmp_path / f"run{len(decisions)}-{decisions[0].action}"
        said: list[str] = []
        trainer = Trainer(SimpleNamespace(out=str(out), snapshot_every=0), None)
        trainer.log = said.append
        restarts = Restarts(3, str(tmp_path / f"{out.name}.jsonl"), said.append)
        trainer._loop = SimpleNamespace(arrived=3, runner=None)  # steps 1-3 trained, step 4 unfinished
        went = []
        for decision in decisions:
            elastic = SimpleNamespace(regroup=lambda place=None, d=decision: d)
            went.append(trainer._restart(PipelineError(HUNG, stage=1), restarts, elastic))
        return went, said, trainer

    rejoined = Decision(GO, (0, 1), (), rejoined=(1,))
    went, said, _ = launch(rejoined, rejoined, rejoined)
    assert went == [True, True, True], said
    went, said, _ = launch(Decision(GO, (0, 1)), Decision(GO, (0, 1)))  # no node lost: a hang on a live node
    assert went == [True, False] and "a bug, not a fault" in said[-1], said
    went, said, _ = launch(Decision(GIVE_UP, (0,), (1,)))
    assert went == [False] and said[-1] == "restart 1 of 3 not started (too few nodes left)", said
    path = tmp_path / "run1-give up.jsonl"
    assert not path.exists()  # written as the launch ends (Restarts.ended)
