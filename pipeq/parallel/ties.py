"""Tied weights across stage processes: the gradients' exchange over a :class:`~pipeq.wire.tie_link.TieLink`.

A stage holding tied weights (:mod:`pipeq.stage.ties`) binds a tie link before it reports READY
(its address travels in READY's ``tie_link``); the driver's PEERS names every stage's of the same
replica (``tie_links``; with tensor parallelism each shard's, ``tie_shards``: shard s swaps with
shard s). Joining, the peers tell each other which piece of each tied parameter their process
holds (:meth:`~pipeq.stage.ties.TiedGrads.pieces`: a tensor-parallel or FSDP piece, or the
whole), which decides what is swapped: pieces, or whole gradients (redistributed). At each
optimizer step, after the stage's reductions, the interpreter asks for the exchange:
:meth:`TieSync.send` sends this stage's gradients of the ties it shares with each peer, in flat
buckets (as data parallelism packs them: :class:`~pipeq.parallel.data.FlatLayout`, no bucket over
a data frame's cap; a CUDA stage's through pinned host memory), and :meth:`TieSync.receive` waits
for the peer's, which come back as fresh host tensors for :meth:`~pipeq.stage.ties.TiedGrads.add`
to sum in stage order. Messages are tagged ``(exchange number, bucket)``, alike on every stage
(exchange 0 is the pieces' handshake).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from pipeq.parallel.data import BUCKET_BYTES, FlatLayout, to_host
from pipeq.stage.ties import Piece, TiedGrads
from pipeq.wire.sockets import BindTo
from pipeq.wire.stage_inbox import StageInbox
from pipeq.wire.tie_link import TieLink

__all__ = ["TieSync"]

_HANDSHAKE = 0  # the exchange number of the pieces' handshake (a step's exchanges count from 1)


class TieSync:
    """Stage ``stage`` of replica ``replica`` (shard ``shard``)'s side of its tied weights' exchange
    with the stages ``peers`` of other processes (``tied``: the stage's tied parameters)."""

    def __init__(self, receiver: StageInbox, bind: BindTo, *, stage: int, replica: int, tied: TiedGrads,
                 peers: Sequence[int], shard: int = 0) -> None:
        self.stage, self.tied = stage, tied
        self.peers = sorted(peers)
        self.bucket_bytes = min(BUCKET_BYTES, receiver.max_frame_bytes)  # a bucket is one data frame
        whole = {p: FlatLayout([tied.params[t.key] for t in tied.shared(p)], self.bucket_bytes) for p in self.peers}
        self._layouts: dict[int, FlatLayout] = {}
        # what may wait, per peer: the handshake and two exchanges' buckets, at most (a stage is never
        # more than one ahead: each exchange waits for every peer's buckets; a piece is no bigger than the whole)
        self.link = TieLink(receiver, bind, stage=stage, replica=replica, peers=self.peers, shard=shard,
                            capacity=sum(2 * len(lay) + 1 for lay in whole.values()) + 1)

    @property
    def address(self) -> str:
        return self.link.address

    def join(self, addresses: Sequence[str | None]) -> None:
        """Connect to the peers (``addresses[s]`` is stage s's tie link, None for a stage holding
        no copy of this one's tied weights) and learn which piece of each tie each one's process holds."""
        missing = [p for p in self.peers if p >= len(addresses) or addresses[p] is None]
        if missing:
            raise RuntimeError(f"stage {self.stage} shares tied weights with stage(s) {missing}, which have no "
                               "tie link: do those stages hold their copies (their ties)?")
        self.link.connect(addresses)
        mine = self.tied.pieces()
        for peer in self.peers:
            keys = [t.key for t in self.tied.shared(peer)]
            self.link.send(_HANDSHAKE, 0, [_encode([mine[k] for k in keys])], to=[peer])
        for peer in self.peers:
            keys = [t.key for t in self.tied.shared(peer)]
            got = self.link.wait(peer, _HANDSHAKE, 0)
            self.tied.learn(peer, dict(zip(keys, _decode(got, len(keys), peer))))
        self._layouts.clear()

    def _layout(self, peer: int, tensors: Sequence[torch.Tensor]) -> FlatLayout:
        """How the exchange with ``peer`` is packed (the same tensors' shapes at every step)."""
        if peer not in self._layouts:
            self._layouts[peer] = FlatLayout(list(tensors), self.bucket_bytes)
        return self._layouts[peer]

    def exchange(self, n: int, outgoing: Mapping[int, Sequence[torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
        """Exchange number ``n``: send ``outgoing[s]`` to each peer s and return what each sent."""
        self.send(n, outgoing)
        return self.receive(n, list(outgoing), outgoing)

    def send(self, n: int, outgoing: Mapping[int, Sequence[torch.Tensor]]) -> None:
        """Exchange number ``n``'s sends: ``outgoing[s]`` to each peer s (every peer)."""
        if set(outgoing) != set(self.peers):
            raise RuntimeError(f"stage {self.stage}: tied gradients for stages {sorted(outgoing)}, but its tie "
                               f"peers are {self.peers}")
        with torch.no_grad():
            for peer, tensors in outgoing.items():
                layout = self._layout(peer, tensors)
                for b in range(len(layout)):
                    self.link.send(n, b, [to_host(layout.gather(b, list(tensors)))], to=[peer])

    def receive(self, n: int, peers: Sequence[int], outgoing: Mapping[int, Sequence[torch.Tensor]]
                ) -> dict[int, list[torch.Tensor]]:
        """What each of ``peers`` sent in exchange number ``n``, as new host tensors (of the shapes
        of what this stage sent it, ``outgoing``)."""
        with torch.no_grad():
            return {peer: self._receive(n, peer, outgoing[peer]) for peer in peers}

    def _receive(self, n: int, peer: int, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        layout = self._layout(peer, like)
        out = [torch.empty(t.shape, dtype=t.dtype) for t in like]
        for b in range(len(layout)):
            flat = layout.check(b, self.link.wait(peer, n, b), peer, "tied gradient", sender_is="stage")
            layout.scatter(b, flat, out)
        return out

    def close(self, linger_ms: int = 0) -> None:
        self.link.close(linger_ms)


def _encode(pieces: Sequence[Piece]) -> torch.Tensor:
    """The pieces as one int64 tensor: per piece its rank, then its three shapes."""
    flat: list[int] = []
    for whole, shape, offset in pieces:
        flat += [len(whole), *whole, *shape, *offset]
    return torch.tensor(flat, dtype=torch.int64)


def _decode(got: Sequence[torch.Tensor], n: int, peer: int) -> list[Piece]:
    """``n`` pieces from stage ``peer``'s handshake (ValueError when malformed)."""
    if len(got) != 1 or got[0].dtype != torch.int64 or got[0].dim() != 1:
        raise ValueError(f"stage {peer} sent a malformed tie handshake")
    flat, out, i = got[0].tolist(), [], 0
    for _ in range(n):
        if i >= len(flat) or not 0 <= flat[i] <= 16 or i + 1 + 3 * flat[i] > len(flat):
            raise ValueError(f"stage {peer} sent a malformed tie handshake")
        d = flat[i]
        out.append((tuple(flat[i + 1:i + 1 + d]), tuple(flat[i + 1 + d:i + 1 + 2 * d]),
                    tuple(flat[i + 1 + 2 * d:i + 1 + 3 * d])))
        i += 1 + 3 * d
    if i != len(flat):
        raise ValueError(f"stage {peer} sent a malformed tie handshake")
    return out
