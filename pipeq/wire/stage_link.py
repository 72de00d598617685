"""A stage process's transport: its receiving half (:class:`StageInbox`) and the sends to its neighbours.

Stages form a chain; each one's outbound sockets connect to its neighbours' inbound ones::

    stage 0 --forward (PUSH->PULL)--> stage 1 --forward--> ... stage N-1
    stage 0 <--backward (PULL<-PUSH)-- stage 1 <--backward-- ...

A message goes out as the codec's frames (:mod:`pipeq.wire.codec`), its large tensors through
a shared-memory slot (or CUDA IPC) on one host, through a lane when it fits one, and sealed with
a :class:`~pipeq.wire.security.FrameMac` on tcp in "authenticate" mode.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch
import zmq

from pipeq.wire import codec
from pipeq.wire.frames import frames_of
from pipeq.wire.lanes import Lane, lane_path
from pipeq.wire.messages import Kind, Message
from pipeq.wire.security import FrameMac
from pipeq.wire.shm import CudaSlotWriter, SlotWriter
from pipeq.wire.sockets import data_outlet
from pipeq.wire.stage_inbox import StageInbox

__all__ = ["StageTransport"]


class StageTransport(StageInbox):
    """The sockets and queues of one stage process. Not thread-safe: the event loop owns it.

    It is made as its receiving half, :class:`StageInbox`, is (the arguments are described
    there), and sends once :meth:`connect` has named its neighbours.
    """

    # The sending half's sockets, lanes and slot writers: none until :meth:`connect` names the neighbours.
    fwd_out: zmq.Socket | None = None
    bwd_out: zmq.Socket | None = None
    _lane_fwd: Lane | None = None
    _lane_bwd: Lane | None = None
    _slots_fwd: SlotWriter | None = None
    _slots_bwd: SlotWriter | None = None
    _dev_fwd: CudaSlotWriter | None = None
    _dev_bwd: CudaSlotWriter | None = None

    # -- wiring --------------------------------------------------------------------------------
    def connect(self, next_forward: str | None, prev_backward: str | None) -> None:
        if next_forward:
            self.fwd_out, self._lane_fwd, self._slots_fwd, self._dev_fwd = self._open_out(next_forward, "F")
        if prev_backward:
            self.bwd_out, self._lane_bwd, self._slots_bwd, self._dev_bwd = self._open_out(prev_backward, "B")

    def _open_out(self, address: str, direction: str) -> tuple[zmq.Socket, Lane | None, SlotWriter | None,
                                                                CudaSlotWriter | None]:
        """The socket, lane and slot writers of this stage's output in ``direction`` ("F" or
        "B") to the neighbour bound at ``address``."""
        sock = data_outlet(self.ctx, self.auth, address)
        lane = self._connect_lane(address)
        slots = dev = None
        if self.shm is not None:
            channel = f"{direction}{self.process}"
            slots = SlotWriter(self.shm, channel, self._idle)
            if self.device_payloads:
                dev = CudaSlotWriter(self.shm, channel, self.device, self._idle)
        return sock, lane, slots, dev

    def _connect_lane(self, address: str) -> Lane | None:
        path = lane_path(address) if self.shm is not None else None
        if path is None:
            return None
        try:
            return Lane(path)
        except OSError:  # the neighbour has no lane (shared memory off there): ZeroMQ only
            return None

    def _idle(self) -> None:
        """Every shared-memory slot of a channel is busy: file what has arrived meanwhile (its
        slots are freed, so two stages sending to each other never wait on each other) and give
        up on the driver's EXIT. Does not block: the caller comes back at once to look again."""
        self.pump(0)
        self.check_exit()
        os.sched_yield()

    @property
    def shm_waits(self) -> int:
        """How often a send found every shared-memory slot of its channel busy."""
        return sum(w.waits for w in (self._slots_fwd, self._slots_bwd, self._dev_fwd, self._dev_bwd) if w is not None)

    def _data_frames(self, kind: Kind, step: int, mb: int, tensors: Sequence[torch.Tensor],
                     mac: FrameMac | None, extra: dict[str, Any] | None = None,
                     slots: SlotWriter | None = None, dev: CudaSlotWriter | None = None) -> list[Any]:
        place = None
        if slots is not None:
            low = slots.cfg.min_bytes
            big = [n for n in (t.numel() * t.element_size() for t in tensors if not t.is_cuda) if n >= low]
            if big and slots.fits(big):
                place = slots.put
        frames = codec.encode(kind, step, mb, tensors, extra, place, slots.cfg.min_bytes if place else 0,
                              dev.put if dev is not None else None)
        for f in frames[1:]:
            if f.nbytes > self.max_frame_bytes:
                t = next(t for t in tensors if t.numel() * t.element_size() == f.nbytes)
                raise ValueError(
                    f"stage process {self.process}: the {kind.name.lower()} of step {step} microbatch {mb} "
                    f"holds a tensor of {f.nbytes / 2**20:.1f} MiB (shape {list(t.shape)}, {t.dtype}), over "
                    f"the {self.max_frame_bytes / 2**20:.0f} MiB cap of a data frame; raise max_message_mb "
                    "(PipelineRunner / the job file) or use smaller microbatches")
        return mac.seal(frames) if mac is not None else frames

    # -- sending -------------------------------------------------------------------------------
    # Sends block only past the high-water mark, which the bounded queues keep far away; a stage
    # stuck in one because its peer died is ended by the driver, which watches every process.
    def send_activation(self, step: int, mb: int, tensors: Sequence[torch.Tensor], tree: Any = None) -> None:
        """``tree``: the description of a stage output that is not a tuple of tensors
        (:mod:`pipeq.stage.microbatch`), sent in the header."""
        assert self.fwd_out is not None, "stage has no next stage"
        extra = {"tree": tree} if tree is not None else None
        self._send(self.fwd_out, self._lane_fwd, self._data_frames(Kind.ACTIVATION, step, mb, tensors, self._mac_fwd,
                                                                   extra, self._slots_fwd, self._dev_fwd))

    def send_gradient(self, step: int, mb: int, tensors: Sequence[torch.Tensor]) -> None:
        assert self.bwd_out is not None, "stage has no previous stage"
        self._send(self.bwd_out, self._lane_bwd, self._data_frames(Kind.GRADIENT, step, mb, tensors, self._mac_bwd,
                                                                   None, self._slots_bwd, self._dev_bwd))

    def _send(self, sock: zmq.Socket, lane: Lane | None, frames: list[Any]) -> None:
        """Through the lane when there is one and the message fits a datagram, else ZeroMQ. A
        full lane is waited out filing this stage's own arrivals (see :meth:`_idle`)."""
        parts = lane.datagram(frames) if lane is not None else None
        if parts is not None:
            while not lane.send(parts):  # type: ignore[union-attr]
                self._idle()
            return
        sock.send_multipart(frames, copy=False)

    def send_control(self, msg: Message) -> None:
        """Send ``msg`` to the driver (replies, errors)."""
        self.ctrl.send_multipart(frames_of(msg), copy=False)

    def close(self, linger_ms: int = 0) -> None:
        for s in (self.fwd_out, self.bwd_out):
            if s is not None:
                s.close(linger=linger_ms)
        for w in (self._slots_fwd, self._slots_bwd, self._dev_fwd, self._dev_bwd, self._lane_fwd, self._lane_bwd):
            if w is not None:
                w.close()
        super().close(linger_ms)
