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
