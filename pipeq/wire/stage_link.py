"""One stage's sending half: its sends to its neighbours and its replies to the driver.

Stages form a chain; each one's outbound sockets connect to its neighbours' inbound ones::

    stage 0 --forward (PUSH->PULL)--> stage 1 --forward--> ... stage N-1
    stage 0 <--backward (PULL<-PUSH)-- stage 1 <--backward-- ...

A message goes out as the codec's frames (:mod:`pipeq.wire.codec`), its large tensors through
a shared-memory slot (or CUDA IPC) on one host, through a lane when it fits one, and sealed with
a :class:`~pipeq.wire.security.FrameMac` on tcp in "authenticate" mode. :class:`StageSender`
works beside the stage's receiving half (:class:`~pipeq.wire.stage_inbox.StageInbox`): it
replies on that half's control socket, and while a slot or lane is full it files the process's
arrivals (:meth:`pipeq.wire.inbox.Inbox.pump`), so two stages sending to each other never wait
on each other.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch
import zmq

from pipeq.wire import codec
from pipeq.wire.frames import frames_of
from pipeq.wire.lanes import Lane, lane_path
from pipeq.wire.messages import Kind, Message
from pipeq.wire.security import FrameMac, seals_data
from pipeq.wire.cuda_slots import CudaSlotWriter
from pipeq.wire.shm import SlotWriter
from pipeq.wire.sockets import data_outlet
from pipeq.wire.stage_inbox import StageInbox

__all__ = ["StageSender", "Outlet"]


class _Gone(Exception):
    """(A send to a dead previous stage, given up: see StageSender.backward_gone.)"""


class Outlet:
    """One outbound data channel: its socket, lane, shared-memory slot writers and MAC, and what
    a send does while it waits for room (``idle``)."""

    def __init__(self, sock: zmq.Socket, lane: Lane | None, slots: SlotWriter | None, dev: CudaSlotWriter | None,
                 mac: FrameMac | None, idle: Callable[[], None]) -> None:
        self.sock, self.lane, self.slots, self.dev, self.mac, self.idle = sock, lane, slots, dev, mac, idle

    def close(self, linger_ms: int) -> None:
        self.sock.close(linger=linger_ms)
        for w in (self.slots, self.dev, self.lane):
            if w is not None:
                w.close()


class StageSender:
    """What one stage sends (see the module); sends once :meth:`connect` has named its neighbours.
    Not thread-safe: the event loop owns it."""

    def __init__(self, receiver: StageInbox) -> None:
        self.receiver = receiver
        self.process = receiver.process
        self.max_frame_bytes = receiver.max_frame_bytes
        self._seals = seals_data(receiver.auth, receiver.tcp)
        #: the previous stage's process is dead and this one only finishes its gradient round (a lost
        #: replica's stage, :mod:`pipeq.parallel.membership`): what it would send there is dropped
        self.backward_gone = False
        self.forward: Outlet | None = None
        self.backward: Outlet | None = None

    # -- wiring --------------------------------------------------------------------------------
    def connect(self, next_forward: str | None, prev_backward: str | None) -> None:
        if next_forward:
            self.forward = self._open(next_forward, "F")
        if prev_backward:
            self.backward = self._open(prev_backward, "B")

    def _open(self, address: str, direction: str) -> Outlet:
        """The outlet of this stage's output in ``direction`` ("F" or "B") to the neighbour bound
        at ``address``."""
        rx = self.receiver
        channel = f"{direction}{self.process}"
        sock = data_outlet(rx.inbox.ctx, rx.auth, address)
        slots = dev = None
        idle = self._idle_back if direction == "B" else self._idle
        if rx.shm is not None:
            slots = SlotWriter(rx.shm, channel, idle)
            if rx.device_payloads:
                dev = CudaSlotWriter(rx.shm, channel, rx.device, idle)
        mac = FrameMac(rx.auth, channel) if self._seals else None  # type: ignore[arg-type]
        return Outlet(sock, self._connect_lane(address), slots, dev, mac, idle)

    def _connect_lane(self, address: str) -> Lane | None:
        path = lane_path(address) if self.receiver.shm is not None else None
        if path is None:
            return None
        try:
            return Lane(path)
        except OSError:  # the neighbour has no lane (shared memory off there): ZeroMQ only
            return None

    def _idle(self) -> None:
        """Every shared-memory slot of a channel (or a lane) is busy: file what has arrived
        meanwhile (its slots are freed, so two stages sending to each other never wait on each
        other) and give up on the driver's EXIT. Does not block: the caller looks again at once."""
        inbox = self.receiver.inbox
        inbox.pump(0)
        inbox.check_exit()
        os.sched_yield()

    def _idle_back(self) -> None:
        """:meth:`_idle` of a send to the previous stage, which gives the send up (``_Gone``)
        once that stage is known dead: nobody will ever make room."""
        if self.backward_gone:
            raise _Gone()
        self._idle()

    @property
    def shm_waits(self) -> int:
        """How often a send found every shared-memory slot of its channel busy."""
        return sum(w.waits for o in (self.forward, self.backward) if o is not None
                   for w in (o.slots, o.dev) if w is not None)

    def data_frames(self, kind: Kind, step: int, mb: int, tensors: Sequence[torch.Tensor], out: Outlet,
                    extra: dict[str, Any] | None = None) -> list[Any]:
        """The frames of a data message through ``out`` (its large tensors placed in its slots)."""
        place = None
        slots = out.slots
        if slots is not None:
            low = slots.cfg.min_bytes
            big = [n for n in (t.numel() * t.element_size() for t in tensors if not t.is_cuda) if n >= low]
            if big and slots.fits(big):
                place = slots.put
        frames = codec.encode(kind, step, mb, tensors, extra, place, slots.cfg.min_bytes if place else 0,  # type: ignore[union-attr]
                              out.dev.put if out.dev is not None else None)
        for f in frames[1:]:
            if f.nbytes > self.max_frame_bytes:
                t = next(t for t in tensors if t.numel() * t.element_size() == f.nbytes)
                raise ValueError(
                    f"stage process {self.process}: the {kind.name.lower()} of step {step} microbatch {mb} "
                    f"holds a tensor of {f.nbytes / 2**20:.1f} MiB (shape {list(t.shape)}, {t.dtype}), over "
                    f"the {self.max_frame_bytes / 2**20:.0f} MiB cap of a data frame; raise max_message_mb "
                    "(PipelineRunner / the job file) or use smaller microbatches")
        return out.mac.seal(frames) if out.mac is not None else frames

    # -- sending -------------------------------------------------------------------------------
    # Sends block only past the high-water mark, which the bounded queues keep far away; a stage
    # stuck in one because its peer died is ended by the driver, which watches every process.
    def send_activation(self, step: int, mb: int, tensors: Sequence[torch.Tensor], tree: Any = None) -> None:
        """``tree``: the description of a stage output that is not a tuple of tensors
        (:mod:`pipeq.stage.microbatch`), sent in the header."""
        assert self.forward is not None, "stage has no next stage"
        extra = {"tree": tree} if tree is not None else None
        self._send(self.forward, self.data_frames(Kind.ACTIVATION, step, mb, tensors, self.forward, extra))

    def send_gradient(self, step: int, mb: int, tensors: Sequence[torch.Tensor]) -> None:
        assert self.backward is not None, "stage has no previous stage"
        if self.backward_gone:
            return
        try:
            self._send(self.backward, self.data_frames(Kind.GRADIENT, step, mb, tensors, self.backward))
        except _Gone:
            pass

    def _send(self, out: Outlet, frames: list[Any]) -> None:
        """Through the lane when there is one and the message fits a datagram, else ZeroMQ. A
        full lane is waited out filing this process's own arrivals (see :meth:`_idle`)."""
        lane = out.lane
        parts = lane.datagram(frames) if lane is not None else None
        if parts is not None:
            while not lane.send(parts):  # type: ignore[union-attr]
                out.idle()
            return
        out.sock.send_multipart(frames, copy=False)

    def send_control(self, msg: Message) -> None:
        """Send ``msg`` to the driver (replies, errors), on the stage's control socket."""
        self.receiver.ctrl.send_multipart(frames_of(msg), copy=False)

    def close(self, linger_ms: int = 0) -> None:
        for out in (self.forward, self.backward):
            if out is not None:
                out.close(linger_ms)
