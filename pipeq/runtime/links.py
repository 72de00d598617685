"""A stage process's links beyond its neighbours: to its stage's replicas and to its tie peers.

With data parallelism, stage k talks to stage k of the other replicas (:class:`~pipeq.parallel.data.Replicas`:
replica 0's weights at start, the gradients' all-reduce); with tied weights, to the other stages of
its replica holding a copy (:class:`~pipeq.parallel.ties.TieSync`: the tied gradients' sum). Both
links are bound before the stage reports READY (their addresses travel in it) and joined when the
driver's PEERS names the others'.
"""

from __future__ import annotations

from typing import Any, Collection, Mapping, Sequence

import torch

from pipeq.parallel.data import Replicas
from pipeq.parallel.ties import TieSync
from pipeq.stage.executor import StageExecutor
from pipeq.wire.control import Lost, Peers
from pipeq.wire.sockets import BindTo
from pipeq.wire.stage_inbox import StageInbox
from pipeq.wire.stage_link import StageSender

__all__ = ["PeerLinks", "swap_ties"]


class PeerLinks:
    """Stage ``stage``'s (of replica ``replica``, shard ``shard`` of ``shards``) links to its
    replicas (``replicas > 1``) and to its tie peers in other processes (its executor holds tied
    weights; ``held``: the stages of its own process, whose copies are summed in memory); the
    executor's gradient sync is the replicas' (``sharded_replicas``: FSDP2's; no replica link). ``receiver``, ``sender``: the stage's own channels."""

    def __init__(self, receiver: StageInbox, sender: StageSender, bind: BindTo, executor: StageExecutor, *,
                 stage: int, replica: int, replicas: int, shard: int, shards: int, held: Collection[int],
                 sharded_replicas: bool = False) -> None:
        self.stage, self.shard, self.shards = stage, shard, shards
        self.replicas: Replicas | None = None
        self.ties: TieSync | None = None
        # sharded replicas (pipeq.parallel.fsdp) agree on their start and sum their gradients in their
        # process group: no replica link, but the driver's PEERS still waits for their ACK
        self.sharded_replicas = sharded_replicas and replicas > 1
        try:
            if replicas > 1 and not self.sharded_replicas:  # replica 0's weights, summed gradients
                self.replicas = Replicas(receiver, sender, bind, stage=stage, replica=replica, replicas=replicas,
                                         params=executor.optimizer_params(), buffers=list(executor.module.buffers()),
                                         shard=shard)
                executor.grad_sync = self.replicas.sync
            remote = {s: params for s, params in (executor.tied.peer_params().items() if executor.tied else ())
                      if s not in held}
            if remote:  # the tied weights' summed gradients, with the stages of other processes
                self.ties = TieSync(receiver, bind, stage=stage, replica=replica, peers=remote)
        except BaseException:
            self.close()
            raise

    def addresses(self) -> dict[str, Any]:
        """READY's fields for these links: where the replicas and the tie peers reach this stage."""
        return {"replica_link": self.replicas.address if self.replicas is not None else None,
                "tie_link": self.ties.address if self.ties is not None else None}

    def join(self, peers: Peers) -> bool:
        """Connect to the peers PEERS names; True when the driver waits for an ACK (the replicas
        then hold replica 0's parameters and buffers)."""
        if self.ties is not None:
            self.ties.join(peers.tie_links or [])
        if self.replicas is None:
            return self.sharded_replicas
        # before any step: replicas never start apart (a rebuilt one: restored by the driver next)
        self.replicas.join(self._replica_addresses(peers), peers.rejoin_round)
        return True

    def note_train(self, shares: list[float] | None) -> None:
        """A TRAIN's replica shares (fault_tolerance="replicas"), for its gradient round."""
        if shares is not None and self.replicas is not None:
            self.replicas.sync.shares.append(shares)

    def replica_lost(self, notice: Lost, request: int) -> None:
        """LOST (read between steps, message step ``request``): sum without its replica from its
        ``from_round`` on, until it is back (:meth:`~pipeq.wire.replica_link.ReplicaLink.lose`)."""
        if self.replicas is not None:
            self.replicas.link.lose(notice, request)

    def replica_back(self, replica: int, address: str, after_round: int) -> None:
        """REJOIN: ``replica`` is rebuilt, at ``address``; its messages up to ``after_round`` are stale."""
        if self.replicas is None:
            raise RuntimeError(f"stage {self.stage}: REJOIN, but this stage has no replicas")
        self.replicas.link.rejoin(replica, address, after_round)

    def _replica_addresses(self, peers: Peers) -> list[str]:
        """The same stage's (and shard's) other replicas, from PEERS: with tensor parallelism,
        ``replica_shards[s]`` lists shard s's, as the lead's PEERS reaches every shard."""
        if self.shards == 1:
            return peers.replicas or []
        by_shard = peers.replica_shards
        if by_shard is None or len(by_shard) != self.shards:
            raise ValueError(f"stage {self.stage}, shard {self.shard}: bad replica_shards {by_shard!r} in PEERS")
        return by_shard[self.shard]

    def close(self, linger_ms: int = 0) -> None:
        """Close both links (their sockets share the transport's context: before it)."""
        for link in (self.replicas, self.ties):
            if link is not None:
                link.close(linger_ms)


def swap_ties(links: Sequence[PeerLinks | None], n: int,
              outgoing: Mapping[int, Mapping[int, Sequence[torch.Tensor]]]) -> dict[int, dict[int, list[torch.Tensor]]]:
    """The tied gradients' exchange number ``n`` of a process's chunks with other processes:
    ``outgoing[c][s]`` goes from chunk c over its tie link to stage s. Every chunk sends before
    any waits (a chunk waiting first could wait for a peer that waits for another of this
    process's chunks); what each peer sent each chunk comes back, as new host tensors."""
    ties = {}
    for c in outgoing:
        link = links[c]
        if link is None or link.ties is None:
            raise RuntimeError(f"chunk {c}: tied gradients to exchange, but no tie link")
        ties[c] = link.ties
    for c, by_peer in outgoing.items():
        ties[c].send(n, by_peer)
    return {c: ties[c].receive(n, list(by_peer)) for c, by_peer in outgoing.items()}
