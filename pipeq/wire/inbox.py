"""A stage process's one receiving loop: every inbound socket and lane of the process, polled as one.

A stage process holds one or more stages (virtual stages), each with its own control channel,
inbound data sockets and lanes (:class:`~pipeq.wire.stage_inbox.StageInbox`), and maybe links to
its replicas and tie peers (:class:`~pipeq.wire.group_link.GroupLink`). They all register what
they read here: a ZeroMQ socket with the function that files one of its messages
(:meth:`Inbox.watch_socket`: the Inbox drains it, :meth:`Inbox.drain`), a lane with the function
that reads it (:meth:`Inbox.watch`). Whatever the process waits for, everything that arrives is
filed where its owner looks. That matters beyond order: a
sender's shared-memory slots are freed only when the receiver copies them out, so a process that
waited on one socket only could leave a neighbour blocked on a slot while it waits on that
neighbour.

Every wait of the process is :meth:`Inbox.wait`: look for the item, poll and file, look again, and
give up on the driver's EXIT (any stage's: :class:`~pipeq.wire.errors.Stopped`) or when the
caller's ``give_up`` says so. The process's ZeroMQ context (and on tcp its ZAP handler, which
checks the job's keys at each handshake) lives here too.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any, Callable, Sequence, TypeVar

import zmq

from pipeq.wire.errors import Stopped
from pipeq.wire.messages import Kind, Message
from pipeq.wire.security import Gatekeeper, WireAuth

__all__ = ["Inbox", "SLICE_MS", "COLLECTIVE_SLICE_MS"]

SLICE_MS = 200  # how often a blocked wait looks for an EXIT from the driver (and at give_up)
#: how often a wait for a torch collective looks at it (it completes in a thread of its own,
#: which the poller does not hear)
COLLECTIVE_SLICE_MS = 2

T = TypeVar("T")
Source = Any  # a ZeroMQ socket, or a file descriptor (a lane's)


class Inbox:
    """The receiving half of one stage process (see the module). Not thread-safe: the event loop
    owns it. ``auth``/``tcp``: the process binds on tcp, where peers must hold the job's keys."""

    def __init__(self, auth: WireAuth | None = None, tcp: bool = False) -> None:
        self.ctx = zmq.Context(io_threads=1)
        self._gate = Gatekeeper.on_tcp(self.ctx, auth, tcp, "a stage bound")
        self._poller = zmq.Poller()
        self._readers: dict[Source, Callable[[Source], None]] = {}
        self._takers: dict[zmq.Socket, Callable[[Sequence[Any]], None]] = {}
        self._commands: list[collections.deque[Message]] = []  # every stage's command queue
        self._checks: list[Callable[[], None]] = []  # run where EXIT is looked for (see on_check)

    def watch(self, source: Source, read: Callable[[Source], None]) -> None:
        """Poll ``source`` too; ``read(source)`` files what waits on it when it is readable."""
        if source not in self._readers:
            self._poller.register(source, zmq.POLLIN)
        self._readers[source] = read

    def watch_socket(self, sock: zmq.Socket, take: Callable[[Sequence[Any]], None]) -> None:
        """Poll ZeroMQ socket ``sock`` too; ``take(frames)`` files each message drained from it."""
        self._takers[sock] = take
        self.watch(sock, self.drain)

    def drain(self, sock: zmq.Socket) -> None:
        """Hand every message waiting on ``sock`` (a watched socket) to its taker; never waits."""
        take = self._takers[sock]
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            take(frames)

    def unwatch(self, source: Source) -> None:
        self._takers.pop(source, None)
        if self._readers.pop(source, None) is not None:
            self._poller.unregister(source)

    def commands(self) -> collections.deque[Message]:
        """A new command queue (one per stage): an EXIT filed in any of them ends every wait."""
        queue: collections.deque[Message] = collections.deque()
        self._commands.append(queue)
        return queue

    def pump(self, timeout_ms: int) -> bool:
        """Wait up to ``timeout_ms`` for traffic on any source and file it; True if any came."""
        events = self._poller.poll(timeout_ms)
        readers = self._readers
        for source, _ in events:
            read = readers.get(source)
            if read is not None:  # (a lane may have been dropped by an earlier read of this round)
                read(source)
        return bool(events)

    def on_check(self, check: Callable[[], None]) -> None:
        """Run ``check()`` wherever a blocked wait looks for the driver's EXIT: it may raise
        :class:`~pipeq.wire.errors.Stopped` too (a lost replica's stage that gives its step up)."""
        self._checks.append(check)

    def check_exit(self) -> None:
        """Raise :class:`~pipeq.wire.errors.Stopped` if the driver's EXIT is among the queued
        commands (or a check of :meth:`on_check` says the wait must end)."""
        for queue in self._commands:
            for msg in queue:
                if msg.kind is Kind.EXIT:
                    raise Stopped()
        for check in self._checks:
            check()

    def wait(self, take: Callable[[], T | None], *, give_up: Callable[[], bool] | None = None,
             spin_s: float = 0.0, probe: Callable[[], bool] | None = None, slice_ms: int = SLICE_MS) -> T | None:
        """``take()``'s item, once there is one, filing the process's traffic meanwhile. An EXIT
        from the driver interrupts the wait (:class:`~pipeq.wire.errors.Stopped`); ``give_up()``
        turning true ends it with None. With ``spin_s``, busy-poll that long first with
        ``probe()`` (a cheap, non-blocking read of the one source the item comes from: it saves
        a wake-up on the latency-bound path) before sleeping in the poller, ``slice_ms`` at a time."""
        got = take()
        if got is not None:
            return got
        if spin_s > 0 and probe is not None:
            end = time.perf_counter() + spin_s
            while time.perf_counter() < end:
                if probe():
                    got = take()
                    if got is not None:
                        return got
                os.sched_yield()  # let other stages (and ZeroMQ's I/O thread) have the core
        while True:
            if give_up is not None and give_up():
                return None
            self.pump(slice_ms)
            got = take()
            if got is not None:
                return got
            self.check_exit()

    def until(self, done: Callable[[], bool], spin_s: float = 0.0) -> None:
        """Wait until ``done()`` is true, for a condition the poller cannot see (a torch collective
        of the process's, running in its own thread): look every :data:`COLLECTIVE_SLICE_MS` while
        filing the process's traffic (after busy-polling ``spin_s``). An EXIT from the driver
        interrupts the wait (:class:`~pipeq.wire.errors.Stopped`), as in :meth:`wait`."""
        self.wait(lambda: True if done() else None, spin_s=spin_s, probe=done, slice_ms=COLLECTIVE_SLICE_MS)

    def close(self) -> None:
        """Stop the key checks and end the context. Its owners close their sockets first (with
        their linger); any left open (an owner that failed half-way through its making) are
        closed here, without one."""
        if self._gate is not None:
            self._gate.stop()
        self.ctx.destroy(linger=0)
