"""The wire's exceptions: a peer breaking the protocol, a stage out of reach, an EXIT while waiting."""

from __future__ import annotations

__all__ = ["ProtocolError", "PeerUnreachable", "Stopped"]


class ProtocolError(RuntimeError):
    """A peer sent something the schedule does not allow (duplicate, overflow, wrong kind)."""


class PeerUnreachable(RuntimeError):
    """The driver could not hand a message to a stage (its control socket is gone)."""

    def __init__(self, process: int) -> None:
        super().__init__(f"stage process {process} is not connected to the control channel")
        self.process = process


class Stopped(Exception):
    """The driver told this stage to exit while it was waiting for data."""
