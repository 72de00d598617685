"""Tied weights' channel: a stage to the other stages of its replica that hold a copy of one of its tied weights.

::

    stage a, replica r <--ties (PUSH->PULL, both ways)--> stage b, replica r

What travels is the tied parameters' gradient buckets, once per step (:mod:`pipeq.parallel.ties`).
"""

from __future__ import annotations

from typing import Sequence

from pipeq.wire.group_link import GroupLink
from pipeq.wire.messages import Kind
from pipeq.wire.sockets import BindTo
from pipeq.wire.stage_inbox import StageInbox

__all__ = ["TieLink"]


class TieLink(GroupLink):
    """Stage ``stage``'s channel to its tie peers ``peers`` (other stages of replica ``replica``):
    a :class:`~pipeq.wire.group_link.GroupLink` whose members are stage numbers. With tensor
    parallelism each shard has its own, to the same shard of its peers (``shard``). In
    "authenticate" mode a message's MAC is that of the link ``origin -> this stage`` of this
    replica and shard (label ``T{replica}.{shard}:{sender}>{receiver}``), so it verifies on no
    other link, the replicas' and shards' included."""

    def __init__(self, receiver: StageInbox, bind: BindTo, *, stage: int, replica: int, peers: Sequence[int],
                 capacity: int, shard: int = 0) -> None:
        if not peers or stage in peers:
            raise ValueError(f"stage {stage}: a tie link's peers are other stages, got {list(peers)!r}")
        self.stage, self.replica = stage, replica
        super().__init__(receiver.inbox, bind, auth=receiver.auth, max_frame_bytes=receiver.max_frame_bytes, me=stage,
                         members=sorted({stage, *peers}), kind=Kind.TIE, capacity=capacity,
                         label=lambda a, b: f"T{replica}.{shard}:{a}>{b}",
                         who=f"stage {stage}" + (f", replica {replica}" if replica else "")
                         + (f", shard {shard}" if shard else ""), peer="stage",
                         socket_name=f"s{receiver.process}-ties")
