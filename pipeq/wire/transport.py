"""A stage process's transport: the one receiving loop, and each stage's channels, by chunk.

A stage process holds ``v >= 1`` stages, its *chunks* (one, unless the schedule places several
per process: :mod:`pipeq.schedules.placement`). To the driver and the neighbours each is what a
stage always is: its own control channel, inbound sockets and lanes, and sends of its own. Here
they are one object, addressed by chunk: chunk ``c``'s receiving half
(:class:`~pipeq.wire.stage_inbox.StageInbox`) and sending half
(:class:`~pipeq.wire.stage_link.StageSender`), all read by the process's one
:class:`~pipeq.wire.inbox.Inbox`. The event loop (:mod:`pipeq.runtime.loop`) talks to nothing
else; with tensor parallelism, a shard's view of it (:mod:`pipeq.wire.shard_link`) has the same
methods.
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from pipeq.wire.inbox import Inbox
from pipeq.wire.messages import Message
from pipeq.wire.security import WireAuth
from pipeq.wire.shm import ShmConfig
from pipeq.wire.sockets import BindTo
from pipeq.wire.stage_inbox import StageInbox
from pipeq.wire.stage_link import StageSender

__all__ = ["Transport", "ProcessTransport"]

_COMMAND_SPIN_S = 0.001  # the longest busy-poll for the next command (see next_command)


@runtime_checkable
class Transport(Protocol):
    """What a stage process's event loop (:mod:`pipeq.runtime.loop`) talks through, chunk by chunk:
    commands and replies on the control channel, activations and gradients from and to the
    neighbours. :class:`ProcessTransport` is the process's own; with tensor parallelism shard 0
    talks through a :class:`~pipeq.wire.shard_link.LeadTransport` around it and every other shard
    through a :class:`~pipeq.wire.shard_link.FollowerTransport` (what shard 0 shares)."""

    def next_command(self, ready: Sequence[int], timeout_ms: int) -> tuple[int, Message] | None:
        """The next command for one of the chunks ``ready`` (chunk, message), or None after ``timeout_ms``."""

    def send_control(self, c: int, msg: Message) -> None:
        """Chunk ``c``'s reply (or report) to the driver."""

    def wait_activation(self, c: int, step: int, mb: int) -> Message:
        """Chunk ``c``'s input activation of microbatch ``mb`` of ``step`` (waits for it)."""

    def wait_gradient(self, c: int, step: int, mb: int) -> Message:
        """Chunk ``c``'s output gradient of microbatch ``mb`` of ``step`` (waits for it)."""

    def send_activation(self, c: int, step: int, mb: int, tensors: Sequence[torch.Tensor], tree: Any = None) -> None:
        """Chunk ``c``'s output activation to the next stage."""

    def send_gradient(self, c: int, step: int, mb: int, tensors: Sequence[torch.Tensor]) -> None:
        """Chunk ``c``'s input gradient to the previous stage."""

    def connect(self, c: int, next_forward: str | None, prev_backward: str | None) -> None:
        """Wire chunk ``c``'s sends to its neighbours' addresses (PEERS)."""

    def shm_waits(self, c: int) -> int:
        """How often chunk ``c``'s sends waited for a free shared-memory slot."""


class ProcessTransport:
    """The sockets and queues of one stage process, for stages (chunks) numbered ``processes``
    on the control channel, in chunk order. Not thread-safe: the event loop owns it.

    ``spin_s``: how long a wait busy-polls before it sleeps in the poller; ``shm``: large tensors
    cross to the neighbours through shared memory (one host); ``device``: a CUDA device's tensors
    cross through CUDA IPC then (see :class:`~pipeq.wire.stage_inbox.StageInbox`)."""

    def __init__(
        self, processes: Sequence[int], control_addr: str, *, bind: BindTo, queue_capacity: int, spin_s: float,
        max_frame_bytes: int, auth: WireAuth | None = None, shm: ShmConfig | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.inbox = Inbox(auth, bind.scheme == "tcp")
        self.stages: list[StageInbox] = []
        self.senders: list[StageSender] = []
        self.spin_s = spin_s
        try:
            for g in processes:
                self.stages.append(StageInbox(self.inbox, g, control_addr, bind=bind, queue_capacity=queue_capacity,
                                              spin_s=spin_s, auth=auth, max_frame_bytes=max_frame_bytes, shm=shm,
                                              device=device))
                self.senders.append(StageSender(self.stages[-1]))
        except BaseException:
            self.close()
            raise
        #: CUDA tensors cross to the neighbours as they are (CUDA IPC), not through host memory
        self.device_payloads = bool(self.stages) and self.stages[0].device_payloads
        self.max_frame_bytes = max_frame_bytes
        self.auth = auth

    @property
    def ctx(self) -> Any:
        """The process's ZeroMQ context (links and heartbeats make their sockets in it)."""
        return self.inbox.ctx

    def addresses(self, c: int) -> dict[str, str]:
        """Where chunk ``c``'s neighbours send to it: ``{"forward": ..., "backward": ...}``."""
        return self.stages[c].addresses

    def connect(self, c: int, next_forward: str | None, prev_backward: str | None) -> None:
        self.senders[c].connect(next_forward, prev_backward)

    # -- commands ------------------------------------------------------------------------------
    def next_command(self, ready: Sequence[int], timeout_ms: int) -> tuple[int, Message] | None:
        """The next command for one of the chunks ``ready`` (the first such chunk's, in chunk
        order), waiting up to ``timeout_ms``; None on time-out or when other traffic came (the
        caller asks again). A command is busy-polled first, for at most 1 ms (``spin_s`` if
        shorter): the next step's TRAIN follows the last one's LOSS within a driver's round trip
        when the caller loops, and an idle stage must not keep a core busy."""
        got = self._first(ready)
        if got is None and self.spin_s > 0 and ready:
            end = time.perf_counter() + min(self.spin_s, _COMMAND_SPIN_S, timeout_ms / 1000)
            while got is None and time.perf_counter() < end:
                for c in ready:
                    self.stages[c].poll_control()
                got = self._first(ready)
                if got is None:
                    os.sched_yield()
        if got is None:
            self.inbox.pump(timeout_ms)
            got = self._first(ready)
        return got

    def _first(self, ready: Sequence[int]) -> tuple[int, Message] | None:
        for c in ready:
            queue = self.stages[c].control_queue
            if queue:
                return c, queue.popleft()
        return None

    def send_control(self, c: int, msg: Message) -> None:
        """Send ``msg`` to the driver as chunk ``c``'s stage (replies, errors)."""
        self.senders[c].send_control(msg)

    # -- data ----------------------------------------------------------------------------------
    def wait_activation(self, c: int, step: int, mb: int) -> Message:
        """Chunk ``c``'s activation ``(step, mb)`` from the previous stage, once it is here."""
        st = self.stages[c]
        return st.wait_data(st.forward_queue, step, mb)

    def wait_gradient(self, c: int, step: int, mb: int) -> Message:
        """Chunk ``c``'s gradient ``(step, mb)`` from the next stage, once it is here."""
        st = self.stages[c]
        return st.wait_data(st.backward_queue, step, mb)

    def send_activation(self, c: int, step: int, mb: int, tensors: Sequence[torch.Tensor], tree: Any = None) -> None:
        self.senders[c].send_activation(step, mb, tensors, tree)

    def send_gradient(self, c: int, step: int, mb: int, tensors: Sequence[torch.Tensor]) -> None:
        self.senders[c].send_gradient(step, mb, tensors)

    def shm_waits(self, c: int) -> int:
        """How often chunk ``c``'s sends found every shared-memory slot of their channel busy."""
        return self.senders[c].shm_waits

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket, then the context (links made in it must be closed first)."""
        for sender in self.senders:
            sender.close(linger_ms)
        for st in self.stages:
            st.close(linger_ms)
        self.inbox.close()
