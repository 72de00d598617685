"""The output directory: owned by one run (its lock), its files, and the checkpoint a resumed run starts from."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil

from pipeq import checkpoint

__all__ = ["RunDir", "RunDirError", "LOCK", "METRICS", "RUN_FILES", "checkpoint_step"]

METRICS = "metrics.jsonl"
LOCK = ".lock"
#: What a run leaves in its output directory (and the leftovers of its interrupted writes).
RUN_FILES = re.compile(r"metrics\.jsonl(\.tmp)?|model\.pt(\.tmp)?|checkpoints|final|tb|\.final\.(old|[0-9a-f]{16}\.tmp)")


def checkpoint_step(directory: str) -> int | None:
    """The step in a complete checkpoint's manifest (None: none there, or unreadable)."""
    try:
        with open(os.path.join(directory, checkpoint.MANIFEST)) as f:
            return int(json.load(f)["meta"]["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class RunDirError(ValueError):
    """The output directory cannot be used by this launch (exit code 2)."""


class RunDir:
    """The output directory, owned by one run: ``OUT/.lock`` (``fcntl.flock``, with the pid in
    it) is held for the run's life, and another run's files there are refused unless the launch
    resumes that run or overwrites it. A refused launch changes nothing in the directory."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.lock_path = os.path.join(out, LOCK)
        self.checkpoints = os.path.join(out, "checkpoints")  # step-<n>/, every checkpoint_every steps
        self.final = os.path.join(out, "final")  # the final state, as a checkpoint
        self.model = os.path.join(out, "model.pt")  # final/'s model state, a plain state_dict
        self.metrics = os.path.join(out, METRICS)
        self.tb = os.path.join(out, "tb")  # TensorBoard's event files (pipeq.launch.tensorboard)
        self._fd: int | None = None

    def newest_checkpoint(self) -> str | None:
        """The newest complete checkpoint (what --resume continues): of checkpoints/, or final/
        (a finished run given more steps); None: there is none."""
        found = checkpoint.latest(self.checkpoints)
        final = checkpoint_step(self.final)
        if final is not None and (found is None or final > checkpoint_step(found)):  # type: ignore[operator]
            return self.final
        return found

    def run_files(self) -> list[str]:
        """The names of a run's files in the directory (see :data:`RUN_FILES`)."""
        try:
            return sorted(e for e in os.listdir(self.out) if RUN_FILES.fullmatch(e))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _busy(self, holder: str) -> RunDirError:
        who = f" (pid {holder})" if holder else ""
        return RunDirError(f"{self.out} is in use by another pipeq launch{who}, which holds {self.lock_path}; "
                           "wait for it to end, or choose another --out")

    @staticmethod
    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise

    def _holder(self) -> str | None:
        """The pid a live launch wrote into the lock (None: nobody holds it). Reads only."""
        try:
            fd = os.open(self.lock_path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            if self._try_lock(fd):
                return None
            return os.pread(fd, 64, 0).decode(errors="replace").strip()
        finally:
            os.close(fd)  # closing drops a lock we took

    def _refuse_other_run(self, resume: bool, overwrite: bool) -> None:
        found = self.run_files()
        if found and not (resume or overwrite):
            raise RunDirError(
                f"{self.out} holds another run ({', '.join(found)}): pass --resume to continue it, "
                "--overwrite to delete its files and start a new run there, or choose another --out; "
                "nothing in it was changed")

    def claim(self, *, resume: bool, overwrite: bool) -> list[str]:
        """Lock the directory for this run (made if need be); with ``overwrite`` delete the old
        run's files. Raises :class:`RunDirError`, before any change, when another launch holds it
        or (without ``resume`` / ``overwrite``) it holds another run. The names deleted."""
        if os.path.exists(self.out) and not os.path.isdir(self.out):
            raise RunDirError(f"--out {self.out} is a file, not a directory")
        holder = self._holder()
        if holder is not None:
            raise self._busy(holder)
        self._refuse_other_run(resume, overwrite)
        os.makedirs(self.out, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        if not self._try_lock(fd):  # another launch got here first
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            raise self._busy(holder)
        self._fd = fd
        try:
            self._refuse_other_run(resume, overwrite)  # again, under the lock
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            gone = self.run_files() if overwrite else []
            for name in gone:
                path = os.path.join(self.out, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
        except BaseException:
            self.release()
            raise
        return gone

    def release(self) -> None:
        """Unlock (the lock file stays: removing it would race with a launch opening it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
