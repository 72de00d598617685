"""Tensors for the wire, on the host: copies of device tensors, and the sum of every process's, in one order.

:func:`pinned_copies` copies through pinned memory, complete when it returns.

:func:`ordered_sum` is the one way pipeq adds what several processes hold (data parallelism's
replicas, :mod:`pipeq.parallel.data`; the copies of a tied weight, :mod:`pipeq.stage.ties`): in
one fixed order, the same on every process, so that every process gets the same bits.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pipeq.stage import microbatch

__all__ = ["pinned_copies", "to_host", "ordered_sum"]


def pinned_copies(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """CPU copies of ``tensors`` (on CUDA ``device``): asynchronous copies into pinned memory,
    then one wait for ``device``'s current stream, so they are complete before ZeroMQ reads them."""
    host = []
    for t in tensors:
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        host.append(buf)
    torch.cuda.current_stream(device).synchronize()
    return host


def ordered_sum(parts: Sequence[torch.Tensor], mine: int) -> torch.Tensor:
    """``parts[0] + parts[1] + ... + parts[-1]``, added in that order into one of the received
    parts' buffers, never into ``parts[mine]`` (the caller's own: its gradient, or a buffer ZeroMQ
    may still be sending). ``parts[0] + parts[1]`` is computed as ``parts[1] + parts[0]`` when
    ``mine`` is 0: IEEE addition is commutative, so every process gets the same bits."""
    if len(parts) < 2:
        raise ValueError("an ordered sum adds two or more parts")
    acc, other = (parts[1], parts[0]) if mine == 0 else (parts[0], parts[1])
    acc.add_(other)
    for t in parts[2:]:
        acc.add_(t)
    return acc


def to_host(tensors: Sequence[torch.Tensor], device: torch.device) -> Sequence[torch.Tensor]:
    """CPU copies of ``tensors`` (on ``device``) for sending: the same tensors when already on the
    CPU; a tree's description (:mod:`pipeq.stage.microbatch`) stays with them."""
    if device.type != "cuda":
        return tensors
    return microbatch.rewrap(tensors, pinned_copies(tensors, device))
