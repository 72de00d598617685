"""A stage process's authenticated channel to a group of peer processes (its tie peers).

::

    member a <--(PUSH->PULL, both ways)--> member b      (every pair of the group)

:class:`GroupLink` is what tied weights' :class:`~pipeq.wire.tie_link.TieLink` is made of: whole
tensors tagged ``(step, index)``, sent to some members and filed by sender until
:meth:`GroupLink.wait` asks.
"""

from __future__ import annotations

import struct
from typing import Any, Callable, Sequence

import torch
import zmq

from pipeq.wire import codec
from pipeq.wire.errors import ProtocolError
from pipeq.wire.frames import decode_aligned
from pipeq.wire.inbox import Inbox
from pipeq.wire.messages import Kind
from pipeq.wire.queues import KeyedQueue
from pipeq.wire.security import FrameMac, WireAuth, seals_data
from pipeq.wire.sockets import BindTo, data_inlet, data_outlet

__all__ = ["GroupLink"]


class GroupLink:
    """One member's channel to the other members of its group.

    The member binds one more inbound socket (PULL, where its :class:`BindTo` says; on tcp it
    demands the job's keys like the data channels, and its frames are capped alike) and, once
    told the others' addresses (:meth:`connect`), pushes to each of them on a socket of its own.
    Members are numbered (replica numbers, stage numbers): ``members`` lists the group's, ``me``
    is this one's. A message is::

        [origin, header, tensor frames...]           ipc, or tcp "encrypt" (CURVE)
        [origin, seq + MAC, header, tensor frames...]  tcp "authenticate"

    where ``origin`` is the sender's number (4 bytes, big-endian). In "authenticate" mode it picks
    the :class:`~pipeq.wire.security.FrameMac` of the link ``origin -> me``, whose label
    (``label(sender, receiver)``) names the group and both ends, so a message verifies only on the
    link it was sealed for; a forged, replayed or misdirected one is dropped without a word, like
    on the pipeline's channels.

    Its socket is read by the process's :class:`~pipeq.wire.inbox.Inbox`, like every other:
    arrivals are filed in a :class:`~pipeq.wire.queues.KeyedQueue` under ``(sender, step,
    index)`` (at most ``capacity`` at once); :meth:`wait` blocks for one, and an EXIT from the
    driver interrupts it with :class:`~pipeq.wire.errors.Stopped`: a member whose peer died waits
    until the driver, which watches every process, ends the run. The link shares the process's
    ZeroMQ context (and so its ZAP handler); close it before the transport.
    """

    def __init__(self, inbox: Inbox, bind: BindTo, *, auth: WireAuth | None, max_frame_bytes: int, me: int,
                 members: Sequence[int], kind: Kind, capacity: int, label: Callable[[int, int], str], who: str,
                 peer: str, socket_name: str) -> None:
        """``inbox``: the process's receiving loop (its context too); ``kind``: the messages'
        kind; ``who``: this member in errors ("stage 1, replica 0"); ``peer``: what a member is
        called ("replica"); ``socket_name``: the ipc file's name."""
        if me not in members:
            raise ValueError(f"{who}: {peer} {me} is not a member of its group {list(members)}")
        tcp = bind.scheme == "tcp"
        if tcp and auth is None:
            raise ValueError(f"{who}: a link bound on tcp needs the job's secret (WireAuth)")
        self.inbox, self.auth, self.max_frame_bytes = inbox, auth, max_frame_bytes
        self.me, self.members, self.kind = me, list(members), kind
        self.who, self.peer = who, peer
        self.sock = data_inlet(inbox.ctx, auth, tcp, max_frame_bytes)
        self.address = bind.bind(self.sock, socket_name)
        others = self.others() if seals_data(auth, tcp) else []
        self._mac_in = {m: FrameMac(auth, label(m, me)) for m in others}  # type: ignore[arg-type]
        self._mac_out = {m: FrameMac(auth, label(me, m)) for m in others}  # type: ignore[arg-type]
        self._label = label
        self._origin = struct.pack(">I", me)
        self._out: dict[int, zmq.Socket] = {}
        #: what has arrived, by (sender, step, index), until :meth:`wait` takes it
        self.queue: KeyedQueue[Sequence[torch.Tensor]] = KeyedQueue(
            f"{who}: the other {peer}s'", capacity, describe=lambda k: f"({k[1]}, {k[2]}) from {peer} {k[0]}")
        self._bad_origin = 0
        inbox.watch_socket(self.sock, self._take)

    @property
    def capacity(self) -> int:
        return self.queue.capacity

    @capacity.setter
    def capacity(self, n: int) -> None:
        self.queue.capacity = n

    def others(self) -> list[int]:
        """The group's other members."""
        return [m for m in self.members if m != self.me]

    def connect(self, addresses: Sequence[str | None]) -> None:
        """Connect to every other member; ``addresses[m]`` is member m's bound address."""
        bad = [m for m in self.others() if m >= len(addresses) or type(addresses[m]) is not str]
        if bad:
            raise ValueError(f"{self.who}: no address for {self.peer}(s) {bad} among {addresses!r}")
        for m in self.others():
            if m not in self._out:
                self._out[m] = data_outlet(self.inbox.ctx, self.auth, addresses[m])  # type: ignore[arg-type]

    @property
    def dropped(self) -> int:
        """Inbound messages dropped as forged, replayed or misdirected ("authenticate" mode)."""
        return self._bad_origin + sum(m.dropped for m in self._mac_in.values())

    # -- sending -------------------------------------------------------------------------------
    def send(self, step: int, index: int, tensors: Sequence[torch.Tensor], to: Sequence[int] | None = None) -> None:
        """Send ``tensors`` (CPU tensors ZeroMQ may read until it is done with them: never
        modify them after) as ``(step, index)`` to members ``to`` (default: every other one).
        Does not block (short of ZeroMQ's high-water mark, far above what a step sends)."""
        frames = codec.encode(self.kind, step, index, tensors)
        for i, f in enumerate(frames[1:]):
            if f.nbytes > self.max_frame_bytes:
                raise ValueError(
                    f"{self.who}: tensor {i} of message ({step}, {index}) to the other {self.peer}s is "
                    f"{f.nbytes / 2**20:.1f} MiB, over the {self.max_frame_bytes / 2**20:.0f} MiB "
                    "cap of a data frame")
        for m in self.others() if to is None else to:
            sock = self._out.get(m)
            if sock is None:
                raise RuntimeError(f"{self.who}: not connected to {self.peer} {m}")
            mac = self._mac_out.get(m)
            sock.send_multipart([self._origin, *(mac.seal(frames) if mac is not None else frames)], copy=False)

    # -- receiving -----------------------------------------------------------------------------
    def _sender(self, frame: Any) -> int | None:
        head = memoryview(frame).tobytes()
        if len(head) == 4:
            (m,) = struct.unpack(">I", head)
            if m in self.members and m != self.me:
                return m
        return None

    def drain(self) -> None:
        """File every message waiting on the inbound socket now (never waits)."""
        self.inbox.drain(self.sock)

    def _take(self, frames: Sequence[Any]) -> None:
        """A message drained from the inbound socket: its origin and MAC checked, then filed."""
        sender = self._sender(frames[0])
        body: Sequence[Any] | None = frames[1:]
        if self._mac_in:
            if sender is None:
                self._bad_origin += 1
                return
            body = self._mac_in[sender].open(frames[1:])
            if body is None:
                return  # forged, replayed or sealed for another link: dropped
        elif sender is None:  # only the job's processes get this far: a bug, not an attack
            raise ProtocolError(f"{self.who}: a message from the other {self.peer}s names no valid "
                                f"sender ({memoryview(frames[0]).tobytes()!r})")
        self._file(sender, body)  # type: ignore[arg-type]

    def _file(self, sender: int, body: Sequence[Any]) -> None:
        """Decode a message from member ``sender`` and keep its tensors until :meth:`wait` asks."""
        msg = decode_aligned(body)
        if msg.kind is not self.kind:
            raise ProtocolError(f"{self.who}: {msg.kind.name} on the {self.kind.name} channel")
        self.queue.put((sender, msg.step, msg.microbatch), msg.tensors)

    def wait(self, sender: int, step: int, index: int,
             give_up: Callable[[], bool] | None = None) -> Sequence[torch.Tensor]:
        """Block until member ``sender``'s message ``(step, index)`` is here and return its
        tensors (views over the received frames: this member's to keep, and to write to),
        filing the process's other traffic meanwhile (:meth:`pipeq.wire.inbox.Inbox.wait`).
        An EXIT from the driver interrupts the wait (:class:`~pipeq.wire.errors.Stopped`);
        ``give_up()`` turning true ends it with an empty list."""
        key = (sender, step, index)
        got = self.inbox.wait(lambda: self.queue.pop(key), give_up=give_up)
        return [] if got is None else got

    def close(self, linger_ms: int = 0) -> None:
        self.inbox.unwatch(self.sock)
        for s in (self.sock, *self._out.values()):
            s.close(linger=linger_ms)
        self._out.clear()
