"""``pipeq launch`` on a full disk: one line says where, while saving what, and which checkpoint
--resume continues from; no traceback (the disk is not filled: the write raises what it would)."""

from __future__ import annotations

import errno
import os

import pytest

from job_files import MLP, launch_code, write


@pytest.mark.timeout(120)
@pytest.mark.parametrize("exc", [RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1408 vs 1302"),
                                 OSError(errno.ENOSPC, "No space left on device")], ids=["torch-writer", "ENOSPC"])
def test_launch_says_the_disk_is_full_and_what_is_intact(tmp_path, monkeypatch, capsys, exc) -> None:
    from pipeq.checkpoint import disk
    from strays import wait_no_strays

    write_file = disk.write_file

    def writing(path, write):  # the step-6 checkpoint finds the disk full at stage 1's file
        if ".step-00000006." in path and path.endswith("stage-1.pt"):
            return write_file(path, lambda f: (f.write(b"x" * 64), (_ for _ in ()).throw(exc)))
        return write_file(path, write)

    monkeypatch.setattr(disk, "write_file", writing)
    out = tmp_path / "out"
    job = write(tmp_path, MLP + f'steps = 6\ncheckpoint_every = 3\nout = "{out}"\n')
    assert launch_code(job) == 1
    err = capsys.readouterr().err
    assert wait_no_strays() == []
    first = os.path.realpath(out / "checkpoints" / "step-00000003")
    line = [ln for ln in err.splitlines() if "no space left" in ln]
    assert len(line) == 1, err
    assert line[0].startswith("pipeq launch: no space left on "), err
    assert (f"for {os.path.realpath(out / 'checkpoints' / 'step-00000006')} while saving stage 1; the previous "
            f"checkpoint {first} (step 3) is intact") in line[0], err
    assert "--resume continues from" in line[0], err
    assert "Traceback" not in err, err
    assert sorted(os.listdir(out / "checkpoints")) == ["step-00000003"]


@pytest.mark.timeout(180)
def test_a_full_disk_at_model_pt_keeps_the_final_state_and_resume_writes_it(tmp_path, monkeypatch, capsys) -> None:
    import torch

    from pipeq.checkpoint import atomic
    from strays import wait_no_strays

    write_file = atomic.write_file

    def writing(path, write):  # model.pt finds the disk full, part of it written
        if os.path.basename(path) == "model.pt.tmp":
            return write_file(path, lambda f: (f.write(b"x" * 64), (_ for _ in ()).throw(
                RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1408 vs 1302"))))
        return write_file(path, write)

    out = tmp_path / "out"
    job = write(tmp_path, MLP + f'steps = 6\ncheckpoint_every = 3\nout = "{out}"\n')
    monkeypatch.setattr(atomic, "write_file", writing)
    assert launch_code(job) == 1
    err = capsys.readouterr().err
    assert wait_no_strays() == []
    line = [ln for ln in err.splitlines() if "no space left" in ln]
    assert len(line) == 1, err
    final = os.path.realpath(out / "final")
    assert f" for {out / 'model.pt'} while saving the model state; {final} (step 6) is intact" in line[0], err
    assert "run again with --resume: it writes model.pt" in line[0], err
    assert "Traceback" not in err, err
    assert not {"model.pt", "model.pt.tmp"} & set(os.listdir(out)), os.listdir(out)

    monkeypatch.setattr(atomic, "write_file", write_file)  # space freed
    assert launch_code(job, "--resume") == 0
    err = capsys.readouterr().err
    assert f"wrote {out / 'model.pt'} from the final state" in err, err
    other = tmp_path / "uninterrupted"
    assert launch_code(job, "--out", str(other)) == 0
    got, want = (torch.load(d / "model.pt", weights_only=True) for d in (out, other))
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.timeout(180)
def test_a_full_disk_replacing_model_pt_keeps_the_old_one_whole_and_resume_replaces_it(tmp_path, monkeypatch,
                                                                                         capsys) -> None:
    """A run trained further (--resume --steps 6 after 4 steps) finds the disk full at model.pt: the
    step-4 model.pt stays whole, and --resume (all 6 steps trained) replaces it from final/."""
    import torch

    from pipeq.checkpoint import atomic

    write_file = atomic.write_file

    def writing(path, write):
        if os.path.basename(path) == "model.pt.tmp":
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_file(path, write)

    out = tmp_path / "out"
    job = write(tmp_path, MLP + f'steps = 4\ncheckpoint_every = 2\nout = "{out}"\n')
    assert launch_code(job) == 0
    before = torch.load(out / "model.pt", weights_only=True)
    monkeypatch.setattr(atomic, "write_file", writing)
    assert launch_code(job, "--resume", "--steps", "6") == 1
    assert "while saving the model state" in capsys.readouterr().err
    assert not (out / "model.pt.tmp").exists()
    kept = torch.load(out / "model.pt", weights_only=True)  # the old one, whole
    assert all(torch.equal(kept[k], before[k]) for k in before)

    monkeypatch.setattr(atomic, "write_file", write_file)
    assert launch_code(job, "--resume", "--steps", "6") == 0
    assert "(it was older than the final state)" in capsys.readouterr().err
    other = tmp_path / "uninterrupted"
    assert launch_code(job, "--steps", "6", "--out", str(other)) == 0
    got, want = (torch.load(d / "model.pt", weights_only=True) for d in (out, other))
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
