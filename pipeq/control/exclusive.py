"""One thread at a time in a runner: its public calls refuse a second thread instead of sharing
the driver's sockets with it.

A runner's control channel (ZeroMQ sockets) and its bookkeeping of the steps in flight belong
to the thread that is using it: two threads inside ``step`` at once would corrupt them (libzmq
aborts the process, replies are taken by the wrong caller). :class:`CallGuard` is a non-blocking
re-entrant lock around the runner's public methods (:func:`exclusive`): the runner's own nested
calls (``stream`` -> ``_settle``, ``evaluate`` -> ``predict``) enter again, while a call from
another thread raises a :class:`~pipeq.PipelineError` at once and changes nothing. It
costs a lock acquire and release per call.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Iterator, TypeVar
from contextlib import contextmanager

from pipeq.errors import PipelineError

__all__ = ["CallGuard", "exclusive"]

F = TypeVar("F", bound=Callable[..., Any])


class CallGuard:
    """Which thread is inside the runner, and in which call."""

    __slots__ = ("_lock", "_holder", "_depth")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._holder: tuple[str, str] | None = None  # (thread name, the call it is in)
        self._depth = 0

    def enter(self, what: str) -> None:
        """Enter call ``what``, or raise if another thread is inside the runner."""
        if not self._lock.acquire(blocking=False):
            holder = self._holder
            who = f"thread {holder[0]!r} ({holder[1]})" if holder is not None else "another thread"
            raise PipelineError(
                f"{what}: this runner is in use by {who}; a runner is not thread-safe: use it from "
                "one thread, or guard it with a lock")
        if self._depth == 0:
            self._holder = (threading.current_thread().name, what)
        self._depth += 1

    def leave(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._holder = None
        self._lock.release()

    @contextmanager
    def held(self, what: str) -> Iterator[None]:
        self.enter(what)
        try:
            yield
        finally:
            self.leave()


def exclusive(method: F) -> F:
    """Run a runner's public ``method`` inside its :class:`CallGuard` (``self._guard``)."""
    what = method.__name__

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        guard = self._guard
        guard.enter(what)
        try:
            return method(self, *args, **kwargs)
        except PipelineError as exc:
            raise answer_first(exc)
        finally:
            guard.leave()

    return guarded  # type: ignore[return-value]


def answer_first(exc: PipelineError) -> PipelineError:
    """A stage's failure without the driver's frames (the runner's plumbing, which says nothing of it):
    printed uncaught, it is the caller's line, then the error naming the stage, then the stage's own
    traceback (in its text). Other PipelineErrors keep their traceback."""
    return exc.with_traceback(None) if exc.stage is not None else exc
