"""What ``pipeq launch`` prints when it cannot go on, without processes: a damaged checkpoint
as one line naming the file and what to do."""

from __future__ import annotations

import hashlib
import io
import json
from types import SimpleNamespace

from pipeq import checkpoint
from pipeq.launch.trainer import Trainer


def _damaged_checkpoint(out, step: int) -> str:
    """A checkpoint of ``step`` whose stage file no longer matches its manifest's sha256."""
    directory = out / "checkpoints" / f"step-{step:08d}"
    directory.mkdir(parents=True)
    stage = directory / "stage-0.pt"
    stage.write_bytes(b"x" * 64)
    entry = {"name": "stage-0.pt", "bytes": 64, "sha256": hashlib.sha256(b"y" * 64).hexdigest()}
    manifest = {"format": checkpoint.FORMAT, "version": checkpoint.VERSION, "n_stages": 1, "layers": [1],
                "files": [entry], "meta": {"step": step}}
    (directory / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    return str(directory)


class _Runner:
    """Enough of a PipelineRunner for a resume: its load reads the checkpoint from the disk."""

    n_stages = 1

    def __enter__(self) -> "_Runner":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def load(self, directory: str) -> dict:
        return checkpoint.load(directory).meta


def test_a_damaged_checkpoint_on_resume_is_one_line_naming_the_file_and_what_to_do(tmp_path) -> None:
    out = tmp_path / "run"
    damaged = _damaged_checkpoint(out, 4)
    stream = io.StringIO()
    job = SimpleNamespace(out=str(out), snapshot_every=0, log_every=1, data_parallel=1, tensor_parallel=1)
    trainer = Trainer(job, None, resume=True, quiet=True, stream=stream)
    trainer._runner = _Runner
    code, failure = trainer._attempt(None)
    assert (code, failure) == (1, None)
    said = stream.getvalue()
    assert "Traceback" not in said, said
    last = said.splitlines()[-1]
    assert last.startswith(f"pipeq launch: CheckpointError: {damaged}/stage-0.pt does not match its sha256 in the "
                           "manifest: corrupted. "), said
    assert (f"move it out of {out}/checkpoints and run again with --resume to continue from the one before it"
            in last), said


class _Failing:
    """A runner whose stages fail in its own step ``fails`` (it numbers every step it sends from
    1, an evaluation's batches too, as PipelineRunner.steps_sent says), naming that step."""

    last_step_lr = None

    def __init__(self, fails: int) -> None:
        self.steps_sent, self.fails = 0, fails

    def stream(self, batches):
        from pipeq.errors import PipelineError

        for _ in batches:
            self.steps_sent += 1
            if self.steps_sent == self.fails:
                s = self.steps_sent
                raise PipelineError(
                    f"FloatingPointError: stage 0: the input x of microbatch 0 (step {s}) holds NaN or Inf", 0,
                    "Traceback (most recent call last):\n  File \"stage.py\", line 3, in forward\n"
                    "    raise FloatingPointError(f'... (step 2)')\n"
                    f"FloatingPointError: stage 0: the input x of microbatch 0 (step {s}) holds NaN or Inf\n")
            yield 1.0

    def evaluate(self, batches: int) -> None:
        self.steps_sent += batches


def test_a_stage_error_after_a_restart_and_evaluations_names_the_runs_step() -> None:
    """Resumed from step 4, an evaluation of 3 batches after each even step: the runner's step 7
    is the run's step 8 (5, 6, evaluation, 7, 8), and the error says so (its traceback's last line
    too; the code's lines are left as they are)."""
    import torch

    from pipeq.launch.data import Batches
    from pipeq.launch.signals import StopSignals
    from pipeq.launch.stream import StepNumbers, train_steps

    runner = _Failing(fails=7)
    numbers = StepNumbers(runner)
    source = Batches(((0, i, (torch.zeros(2, 1), torch.zeros(2))) for i in range(4, 10)), 0)
    trained = []
    try:
        for done in train_steps(runner, source, 4, 10, (2,), False, StopSignals(), numbers=numbers):
            trained.append(done.step)
            if done.step % 2 == 0:  # every segment ends at an even step: its evaluation
                runner.evaluate(3)
    except Exception as exc:  # noqa: BLE001 (the stages' failure, as the runner raises it)
        failure = exc
    assert trained == [5, 6], trained
    said = Trainer._run_steps(failure, numbers)
    assert said.message == "FloatingPointError: stage 0: the input x of microbatch 0 (step 8) holds NaN or Inf"
    assert said.stage == 0 and said.remote_traceback.splitlines()[-2:] == [
        "    raise FloatingPointError(f'... (step 2)')",
        "FloatingPointError: stage 0: the input x of microbatch 0 (step 8) holds NaN or Inf"]
    assert [numbers.run_step(n) for n in (1, 2, 3, 5, 6, 7)] == [5, 6, None, None, 7, 8]  # 3-5: the evaluation's
