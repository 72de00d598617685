"""A stage process's receiving half: its control socket, inbound data sockets and lanes, keyed queues.

Every stage binds its two inbound data sockets (PULL) where its :class:`~pipeq.wire.sockets.BindTo`
says, and files what arrives on them (and on the lanes beside them, :mod:`pipeq.wire.lanes`) in
a :class:`~pipeq.wire.queues.KeyedQueue` per direction; commands from the driver arrive on its
control socket (DEALER) and wait in :attr:`StageInbox.control_queue`. The sending half is
:class:`~pipeq.wire.stage_link.StageTransport`, built on this one.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any, Sequence

import torch
import zmq

from pipeq.wire.control_link import STAGE, identity
from pipeq.wire.errors import ProtocolError, Stopped
from pipeq.wire.frames import decode_aligned
from pipeq.wire.lanes import LaneInbox, lane_path
from pipeq.wire.messages import Kind, Message
from pipeq.wire.queues import KeyedQueue
from pipeq.wire.security import FrameMac, Gatekeeper, WireAuth, seals_data, secure_client
from pipeq.wire.shm import CudaSlotReader, ShmConfig, SlotReader
from pipeq.wire.sockets import BindTo, data_inlet, tune_socket

__all__ = ["StageInbox", "DEFAULT_MAX_FRAME", "SLICE_MS"]

DEFAULT_MAX_FRAME = 256 << 20
SLICE_MS = 200  # how often a blocked wait looks for an EXIT from the driver
_COMMAND_SPIN_S = 0.001  # the longest busy-poll for the next command (see next_control)


class StageInbox:
    """What a stage process receives, filed where its event loop looks. Not thread-safe.

    ``process`` is the stage process's number on the control channel (``r * n_stages + k`` for
    replica r's stage k).
    """

    def __init__(
        self, process: int, control_addr: str, *, bind: BindTo, queue_capacity: int, spin_s: float = 0.0,
        auth: WireAuth | None = None, max_frame_bytes: int = DEFAULT_MAX_FRAME, shm: ShmConfig | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``shm``: large tensors to and from this stage's neighbours travel through shared
        memory (:mod:`pipeq.wire.shm`; ipc only: every neighbour is on this host); with a CUDA
        ``device`` as well, device tensors travel through CUDA IPC (:attr:`device_payloads`)."""
        self.process = process
        self.auth = auth
        self.max_frame_bytes = max_frame_bytes
        self.ctx = zmq.Context(io_threads=1)
        tcp = bind.scheme == "tcp"
        self._gate = Gatekeeper.on_tcp(self.ctx, auth, tcp, "a stage bound")
        self.ctrl = self.ctx.socket(zmq.DEALER)
        self.ctrl.setsockopt(zmq.IDENTITY, identity(STAGE, process))
        tune_socket(self.ctrl)
        secure_client(self.ctrl, auth, control_addr)
        self.ctrl.connect(control_addr)
        self.fwd_in = data_inlet(self.ctx, auth, tcp, max_frame_bytes)
        self.bwd_in = data_inlet(self.ctx, auth, tcp, max_frame_bytes)
        self.addresses = {
            "forward": bind.bind(self.fwd_in, f"s{process}-fwd"),
            "backward": bind.bind(self.bwd_in, f"s{process}-bwd"),
        }
        # "authenticate" mode: inbound data is MAC-checked per message, outbound (the sending
        # half's) is sealed; a channel's sequence numbers run for the stage's whole life
        macs = seals_data(auth, tcp)
        self._mac_in = {self.fwd_in: FrameMac(auth, f"F{process - 1}"),  # type: ignore[arg-type]
                        self.bwd_in: FrameMac(auth, f"B{process + 1}")} if macs else {}  # type: ignore[arg-type]
        self._mac_fwd = FrameMac(auth, f"F{process}") if macs else None  # type: ignore[arg-type]
        self._mac_bwd = FrameMac(auth, f"B{process}") if macs else None  # type: ignore[arg-type]
        if shm is not None and tcp:
            raise ValueError("shared-memory payloads are for one host (ipc); a tcp stage sends frames")
        self.shm = shm
        #: CUDA tensors cross to the neighbours as they are (CUDA IPC), not through host memory
        self.device_payloads = shm is not None and device is not None and device.type == "cuda"
        self.device = device
        self._open_readers()
        self.forward_queue = KeyedQueue(f"stage process {process} forward", queue_capacity)
        self.backward_queue = KeyedQueue(f"stage process {process} backward", queue_capacity)
        self.control_queue: collections.deque[Message] = collections.deque()
        self.poller = zmq.Poller()
        for s in (self.ctrl, self.fwd_in, self.bwd_in):
            self.poller.register(s, zmq.POLLIN)
        self.spin_s = spin_s
        self.group: Any = None  # the InboxGroup of a process holding several stages
        self._open_inboxes()

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

    def _open_inboxes(self) -> None:
        """One host, shared memory on: the data hops take lanes (:mod:`pipeq.wire.lanes`), ZeroMQ
        stays for whatever does not fit a lane's datagram."""
        self._inboxes: dict[zmq.Socket, LaneInbox] = {}
        if self.shm is not None:
            for sock, key in ((self.fwd_in, "forward"), (self.bwd_in, "backward")):
                path = lane_path(self.addresses[key])
                if path is not None:
                    self._inboxes[sock] = LaneInbox(path, f"stage process {self.process} {key} lane")
        self._lane_fds: dict[int, zmq.Socket] = {}  # a lane's fd -> the ZeroMQ socket it stands beside
        self._register_lanes()

    def _register_lanes(self) -> None:
        """(Re)register every lane socket with the poller (after a connection came or went)."""
        for fd in self._lane_fds:
            self.poller.unregister(fd)
        self._lane_fds = {fd: sock for sock, box in self._inboxes.items() for fd in box.fds()}
        for fd in self._lane_fds:
            self.poller.register(fd, zmq.POLLIN)
        for box in self._inboxes.values():
            box.changed = False

    @property
    def dropped(self) -> int:
        """Inbound data messages dropped as forged or replayed ("authenticate" mode)."""
        return sum(m.dropped for m in self._mac_in.values())

    @property
    def has_lanes(self) -> bool:
        """Whether data also arrives on lanes (which a poller of ZeroMQ sockets alone does not see)."""
        return bool(self._inboxes)

    def _drain(self, sock: zmq.Socket) -> None:
        """File every message waiting on ``sock`` into its queue."""
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            mac = self._mac_in.get(sock)
            if mac is not None:
                frames = mac.open(frames)
                if frames is None:
                    continue  # forged, replayed or garbage: dropped (counted in ``dropped``)
            self._file(sock, frames)

    def _file(self, sock: zmq.Socket, frames: Sequence[Any]) -> None:
        """Decode a message that arrived on ``sock`` (or its lane) and queue it."""
        reader, dev = self._readers.get(sock), self._dev_readers.get(sock)
        msg = decode_aligned(frames, reader.take if reader is not None else None,
                             dev.take if dev is not None else None)
        if sock is self.ctrl:
            self.control_queue.append(msg)
        elif sock is self.fwd_in:
            if msg.kind is not Kind.ACTIVATION:
                raise ProtocolError(f"stage process {self.process}: {msg.kind.name} on the forward channel")
            self.forward_queue.put(msg)
        else:
            if msg.kind is not Kind.GRADIENT:
                raise ProtocolError(f"stage process {self.process}: {msg.kind.name} on the backward channel")
            self.backward_queue.put(msg)

    def _drain_lane(self, sock: zmq.Socket, accept: bool = False) -> bool:
        """File every message waiting on the lane beside ``sock``; True if any came. New
        connections are taken when ``accept`` (the poller saw one) or while there is none."""
        box = self._inboxes[sock]
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
            self._register_lanes()
        return got

    def pump(self, timeout_ms: int) -> bool:
        """Wait up to ``timeout_ms`` for traffic and file it; True if anything arrived. In a
        process of several stages, every stage's traffic (:class:`~pipeq.wire.inbox_group.InboxGroup`)."""
        if self.group is not None:
            return self.group.pump(timeout_ms)
        events = self.poller.poll(timeout_ms)
        for sock, _ in events:
            if type(sock) is int:  # a lane's connection, or its listener (a connection to take)
                lane = self._lane_fds[sock]
                self._drain_lane(lane, accept=sock == self._inboxes[lane].listener_fd)
            else:
                self._drain(sock)
        return bool(events)

    def file_ready(self, events: dict[Any, int]) -> None:
        """File what waits on this stage's sockets among ``events`` (another poller's), and on
        every lane: commands and data queue up for the event loop while someone else waits."""
        for s in (self.ctrl, self.fwd_in, self.bwd_in):
            if s in events:
                self._drain(s)
        for s in self._inboxes:
            self._drain_lane(s)

    def check_exit(self) -> None:
        """Raise :class:`Stopped` if the driver's EXIT is among the queued commands."""
        for msg in self.control_queue:
            if msg.kind is Kind.EXIT:
                raise Stopped()

    def wait_data(self, queue: KeyedQueue, step: int, mb: int) -> Message:
        """Block until message ``(step, mb)`` is in ``queue``; an EXIT from the driver interrupts."""
        msg = queue.pop(step, mb)
        if msg is not None:
            return msg
        sock = self.fwd_in if queue is self.forward_queue else self.bwd_in
        if self.spin_s > 0:  # busy-poll briefly: saves a wake-up on the latency-bound path
            lane = sock in self._inboxes
            end = time.perf_counter() + self.spin_s
            spins = 0
            while time.perf_counter() < end:
                # a lane is read with one non-blocking syscall; ZeroMQ (what does not fit a
                # lane) is looked at every 16th turn
                if (lane and self._drain_lane(sock)) or ((not lane or spins & 15 == 0) and sock.poll(0)):
                    self._drain(sock)
                    msg = queue.pop(step, mb)
                    if msg is not None:
                        return msg
                spins += 1
                os.sched_yield()  # let other stages (and ZeroMQ's I/O thread) have the core
        while True:
            self.pump(SLICE_MS)
            msg = queue.pop(step, mb)
            if msg is not None:
                return msg
            self.check_exit()

    def next_control(self, timeout_ms: int) -> Message | None:
        """The next control message, waiting up to ``timeout_ms``; None on time-out. Like data,
        a command is busy-polled first, for at most 1 ms (``spin_s`` if shorter): the next
        step's TRAIN follows the last one's LOSS within a driver's round trip when the caller
        loops, and an idle stage must not keep a core busy."""
        if not self.control_queue and self.spin_s > 0:
            end = time.perf_counter() + min(self.spin_s, _COMMAND_SPIN_S, timeout_ms / 1000)
            while not self.control_queue and time.perf_counter() < end:
                self._drain(self.ctrl)
                if not self.control_queue:
                    os.sched_yield()
        if not self.control_queue:
            self.pump(timeout_ms)
        return self.control_queue.popleft() if self.control_queue else None

    def close(self, linger_ms: int = 0) -> None:
        for s in (self.ctrl, self.fwd_in, self.bwd_in):
            s.close(linger=linger_ms)
        for box in self._inboxes.values():
            box.close()
        for reader in (*self._readers.values(), *self._dev_readers.values()):
            reader.close()
        if self._gate is not None:
            self._gate.stop()
        self.ctx.term()
