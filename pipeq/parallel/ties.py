"""Tied weights across stage processes: the gradients' exchange over a :class:`~pipeq.wire.tie_link.TieLink`.

A stage holding tied weights (:mod:`pipeq.stage.ties`) binds a tie link before it reports READY
(its address travels in READY's ``tie_link``); the driver's PEERS names every stage's of the same
replica (``tie_links``). At each optimizer step, after the replicas' all-reduce, the interpreter
asks for the exchange: :meth:`TieSync.exchange` sends this stage's gradients of the ties it shares
with each peer, in flat buckets (as data parallelism packs them: :class:`~pipeq.parallel.data.FlatLayout`,
no bucket over a data frame's cap; a CUDA stage's through pinned host memory), and waits for the
peer's, which come back as fresh host tensors for :meth:`~pipeq.stage.ties.TiedGrads.add` to sum
in stage order. Messages are tagged ``(exchange number, bucket)``, alike on every stage.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from pipeq.parallel.data import BUCKET_BYTES, FlatLayout, to_host
from pipeq.wire.sockets import BindTo
from pipeq.wire.stage_inbox import StageInbox
from pipeq.wire.tie_link import TieLink

__all__ = ["TieSync"]


class TieSync:
    """Stage ``stage`` of replica ``replica``'s side of its tied weights' exchange: ``peers[s]``
    are the parameters whose gradients go to stage s (and come from it), in message order."""

    def __init__(self, receiver: StageInbox, bind: BindTo, *, stage: int, replica: int,
                 peers: Mapping[int, Sequence[torch.Tensor]]) -> None:
        self.stage = stage
        bucket_bytes = min(BUCKET_BYTES, receiver.max_frame_bytes)  # a bucket is one data frame
        self.layouts = {p: FlatLayout(list(params), bucket_bytes) for p, params in peers.items()}
        self.shapes = {p: [(tuple(t.shape), t.dtype) for t in params] for p, params in peers.items()}
        # what may wait, per peer: two exchanges' buckets (a stage is never more than one ahead:
        # each exchange waits for every peer's buckets)
        self.link = TieLink(receiver, bind, stage=stage, replica=replica, peers=sorted(peers),
                            capacity=sum(2 * len(lay) for lay in self.layouts.values()) + 1)

    @property
    def address(self) -> str:
        return self.link.address

    def join(self, addresses: Sequence[str | None]) -> None:
        """Connect to the peers: ``addresses[s]`` is stage s's tie link (None for a stage
        holding no copy of this one's tied weights)."""
        missing = [p for p in self.layouts if p >= len(addresses) or addresses[p] is None]
        if missing:
            raise RuntimeError(f"stage {self.stage} shares tied weights with stage(s) {missing}, which have no "
                               "tie link: do those stages hold their copies (their ties)?")
        self.link.connect(addresses)

    def exchange(self, n: int, outgoing: Mapping[int, Sequence[torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
        """Exchange number ``n``: send ``outgoing[s]`` to each peer s and return what each sent."""
        self.send(n, outgoing)
        return self.receive(n, list(outgoing))

    def send(self, n: int, outgoing: Mapping[int, Sequence[torch.Tensor]]) -> None:
        """Exchange number ``n``'s sends: ``outgoing[s]`` to each peer s (every peer)."""
        if set(outgoing) != set(self.layouts):
            raise RuntimeError(f"stage {self.stage}: tied gradients for stages {sorted(outgoing)}, but its tie "
                               f"peers are {sorted(self.layouts)}")
        with torch.no_grad():
            for peer, tensors in outgoing.items():
                layout = self.layouts[peer]
                for b in range(len(layout)):
                    self.link.send(n, b, [to_host(layout.gather(b, list(tensors)))], to=[peer])

    def receive(self, n: int, peers: Sequence[int]) -> dict[int, list[torch.Tensor]]:
        """What each of ``peers`` sent in exchange number ``n``, as new host tensors."""
        with torch.no_grad():
            return {peer: self._receive(n, peer) for peer in peers}

    def _receive(self, n: int, peer: int) -> list[torch.Tensor]:
        """Stage ``peer``'s tensors of exchange ``n``, as new host tensors."""
        layout = self.layouts[peer]
        out = [torch.empty(shape, dtype=dtype) for shape, dtype in self.shapes[peer]]
        for b in range(len(layout)):
            flat = layout.check(b, self.link.wait(peer, n, b), peer, "tied gradient", sender_is="stage")
            layout.scatter(b, flat, out)
        return out

    def close(self, linger_ms: int = 0) -> None:
        self.link.close(linger_ms)
