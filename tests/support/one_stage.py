"""A stage process holding one stage (chunk 0 of a :class:`pipeq.wire.transport.ProcessTransport`),
called as a test of one stage calls it: ``a.send_activation(step, mb, tensors)``,
``b.wait_data(b.forward_queue, step, mb)``. Every call is the transport's own, on chunk 0."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from pipeq.wire.messages import Message
from pipeq.wire.transport import ProcessTransport


class OneStage:
    """Stage process ``process``'s transport (``kwargs`` as :class:`ProcessTransport` takes them);
    ``rx`` and ``tx`` are its stage's receiving and sending halves."""

    def __init__(self, process: int, control_addr: str, **kwargs: Any) -> None:
        kwargs.setdefault("spin_s", 0.0)  # these tests wait in the poller
        kwargs.setdefault("max_frame_bytes", 256 << 20)
        self.transport = ProcessTransport([process], control_addr, **kwargs)
        self.process = process
        self.rx = self.transport.stages[0]
        self.tx = self.transport.senders[0]
        self.inbox = self.transport.inbox
        self.forward_queue = self.rx.forward_queue
        self.backward_queue = self.rx.backward_queue
        self.control_queue = self.rx.control_queue
        self.addresses = self.rx.addresses

    def connect(self, next_forward: str | None, prev_backward: str | None) -> None:
        self.transport.connect(0, next_forward, prev_backward)

    def send_activation(self, step: int, mb: int, tensors: Sequence[torch.Tensor], tree: Any = None) -> None:
        self.transport.send_activation(0, step, mb, tensors, tree)

    def send_gradient(self, step: int, mb: int, tensors: Sequence[torch.Tensor]) -> None:
        self.transport.send_gradient(0, step, mb, tensors)

    def send_control(self, msg: Message) -> None:
        self.transport.send_control(0, msg)

    def wait_data(self, queue: Any, step: int, mb: int) -> Message:
        return self.rx.wait_data(queue, step, mb)

    def next_control(self, timeout_ms: int) -> Message | None:
        got = self.transport.next_command([0], timeout_ms)
        return got[1] if got is not None else None

    def pump(self, timeout_ms: int) -> bool:
        return self.inbox.pump(timeout_ms)

    @property
    def shm_waits(self) -> int:
        return self.transport.shm_waits(0)

    @property
    def dropped(self) -> int:
        return self.rx.dropped

    def close(self, linger_ms: int = 0) -> None:
        self.transport.close(linger_ms)
