"""Data parallelism's channel: stage k of one replica to stage k of every other replica.

::

    stage k, replica r <--replicas (PUSH->PULL, both ways)--> stage k, replica r'

What travels is gradient buckets, and replica 0's weights at start (:mod:`pipeq.parallel.data`).
"""

from __future__ import annotations

from typing import Sequence

from pipeq.wire import control
from pipeq.wire.group_link import GroupLink
from pipeq.wire.messages import Kind
from pipeq.wire.sockets import BindTo
from pipeq.wire.stage_link import StageTransport

__all__ = ["ReplicaLink"]


class ReplicaLink(GroupLink):
    """Stage k's channel to the same stage of the other replicas (data parallelism): a
    :class:`~pipeq.wire.group_link.GroupLink` whose members are the replicas, numbered from 0.

    Replica r of stage k binds one more inbound socket and pushes to each sibling on a socket of
    its own. What travels is whole tensors for one ``(step, index)``: the gradient buckets of a
    step, replica 0's weights at start. With ``fault_tolerance="replicas"`` the driver's LOST names a
replica that is gone: :meth:`wait_replica` gives up on it at once, even in the middle of a wait
(the notice is taken from the stage's queued commands), and REJOIN brings it back. In "authenticate" mode a message's MAC is that of the link
    ``origin -> this replica`` (its label names the stage, the shard and both ends)."""

    def __init__(self, transport: StageTransport, bind: BindTo, *, stage: int, replica: int, replicas: int,
                 capacity: int, shard: int = 0) -> None:
        """``shard``: with tensor parallelism, the stage's shard this link sums (its MACs name it)."""
        if not 0 <= replica < replicas:
            raise ValueError(f"replica {replica} of {replicas}")
        self.stage, self.shard = stage, shard
        self.replica, self.replicas = replica, replicas
        prefix = f"R{stage}" + (f".{shard}" if shard else "")
        super().__init__(transport, bind, me=replica, members=range(replicas), kind=Kind.REPLICA, capacity=capacity,
                         label=lambda a, b: f"{prefix}:{a}>{b}", who=f"stage {stage}, replica {replica}",
                         peer="replica", socket_name=f"s{transport.process}-replicas")

    def connect(self, addresses: Sequence[str | None]) -> None:
        """Connect to every other replica; ``addresses[r]`` is replica r's bound address."""
        if len(addresses) != self.replicas or not all(type(a) is str for a in addresses):
            raise ValueError(f"stage {self.stage}, replica {self.replica}: expected the addresses of "
                             f"{self.replicas} replicas, got {addresses!r}")
        super().connect(addresses)

    def take_notices(self) -> None:
        """Act on every LOST the driver has sent that is queued for the event loop (and take it
        out of the queue): that replica is forgotten until it rejoins."""
        queue = getattr(self.transport, "control_queue", None)
        if not queue or not any(m.kind is Kind.LOST for m in queue):
            return
        rest = []
        for m in queue:
            if m.kind is Kind.LOST:
                self.forget(control.read(m, control.Lost).replica)
            else:
                rest.append(m)
        queue.clear()
        queue.extend(rest)

    def wait_replica(self, sender: int, step: int, index: int) -> Sequence | None:
        """Replica ``sender``'s message ``(step, index)``, or None once it is known to be lost."""
        def lost() -> bool:
            self.take_notices()
            return sender in self.gone

        got = self.wait(sender, step, index, give_up=lost)
        return None if sender in self.gone and not got else got
