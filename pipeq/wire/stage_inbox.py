"""One stage's receiving channels: its control socket, inbound data sockets and lanes, keyed queues.

Every stage binds its two inbound data sockets (PULL) where its :class:`~pipeq.wire.sockets.BindTo`
says and files what arrives on them (and on the lanes beside them, :mod:`pipeq.wire.lanes`) in a
:class:`~pipeq.wire.queues.KeyedQueue` per direction; commands from the driver arrive on its
control socket (DEALER) and wait in :attr:`StageInbox.control_queue`. Its sockets and lanes are
read by the process's :class:`~pipeq.wire.inbox.Inbox` (one per process, however many stages it
holds), which every wait of the process goes through. The sending half is
:class:`~pipeq.wire.stage_link.StageSender`.

``process`` is the stage's number on the control channel (``r * n_stages + k`` for replica r's
stage k): it names the stage's sockets, its shared-memory channels and its MAC labels.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import zmq

from pipeq.wire.control_link import STAGE, identity
from pipeq.wire.errors import ProtocolError
from pipeq.wire.frames import decode_aligned
from pipeq.wire.inbox import Inbox
from pipeq.wire.lanes import LaneInbox, lane_path
from pipeq.wire.messages import Kind, Message
from pipeq.wire.queues import KeyedQueue
from pipeq.wire.security import FrameMac, WireAuth, seals_data, secure_client
from pipeq.wire.cuda_slots import CudaSlotReader
from pipeq.wire.shm import ShmConfig, SlotReader
from pipeq.wire.sockets import BindTo, data_inlet, tune_socket

__all__ = ["StageInbox"]


class StageInbox:
    """What one stage receives, filed where its event loop looks (see the module). Not thread-safe.

    ``spin_s``: how long a wait for data busy-polls first; ``max_frame_bytes``: inbound data frames
    above this are refused before they are buffered (both the run's, :class:`pipeq.WireConfig`).

    ``shm``: large tensors from this stage's neighbours travel through shared memory
    (:mod:`pipeq.wire.shm`; ipc only: every neighbour is on this host); with a CUDA ``device``
    as well, device tensors travel through CUDA IPC (:attr:`device_payloads`)."""

    def __init__(
        self, inbox: Inbox, process: int, control_addr: str, *, bind: BindTo, queue_capacity: int,
        spin_s: float, max_frame_bytes: int, auth: WireAuth | None = None, shm: ShmConfig | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.inbox = inbox
        self.process = process
        self.auth = auth
        self.max_frame_bytes = max_frame_bytes
        self.spin_s = spin_s
        self.tcp = tcp = bind.scheme == "tcp"
        if shm is not None and tcp:
            raise ValueError("shared-memory payloads are for one host (ipc); a tcp stage sends frames")
        ctx = inbox.ctx
        self.ctrl = ctx.socket(zmq.DEALER)
        self.ctrl.setsockopt(zmq.IDENTITY, identity(STAGE, process))
        tune_socket(self.ctrl)
        secure_client(self.ctrl, auth, control_addr)
        self.ctrl.connect(control_addr)
        self.fwd_in = data_inlet(ctx, auth, tcp, max_frame_bytes)
        self.bwd_in = data_inlet(ctx, auth, tcp, max_frame_bytes)
        self.addresses = {
            "forward": bind.bind(self.fwd_in, f"s{process}-fwd"),
            "backward": bind.bind(self.bwd_in, f"s{process}-bwd"),
        }
        # "authenticate" mode: inbound data is MAC-checked per message (a channel's sequence
        # numbers run for the stage's whole life)
        self._mac_in = {self.fwd_in: FrameMac(auth, f"F{process - 1}"),  # type: ignore[arg-type]
                        self.bwd_in: FrameMac(auth, f"B{process + 1}")} if seals_data(auth, tcp) else {}
        self.shm = shm
        #: CUDA tensors cross to the neighbours as they are (CUDA IPC), not through host memory
        self.device_payloads = shm is not None and device is not None and device.type == "cuda"
        self.device = device
        self._open_readers()
        self.forward_queue: KeyedQueue[Message] = KeyedQueue(f"stage process {process} forward", queue_capacity)
        self.backward_queue: KeyedQueue[Message] = KeyedQueue(f"stage process {process} backward", queue_capacity)
        self.control_queue = inbox.commands()
        for s in (self.ctrl, self.fwd_in, self.bwd_in):
            inbox.watch_socket(s, lambda frames, s=s: self._take(s, frames))
        self._open_lanes()

    def _open_readers(self) -> None:
        """The shared-memory (and CUDA) slot readers of both inbound channels (shm on only)."""
        shm, device, process = self.shm, self.device, self.process
        where = f"stage process {process}"
        # a message on fwd_in comes from process - 1's forward output, on bwd_in from process + 1's backward
        self._readers = {self.fwd_in: SlotReader(shm, f"F{process - 1}", where),
                         self.bwd_in: SlotReader(shm, f"B{process + 1}", where)} if shm is not None else {}
        self._dev_readers = {self.fwd_in: CudaSlotReader(shm, f"F{process - 1}", device, where),
                             self.bwd_in: CudaSlotReader(shm, f"B{process + 1}", device, where)
                             } if self.device_payloads and shm is not None and device is not None else {}

    def _open_lanes(self) -> None:
        """One host, shared memory on: the data hops take lanes (:mod:`pipeq.wire.lanes`), ZeroMQ
        stays for whatever does not fit a lane's datagram."""
        self._lanes: dict[zmq.Socket, LaneInbox] = {}
        if self.shm is not None:
            for sock, key in ((self.fwd_in, "forward"), (self.bwd_in, "backward")):
                path = lane_path(self.addresses[key])
                if path is not None:
                    self._lanes[sock] = LaneInbox(path, f"stage process {self.process} {key} lane")
        self._lane_fds: dict[int, zmq.Socket] = {}  # a lane's fd -> the ZeroMQ socket it stands beside
        self._watch_lanes()

    def _watch_lanes(self) -> None:
        """(Re)register every lane socket with the process's poller (after a connection came or went)."""
        for fd in self._lane_fds:
            self.inbox.unwatch(fd)
        self._lane_fds = {fd: sock for sock, box in self._lanes.items() for fd in box.fds()}
        for fd in self._lane_fds:
            self.inbox.watch(fd, self._lane_ready)
        for box in self._lanes.values():
            box.changed = False

    @property
    def dropped(self) -> int:
        """Inbound data messages dropped as forged or replayed ("authenticate" mode)."""
        return sum(m.dropped for m in self._mac_in.values())

    # -- filing ----------------------------------------------------------------------------------
    def _take(self, sock: zmq.Socket, frames: Sequence[Any]) -> None:
        """A message drained from ``sock``: checked (a MAC, in "authenticate" mode), then filed."""
        mac = self._mac_in.get(sock)
        if mac is not None:
            frames = mac.open(frames)  # type: ignore[assignment]
            if frames is None:
                return  # forged, replayed or garbage: dropped (counted in ``dropped``)
        self._file(sock, frames)

    def _file(self, sock: zmq.Socket, frames: Sequence[Any]) -> None:
        """Decode a message that arrived on ``sock`` (or its lane) and queue it."""
        reader, dev = self._readers.get(sock), self._dev_readers.get(sock)
        msg = decode_aligned(frames, reader.take if reader is not None else None,
                             dev.take if dev is not None else None)
        if sock is self.ctrl:
            self.control_queue.append(msg)
            return
        queue, kind, name = ((self.forward_queue, Kind.ACTIVATION, "forward") if sock is self.fwd_in
                             else (self.backward_queue, Kind.GRADIENT, "backward"))
        if msg.kind is not kind:
            raise ProtocolError(f"stage process {self.process}: {msg.kind.name} on the {name} channel")
        queue.put((msg.step, msg.microbatch), msg)

    def _lane_ready(self, fd: int) -> None:
        sock = self._lane_fds[fd]
        self._drain_lane(sock, accept=fd == self._lanes[sock].listener_fd)

    def _drain_lane(self, sock: zmq.Socket, accept: bool = False) -> bool:
        """File every message waiting on the lane beside ``sock``; True if any came. New
        connections are taken when ``accept`` (the poller saw one) or while there is none."""
        box = self._lanes[sock]
        if accept or not box.conns:
            box.accept()
        got = False
        for conn in list(box.conns):
            while True:
                frames = box.receive(conn)
                if frames is None:
                    break
                got = True
                self._file(sock, frames)
        if box.changed:
            self._watch_lanes()
        return got

    # -- waiting ---------------------------------------------------------------------------------
    def wait_data(self, queue: KeyedQueue[Message], step: int, mb: int) -> Message:
        """Block until message ``(step, mb)`` is in ``queue`` (:attr:`forward_queue` or
        :attr:`backward_queue`); an EXIT from the driver interrupts (see :meth:`Inbox.wait`)."""
        key = (step, mb)
        msg = queue.pop(key)
        if msg is not None:  # (already filed: most waits, once a pipeline runs)
            return msg
        sock = self.fwd_in if queue is self.forward_queue else self.bwd_in
        lane = sock in self._lanes
        if lane and self._drain_lane(sock):  # sent already, not filed yet: one look at its lane
            msg = queue.pop(key)
            if msg is not None:
                return msg
        probe = None
        if self.spin_s > 0:  # a lane is read with one non-blocking syscall; ZeroMQ (what does
            spins = [0]      # not fit a lane) is looked at every 16th turn

            def probe() -> bool:
                spins[0] += 1
                if (lane and self._drain_lane(sock)) or ((not lane or spins[0] & 15 == 1) and sock.poll(0)):
                    self.inbox.drain(sock)
                    return True
                return False

        return self.inbox.wait(lambda: queue.pop(key), spin_s=self.spin_s, probe=probe)  # type: ignore[return-value]

    def poll_control(self) -> bool:
        """File the commands waiting on the control socket now (no wait); True if any is queued."""
        self.inbox.drain(self.ctrl)
        return bool(self.control_queue)

    def close(self, linger_ms: int = 0) -> None:
        for s in (self.ctrl, self.fwd_in, self.bwd_in):
            self.inbox.unwatch(s)
            s.close(linger=linger_ms)
        for fd in self._lane_fds:
            self.inbox.unwatch(fd)
        for box in self._lanes.values():
            box.close()
        for reader in (*self._readers.values(), *self._dev_readers.values()):
            reader.close()
