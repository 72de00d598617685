"""The runner's lifecycle: :class:`RunnerLifecycle` starts and stops the stages (``start``,
``close``, ``with runner:``), the part of :class:`~pipeq.PipelineRunner` that owns its backend's
processes."""

from __future__ import annotations

from typing import Any

from pipeq.control import shape_check
from pipeq.control.exclusive import exclusive
from pipeq.control.main_guard import check_main_guard
from pipeq.errors import PipelineError, install_excepthook

__all__ = ["RunnerLifecycle"]


class RunnerLifecycle:
    """Starting and stopping the stages (mixed into the runner)."""

    _backend: Any
    _running: bool
    _used: bool
    _auto: Any
    _shape_model: Any
    mode: str

    @exclusive
    def start(self) -> Any:
        """Start the stages (one process per stage in process mode) and return the runner;
        ``with runner:`` calls it. A runner starts once: one that ran and was closed refuses
        (build a new one and load the ``state_dict`` you kept). In process mode the runner
        must be started under the main script's ``if __name__ == "__main__":``. The first start
        installs :func:`pipeq.errors.excepthook` (an uncaught stage error shows its first line
        first) where ``sys.excepthook`` is still Python's own."""
        if self._running:
            return self
        install_excepthook()
        if self._used:
            raise PipelineError(
                "this runner has already run and been closed; a restart would begin again from "
                "the stages' initial weights. Create a new runner (and load_state_dict the "
                "state_dict you kept) instead"
            )
        if self.mode == "process":  # each stage process runs the main script again
            check_main_guard()
        self._used = True
        if self._shape_model is not None:
            shape_check.warm_up()
        if self._auto is None:  # "auto": the backend starts once the schedule is settled
            self._backend.start()
        self._running = True
        return self

    @exclusive
    def close(self) -> None:
        """Stop every stage (letting them finish what they were sent, up to ``stop_timeout``);
        the end of a ``with runner:`` block calls it. A closed runner cannot start again."""
        if self._running:
            self._running = False
            if self._backend is not None:
                self._backend.close()

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the exception in flight with a shutdown error
            try:
                self.close()
            except PipelineError:
                pass

    def __del__(self) -> None:
        try:
            if getattr(self, "_running", False):
                self.close()
        except Exception:
            pass
