"""A runner's lifecycle: built, running, closed; started once and stopped once.

:class:`Lifecycle` is the runner's collaborator that knows whether its stages run, starts and
stops its backend (:class:`~pipeq.runtime.backend.Backend`), and says what a call finds when they
do not run: a runner that never started, or one that ran and was closed (by ``close()``, or by a
failure), which cannot start again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from pipeq.control.main_guard import check_main_guard
from pipeq.errors import PipelineError, install_excepthook

if TYPE_CHECKING:
    from pipeq.runtime.backend import Backend

__all__ = ["Lifecycle"]


class Lifecycle:
    """Whether a runner's stages run; ``mode``: the runner's (``"process"``: its stage processes
    run the main script again, which must guard itself)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.running = False
        self.used = False  # started once: a closed runner stays closed

    def start(self, backend: Backend | None, prepare: Callable[[], None]) -> None:
        """Start ``backend`` (None: not built yet, ``schedule="auto"``: it starts once the first
        batch settles the schedule), ``prepare()`` first (what may run while the stages start);
        nothing when already running."""
        if self.running:
            return
        install_excepthook()  # an uncaught stage error shows its first line first (pipeq.errors.excepthook)
        if self.used:
            raise PipelineError("this runner has already run and been closed; a restart would begin again from "
                                "the stages' initial weights. Create a new runner (and load_state_dict the "
                                "state_dict you kept) instead")
        if self.mode == "process":  # each stage process runs the main script again
            check_main_guard()
        self.used = True
        prepare()
        if backend is not None:
            backend.start()
        self.running = True

    def close(self, backend: Backend | None, failed: bool = False) -> None:
        """Stop ``backend``'s stages, once (letting them finish what they were sent); ``failed``:
        see :meth:`~pipeq.runtime.backend.Backend.close`."""
        if self.running:
            self.running = False
            if backend is not None:
                backend.close(failed)

    def check(self) -> None:
        """Raise what a call finds when the stages do not run (closed, or never started)."""
        if not self.running and self.used:  # start() would refuse: say what works
            raise PipelineError("this runner is closed (after a failure, or by close()) and cannot start "
                                "again: build a new runner and load_state_dict the state_dict you kept "
                                "(or load a checkpoint)")
        if not self.running:
            raise PipelineError("the pipeline is not running; use 'with runner:' or runner.start()")
