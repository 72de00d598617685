"""SIGINT and SIGTERM while ``pipeq launch`` runs: the first asks the training loop to stop, a second interrupts."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

__all__ = ["StopSignals"]


class StopSignals:
    """SIGINT and SIGTERM while ``pipeq launch`` runs.

    While the training loop runs (:attr:`graceful`), the first signal only asks it to stop: no
    batch is sent after it, the ones sent finish, and the loop checkpoints the last step (see
    :meth:`pipeq.launch.trainer.Trainer.train`). Anywhere else (start-up, or a second signal) it raises
    KeyboardInterrupt at once. The command exits with 128 + the first signal's number."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self.graceful = False

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopSignals"]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # signals reach the main thread only: nothing to install
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        first = self.received is None
        if first:
            self.received = signum
        if not (first and self.graceful):
            raise KeyboardInterrupt

    @property
    def stopping(self) -> bool:
        return self.received is not None

    def name(self) -> str:
        return signal.Signals(self.received or signal.SIGINT).name

    def exit_code(self) -> int:
        return 128 + int(self.received or signal.SIGINT)
