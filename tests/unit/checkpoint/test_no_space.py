"""A save that finds the disk full says where, while saving what, and which checkpoint is intact
(the disk is not filled: the write raises what a full disk raises)."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from torch import nn

from pipeq import checkpoint
from pipeq.checkpoint import CheckpointError, NoSpaceError, load, save, stage_snapshot
from pipeq.checkpoint import disk

#: what torch.save raises when its zip writer comes up short (a full disk)
TORCH_FULL = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1408 vs 1302")
OS_FULL = OSError(errno.ENOSPC, "No space left on device")


def snapshots(seed: int) -> list:
    torch.manual_seed(seed)
    return [stage_snapshot(nn.Linear(4, 4)), stage_snapshot(nn.Linear(4, 2))]


def full_at(monkeypatch, name: str, exc: BaseException) -> None:
    """Writing the file ``name`` of a checkpoint raises ``exc`` after writing part of it."""
    write_file = disk.write_file

    def writing(path, write):
        if os.path.basename(path) == name:
            def partial(f):
                f.write(b"x" * 100)
                raise exc
            return write_file(path, partial)
        return write_file(path, write)

    monkeypatch.setattr(disk, "write_file", writing)


@pytest.mark.parametrize("exc", [TORCH_FULL, OS_FULL], ids=["torch-writer", "ENOSPC"])
def test_a_full_disk_names_the_device_the_path_the_stage_and_the_intact_checkpoint(tmp_path, monkeypatch, exc):
    root = tmp_path / "checkpoints"
    first = checkpoint.checkpoint_dir(str(root), 40)
    save(first, snapshots(0), {"step": 40})
    full_at(monkeypatch, "stage-1.pt", exc)
    second = checkpoint.checkpoint_dir(str(root), 50)
    with pytest.raises(NoSpaceError) as info:
        save(second, snapshots(1), {"step": 50})
    text = str(info.value)
    assert text.startswith("no space left on ")
    assert "(mounted at /" in text or "the device mounted at /" in text
    assert f" for {os.path.realpath(second)} while saving stage 1; the previous checkpoint " in text
    assert f"{os.path.realpath(first)} (step 40) is intact" in text
    assert isinstance(info.value, CheckpointError)
    assert sorted(os.listdir(root)) == ["step-00000040"]  # no partial copy is left behind
    assert load(first).meta == {"step": 40}


def test_a_full_disk_replacing_a_checkpoint_leaves_that_one_loadable(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    save(path, snapshots(0), {"step": 7})
    full_at(monkeypatch, "manifest.json", OS_FULL)
    with pytest.raises(NoSpaceError, match=r"while saving the manifest; the previous checkpoint .*ckpt \(step 7\) "
                                           r"is intact"):
        save(path, snapshots(1), {"step": 8})
    assert load(path).meta == {"step": 7}
    assert os.listdir(tmp_path) == ["ckpt"]


def test_other_write_errors_are_not_taken_for_a_full_disk(tmp_path, monkeypatch):
    full_at(monkeypatch, "stage-0.pt", OSError(errno.EIO, "Input/output error"))
    with pytest.raises(OSError, match="Input/output error") as info:
        save(str(tmp_path / "ckpt"), snapshots(0), {})
    assert not isinstance(info.value, NoSpaceError)


def test_no_room_for_the_temporary_directory_is_a_full_disk_too(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    save(path, snapshots(0), {"step": 3})

    def full(_path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk, "make_temp", full)
    with pytest.raises(NoSpaceError, match=r"while saving the checkpoint \(creating its temporary directory\); the previous checkpoint .*\(step 3\)"):
        save(path, snapshots(1), {"step": 4})
    assert load(path).meta == {"step": 3}
