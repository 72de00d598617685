"""Host copies of device tensors for the wire: through pinned memory, complete when returned."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["pinned_copies"]


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
