"""Host copies of device tensors for the wire: through pinned memory, complete when returned."""

from __future__ import annotations

from typing import Sequence

import torch

from pipeq.stage import microbatch

__all__ = ["pinned_copies", "to_host"]


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


def to_host(tensors: Sequence[torch.Tensor], device: torch.device) -> Sequence[torch.Tensor]:
    """CPU copies of ``tensors`` (on ``device``) for sending: the same tensors when already on the
    CPU; a tree's description (:mod:`pipeq.stage.microbatch`) stays with them."""
    if device.type != "cuda":
        return tensors
    return microbatch.rewrap(tensors, pinned_copies(tensors, device))
