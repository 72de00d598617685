"""A stage process's links beyond its neighbours: to its stage's replicas and to its tie peers.

With data parallelism, stage k sums its gradients with stage k of the other replicate slices in a
torch process group (:class:`~pipeq.parallel.data.Replicas`: slice 0's weights at start, the
gradients' all-reduce, and with ``fault_tolerance="replicas"`` who is summed each round); with
tied weights, it swaps them with the other stages of its replica holding a copy
(:class:`~pipeq.parallel.ties.TieSync`: the tied gradients' sum). The tie link is bound before the
stage reports READY (its address travels in it); both are joined when the driver's PEERS names
the others'.
"""

from __future__ import annotations

from typing import Any, Collection, Mapping, Sequence

import torch

from pipeq.parallel.data import GradSync, Replicas
from pipeq.parallel.ties import TieSync
from pipeq.stage.executor import StageExecutor
from pipeq.wire.control import Lost, Peers
from pipeq.wire.sockets import BindTo
from pipeq.wire.stage_inbox import StageInbox
from pipeq.wire.stage_link import StageSender

__all__ = ["PeerLinks", "swap_ties"]


class PeerLinks:
    """Stage ``stage``'s (of replica ``replica`` of ``replicas``, shard ``shard``) links to its
    replicate slices (``mesh``: the process's :class:`~pipeq.parallel.mesh.StageMesh`, None for a
    stage of one process; ``wait``: how its collectives wait, serving the process) and to its tie
    peers in other processes (its executor holds tied weights; ``held``: the stages of its own
    process, whose copies are summed in memory). ``receiver``, ``sender``: the stage's own channels."""

    def __init__(self, receiver: StageInbox, sender: StageSender, bind: BindTo, executor: StageExecutor, *,
                 stage: int, replica: int, replicas: int, shard: int, held: Collection[int], mesh: Any = None,
                 wait: Any = None, fault_tolerant: bool = False) -> None:
        self.stage, self.shard = stage, shard
        self.acks = replicas > 1  # PEERS: the driver waits for every replica's ACK (a sharded one's too)
        self.replicas: Replicas | None = None
        self.ties: TieSync | None = None
        try:
            if mesh is not None and mesh.plan.slices > 1:  # slice 0's weights, summed gradients
                self.replicas = _replicas(receiver, sender, executor, mesh, wait, stage=stage, replica=replica,
                                          replicas=replicas, fault_tolerant=fault_tolerant)
            tied = executor.tied
            remote = [s for s in (tied.peers if tied is not None else ()) if s not in held]
            if remote:  # the tied weights' summed gradients, with the stages of other processes
                self.ties = TieSync(receiver, bind, stage=stage, replica=replica, tied=tied, peers=remote,
                                    shard=shard)
        except BaseException:
            self.close()
            raise

    def addresses(self) -> dict[str, Any]:
        """READY's fields for these links: where the tie peers reach this stage."""
        return {"tie_link": self.ties.address if self.ties is not None else None}

    def join(self, peers: Peers) -> bool:
        """Connect to the peers PEERS names, and make the replicas' group; True when the driver
        waits for an ACK (the replicas then hold slice 0's parameters and buffers)."""
        if self.ties is not None:
            self.ties.join(self._tie_addresses(peers))
        if self.replicas is not None:
            self.replicas.join(peers.rejoin_round)
        return self.acks

    def note_train(self, shares: list[float] | None) -> None:
        """A TRAIN's replica shares (fault_tolerance="replicas"), for its gradient round."""
        if shares is not None and self.replicas is not None:
            self.replicas.sync.shares.append(shares)

    def replica_lost(self, notice: Lost, request: int) -> None:
        """LOST (read between steps, message step ``request``): sum without its replica from its
        ``from_round`` on, until it is back (:meth:`~pipeq.parallel.membership.Membership.lose`)."""
        if self.replicas is not None and self.replicas.rounds is not None:
            self.replicas.rounds.lose(notice, request)

    def replica_back(self, replica: int, after_round: int) -> None:
        """REJOIN: ``replica`` is rebuilt; the group of every slice again from round ``after_round + 1``."""
        if self.replicas is None or self.replicas.rounds is None:
            raise RuntimeError(f"stage {self.stage}: REJOIN, but this stage has no replicas to lose")
        self.replicas.rounds.rejoin(replica, after_round)

    def _tie_addresses(self, peers: Peers) -> list[str | None]:
        """This shard's tie peers, from PEERS (with tensor parallelism, ``tie_shards[s]`` lists
        shard s's, as the lead's PEERS reaches every shard)."""
        if self.shard == 0 or peers.tie_shards is None:
            return peers.tie_links or []
        if self.shard >= len(peers.tie_shards):
            raise ValueError(f"stage {self.stage}, shard {self.shard}: bad tie_shards in PEERS")
        return peers.tie_shards[self.shard]

    def close(self, linger_ms: int = 0) -> None:
        """Close the tie link (its sockets share the transport's context: before it) and leave the replicas' group."""
        if self.ties is not None:
            self.ties.close(linger_ms)
        if self.replicas is not None:
            self.replicas.group.abort()


def _replicas(receiver: StageInbox, sender: StageSender, executor: StageExecutor, mesh: Any, wait: Any, *,
              stage: int, replica: int, replicas: int, fault_tolerant: bool) -> Replicas:
    """Stage ``stage``'s replicate group, its gradient sum and (fault tolerance) its rounds."""
    from pipeq.parallel.membership import Membership

    plan = mesh.plan
    group = mesh.replica_group(f"s{stage}", wait)
    rounds = Membership(group, receiver.control_queue, sender.send_control, sender, stage=stage, replica=replica,
                        replicas=replicas, shard_size=plan.shard_size) if fault_tolerant else None
    if rounds is not None:
        receiver.inbox.on_check(rounds.check_parting)
    parallel = executor.parallel
    sync = GradSync(executor.optimizer_params(), group, replicas, plan.shard_size, rounds,
                    hooks=not (parallel is not None and parallel.sharded))
    if parallel is not None:
        parallel.attach_replicas(sync)
    weights = [*executor.module.parameters(), *executor.module.buffers()]
    return Replicas(group, sync, rounds, weights, plan.slice, plan.slices)


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
    return {c: ties[c].receive(n, list(by_peer), by_peer) for c, by_peer in outgoing.items()}
