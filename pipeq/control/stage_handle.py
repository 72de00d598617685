"""A stage process watched and stopped by its pid, whatever happens to the fork server.

With ``start_method="forkserver"`` a stage is the fork server's child, not the driver's:
multiprocessing learns its exit code through a pipe from the server. If the fork server dies
(killed, OOM), that pipe closes and the process object reports exit code 255 for a stage that is
still running, and its ``terminate()`` and ``kill()`` become no-ops (they only signal a process
not known to have exited). :class:`StageHandle` wraps the process object and asks the kernel
instead, through a pidfd (Linux >= 5.3; a pid that cannot be reused while it is open), else
``kill(pid, 0)``: a stage is running until its pid has exited, and it is signalled by pid.

A process holding several stages (virtual stages) has one handle, which each of its stages'
numbers maps to: closing it once keeps its exit code, for whoever asks through another of them.
"""

from __future__ import annotations

import os
import select
import signal
import time
from typing import Any

__all__ = ["StageHandle"]


class StageHandle:
    """A started stage process (``multiprocessing`` ``Process``) with the same ``pid``,
    ``exitcode``, ``is_alive``, ``kill``, ``terminate``, ``join`` and ``close``, judged by pid."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc
        self.pid: int = proc.pid
        self.name: str = proc.name
        self._closed_with: int | None = None  # the exit code it had when closed (see close)
        try:
            self._pidfd: int | None = os.pidfd_open(self.pid)  # type: ignore[attr-defined]
        except (AttributeError, OSError):  # no pidfd here (or already reaped: judged by the process object)
            self._pidfd = None

    def _running(self) -> bool:
        """Whether the pid is still running (a zombie has exited)."""
        if self._pidfd is not None:
            return not select.select([self._pidfd], [], [], 0)[0]
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return True

    @property
    def exitcode(self) -> int | None:
        """None while the stage runs; then its exit code as multiprocessing has it (255 when the
        fork server that started it is gone: then nobody has its real one)."""
        if self._closed_with is not None:
            return self._closed_with
        code = self.proc.exitcode
        if code is None or not self._running():
            return code
        return None  # the fork server's pipe closed, not the stage

    def is_alive(self) -> bool:
        return self.exitcode is None

    def _signal(self, sig: int) -> None:
        if self._closed_with is not None or not self._running():
            return
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)  # type: ignore[attr-defined]
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def join(self, timeout: float | None = None) -> None:
        """Wait until the stage has exited (at most ``timeout`` seconds)."""
        if self._closed_with is not None:
            return
        end = None if timeout is None else time.monotonic() + timeout
        self.proc.join(timeout)  # returns at once when the fork server is gone
        while self.exitcode is None and (end is None or time.monotonic() < end):
            left = 0.05 if end is None else max(0.0, min(0.05, end - time.monotonic()))
            if self._pidfd is not None:
                select.select([self._pidfd], [], [], left)
            else:
                time.sleep(left)

    def close(self) -> None:
        """Release the process object and the pidfd (the stage has exited); its exit code stays."""
        if self._closed_with is not None:
            return
        code = self.exitcode
        try:
            self.proc.close()
        except ValueError:  # multiprocessing thinks it still runs: it is the fork server's to reap
            return
        self._closed_with = code if code is not None else -9
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:
        if getattr(self, "_pidfd", None) is not None:
            try:
                os.close(self._pidfd)  # type: ignore[arg-type]
            except OSError:
                pass
