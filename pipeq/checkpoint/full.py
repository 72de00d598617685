"""A save that runs out of disk space: recognised, and said plainly.

A full disk shows up as ``OSError: [Errno 28] No space left on device`` (no path) from a write or
an fsync, or, inside ``torch.save``, as torch's zip writer failing (``[enforce fail at
inline_container.cc:...] . unexpected pos ...``, ``file write failed``), which loses the errno.
:func:`no_space_error` turns either into a :class:`~pipeq.checkpoint.NoSpaceError` that says
where (the device, the path), while saving what, and which checkpoint is still intact (a save
never touches the previous one before the new one is complete: :mod:`pipeq.checkpoint.atomic`).
"""

from __future__ import annotations

import errno
import json
import os

from pipeq.checkpoint.atomic import complete_at
from pipeq.checkpoint.data import MANIFEST, NoSpaceError

__all__ = ["is_no_space", "no_space_error", "describe_checkpoint"]

#: what torch's zip writer (caffe2's PyTorchStreamWriter) says when a write comes up short
_TORCH_WRITER = ("inline_container", "PytorchStreamWriter", "file write failed", "unexpected pos")


def is_no_space(exc: BaseException) -> bool:
    """Whether ``exc`` is a write that found the disk (or the quota) full."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(exc, RuntimeError) and any(t in str(exc) for t in _TORCH_WRITER)


def _mount_of(path: str) -> str:
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def _device_of(path: str) -> str:
    """``/dev/sda1 (mounted at /data)``: the device holding ``path``, as the mount table names it."""
    mount = _mount_of(path)
    device = None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:  # the last entry for a mount point is the one in use
                fields = line.split()
                if len(fields) > 1 and fields[1].replace("\\040", " ") == mount:
                    device = fields[0]
    except OSError:
        pass
    return f"{device} (mounted at {mount})" if device else f"the device mounted at {mount}"


def describe_checkpoint(path: str) -> str:
    """``checkpoints/step-00000040 (step 40)``: a complete checkpoint, with its step if it says."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            step = json.load(f)["meta"]["step"]
        return f"{path} (step {step})"
    except (OSError, ValueError, KeyError, TypeError):
        return path


def _previous(path: str) -> str:
    """What a failed save into ``path`` left intact: the checkpoint there, or the newest of its
    ``step-<n>`` siblings (a run's checkpoints)."""
    if complete_at(path):
        return f"the previous checkpoint {describe_checkpoint(path)} is intact"
    from pipeq.checkpoint.steps import latest  # (steps imports atomic, as this module does)

    newest = latest(os.path.dirname(path))
    if newest is not None:
        return f"the previous checkpoint {describe_checkpoint(newest)} is intact"
    return f"no checkpoint was there to lose ({path} is as it was)"


def no_space_error(path: str, what: str, exc: BaseException, intact: str | None = None,
                   then: str = "Free some space (or save elsewhere) and save again") -> NoSpaceError:
    """The error of a save into ``path`` that ran out of space while writing ``what`` (``stage k``);
    ``intact``: what is still there (by default the previous checkpoint), ``then``: what to do."""
    cause = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
    return NoSpaceError(
        f"no space left on {_device_of(os.path.dirname(path))} for {path} while saving {what}; "
        f"{intact or _previous(path)} ({cause}). {then}", path)
