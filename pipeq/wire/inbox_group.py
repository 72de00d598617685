"""The inboxes of one process holding several stages, drained together.

A process of v virtual stages has v :class:`~pipeq.wire.stage_inbox.StageInbox` (each stage its
own control channel, inbound sockets and lanes, as the driver and the neighbours see it). While
the event loop waits for one stage's message, the others' arrivals must be filed too: their
senders' shared-memory slots are freed only when the receiver copies them out, so a sender
blocked on a busy slot would otherwise wait on a process that waits on it. :class:`InboxGroup`
polls every member's sockets and lanes at once and files what came into the member it came for;
each member's :meth:`~pipeq.wire.stage_inbox.StageInbox.pump` comes here once it is a member.
"""

from __future__ import annotations

from typing import Any, Sequence

import zmq

__all__ = ["InboxGroup"]


class InboxGroup:
    """``members`` (StageInbox objects of one process) polled as one."""

    def __init__(self, members: Sequence[Any]) -> None:
        self.members = list(members)
        for m in self.members:
            m.group = self
        self._poller: zmq.Poller | None = None
        self._lanes: tuple[int, ...] = ()
        self._owner: dict[Any, Any] = {}

    def _poll_set(self) -> zmq.Poller:
        """The poller of every member's sockets and lane fds (rebuilt when lanes come or go)."""
        lanes = tuple(fd for m in self.members for fd in m._lane_fds)
        if self._poller is None or lanes != self._lanes:
            poller = zmq.Poller()
            owner: dict[Any, Any] = {}
            for m in self.members:
                for sock in (m.ctrl, m.fwd_in, m.bwd_in):
                    poller.register(sock, zmq.POLLIN)
                    owner[sock] = m
                for fd, sock in m._lane_fds.items():
                    poller.register(fd, zmq.POLLIN)
                    owner[fd] = (m, sock)
            self._poller, self._lanes, self._owner = poller, lanes, owner
        return self._poller

    def pump(self, timeout_ms: int) -> bool:
        """Wait up to ``timeout_ms`` for traffic to any member and file it; True if any came."""
        events = self._poll_set().poll(timeout_ms)
        for sock, _ in events:
            if type(sock) is int:
                member, beside = self._owner[sock]
                member._drain_lane(beside, accept=True)
            else:
                self._owner[sock]._drain(sock)
        return bool(events)

    def check_exit(self) -> None:
        """Raise :class:`~pipeq.wire.errors.Stopped` if any member was told EXIT."""
        for m in self.members:
            m.check_exit()
