"""Where the control and stage links meet the codec: a :class:`Message` to frames and back, aligned.

Received tensors are views over ZeroMQ's buffers (zero copy), except small ones that are not at
torch's alignment (:func:`decode_aligned`): the same run computes the same bits every time.
"""

from __future__ import annotations

from typing import Any, Sequence

from pipeq.wire import codec
from pipeq.wire.messages import Message

__all__ = ["decode_aligned", "frames_of"]

#: A received tensor under _COPY_BELOW bytes whose address is not a multiple of _ALIGN is copied
#: (see decode_aligned); torch's own allocations are 64-byte aligned.
_ALIGN = 64
_COPY_BELOW = 64 << 10


def decode_aligned(frames: Sequence[Any], take: codec.Take | None = None,
                   take_device: codec.Take | None = None) -> Message:
    """:func:`codec.decode`, with every small tensor at torch's alignment.

    ZeroMQ hands over a small frame where it lies in its 8 KiB receive buffer, at an address that
    depends on how the bytes happened to arrive (one read or two), so it changes from run to run
    and under load; and MKL's matrix products round differently for an operand at another
    address modulo 16 (1 ulp, e.g. a Linear(16, 3) on a 12x16 float32 input). Those tensors are
    copied (under 64 KiB: microseconds). A larger frame has a ZeroMQ allocation of its own, always at the
    same offset from malloc's 16-byte alignment, and is used in place (zero copy).
    """
    msg = codec.decode(frames, take, take_device)
    if any(t.data_ptr() % _ALIGN and t.nbytes < _COPY_BELOW for t in msg.tensors):
        msg.tensors = [t.clone() if t.data_ptr() % _ALIGN and t.nbytes < _COPY_BELOW else t
                       for t in msg.tensors]
    return msg


def frames_of(msg: Message) -> list[Any]:
    """``msg`` as the codec's frames (its tensors as frames over their own memory: no copy)."""
    return codec.encode(msg.kind, msg.step, msg.microbatch, msg.tensors, msg.extra or None)
