"""A module's ``time``, whose monotonic clock a test moves on by hand: ``monkeypatch.setattr(module,
"time", clock)`` makes the seconds that module measures pass without sleeping through them."""

from __future__ import annotations

import time


class FakeClock:
    """``time`` with ``monotonic()`` running ``ahead`` seconds in front of the real one."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead

    def __getattr__(self, name: str):
        return getattr(time, name)
