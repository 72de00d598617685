"""Data parallelism beside the pipeline: R replicas of every stage, gradients all-reduced.

Stage k of every replica joins one torch.distributed process group (gloo on CPU, NCCL when the
stage is on CUDA): replica r has rank r. When it joins, replica 0's parameters and buffers are
broadcast, so replicas can never start apart. Each replica runs its own shard of the batch
through its own pipeline (activations still travel over ZeroMQ); the loss of every microbatch
is weighted by its share of the *whole* batch, so the sum of the replicas' gradients is the
full-batch gradient. :class:`GradSync` starts that sum as soon as the stage's last backward of
the step is done, in buckets, asynchronously, while the stage still sends its last gradient
down; the optimizer step waits for it::

    replica 0, stage k | ... B6 B7 [all-reduce -----] ST
    replica 1, stage k | ... B6 B7 [all-reduce -----] ST
"""

from __future__ import annotations

import datetime
import os
from typing import Sequence

import torch
import torch.distributed as dist

from .netif import interface_of

BUCKET_BYTES = 25 << 20


def join(stage: int, replica: int, replicas: int, store_address: tuple[str, int, str], device: torch.device,
         bind: str | None, timeout_s: float = 300.0) -> None:
    """Join stage ``stage``'s group as rank ``replica`` (one group per process: the default one)."""
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        iface = interface_of(bind) if bind else "lo"
        if iface:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
    host, port, prefix = store_address
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.PrefixStore(f"{prefix}dp/stage{stage}/", store),
        rank=replica, world_size=replicas, timeout=datetime.timedelta(seconds=timeout_s),
    )


def broadcast_from_replica_0(tensors: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=0)


class GradSync:
    """Sums the parameters' gradients over the replicas, in buckets, without blocking."""

    def __init__(self, params: Sequence[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> None:
        self.params = list(params)
        self.buckets: list[list[torch.Tensor]] = []
        size, bucket = 0, []
        for p in self.params:
            bucket.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(bucket)
                size, bucket = 0, []
        if bucket:
            self.buckets.append(bucket)
        self.pending: list[tuple[torch.Tensor, list[torch.Tensor], dist.Work]] = []

    def start(self) -> None:
        """After the step's last backward: launch one all-reduce per bucket."""
        for bucket in self.buckets:
            for p in bucket:  # a parameter this replica did not use still takes part (zeros)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            self.pending.append((flat, bucket, dist.all_reduce(flat, async_op=True)))

    def finish(self) -> None:
        """Before the optimizer step: wait, and put the sums back into the gradients."""
        if not self.pending:
            self.start()  # no backward ran (nothing to learn in this step): still take part
        for flat, bucket, work in self.pending:
            work.wait()
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p))
                offset += n
        self.pending.clear()
