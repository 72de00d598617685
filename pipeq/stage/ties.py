"""A stage's tied weights: the gradients it sends the other stages holding a copy, and their sum.

A parameter shared between stages (a tied embedding and LM head) is held by every stage that uses
it, one copy each (:class:`~pipeq.stage.info.Tie`). Before each optimizer step, after data
parallelism's all-reduce over the replicas, the stages holding a copy swap their gradients of it
and each adds all of them *in stage order* (``g[s0] + g[s1] + ...``, the same additions on every
stage), so the copies, updated by identical optimizers from identical gradients, stay bitwise
equal. A stage that did not use its copy in a step contributes zeros.

:class:`TiedGrads` is the stage's side of it; the exchange itself is the caller's (the worker's
tie link, :mod:`pipeq.parallel.ties`; the simulated engine's mailbox). Between stages a and b the
message holds the gradients of every tie both hold, ordered by the tie's key. With fp16 loss
scaling the *scaled* gradients are summed (every stage holds the same loss scale), before any
stage unscales them; the found-inf check and the global norm then see the sum.

A stage whose processes hold its tied parameter in pieces (tensor parallelism, FSDP: a DTensor)
sums pieces when every holder's process holds the same piece of it (the same part of the whole
tensor: e.g. a GPT's embedding split by rows and its head by output rows, or both sharded by
FSDP alike); each process then swaps its piece with the same process of the other holders.
Otherwise the tie is *redistributed*: each process gathers its whole gradient, the wholes are
summed, and each process keeps its own piece of the sum. Each holder's piece (:meth:`TiedGrads.piece`)
is learnt once from the others (:meth:`TiedGrads.learn`) before the first exchange.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from pipeq.stage.info import Tie, info_of
from pipeq.stage.memory import local
from pipeq.stage.tie_groups import tied_parameters
from pipeq.stage.transfer import ordered_sum

#: which part of the whole tensor a process holds: (whole shape, its piece's shape, its offset)
Piece = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]

__all__ = ["TiedGrads", "Piece", "piece_of"]


class TiedGrads:
    """Stage ``index``'s tied parameters (``ties``, each a :class:`~pipeq.stage.info.Tie` naming
    one of ``module``'s parameters) and their gradients' exchange (see the module)."""

    def __init__(self, module: nn.Module, index: int, ties: Sequence[Tie]) -> None:
        self.index = index
        self.ties = sorted(ties, key=lambda t: t.key)
        self.params = tied_parameters(module, index, self.ties)
        #: the other stages holding a copy of one of this stage's tied parameters
        self.peers = sorted({s for t in self.ties for s in t.stages} - {index})
        self.rounds = 0  # exchanges so far (each :meth:`outgoing` starts one)
        #: per peer stage, the piece of each tie (by key) its processes' counterpart holds (learn)
        self.theirs: dict[int, dict[str, Piece]] = {}
        self._whole: set[str] | None = None  # the ties redistributed (None: not decided yet)
        self._gathered: dict[str, torch.Tensor] = {}  # this exchange's whole gradients (redistributed ties)

    @classmethod
    def of(cls, module: nn.Module, index: int) -> "TiedGrads | None":
        """``module``'s tied parameters (its :class:`~pipeq.stage.info.StageInfo`), None without."""
        ties = info_of(module).ties
        return cls(module, index, ties) if ties else None

    def shared(self, peer: int) -> list[Tie]:
        """The ties this stage and stage ``peer`` both hold, ordered by key (their messages' order)."""
        return [t for t in self.ties if peer in t.stages]

    def not_owned(self) -> set[int]:
        """The ids of this stage's tied parameters that another stage counts in the global
        gradient norm (each tied parameter counts once: on its :attr:`Tie.owner`)."""
        return {id(self.params[t.key]) for t in self.ties if t.owner != self.index}

    # -- pieces --------------------------------------------------------------------------------
    def pieces(self) -> dict[str, Piece]:
        """Which part of each tied parameter this process holds."""
        return {t.key: piece_of(self.params[t.key]) for t in self.ties}

    def learn(self, peer: int, pieces: Mapping[str, Piece]) -> None:
        """Stage ``peer``'s counterpart holds ``pieces`` (its :meth:`pieces`)."""
        self.theirs[peer] = dict(pieces)
        self._whole = None

    def redistributed(self) -> set[str]:
        """The ties summed whole (a holder's process holds another piece than this one's)."""
        if self._whole is None:
            mine = self.pieces()
            whole = {key for key, (shape, held, _) in mine.items() if shape == held}
            unknown = [s for t in self.ties for s in t.stages
                       if s != self.index and s not in self.theirs and t.key not in whole]
            if unknown:  # (a process holding whole tensors assumes its peers do, as in one process)
                raise RuntimeError(f"stage {self.index}: the pieces of its tied weights held by stage(s) "
                                   f"{sorted(set(unknown))} are not known: were the tie peers joined?")
            self._whole = {t.key for t in self.ties
                           if any(self.theirs.get(s, {}).get(t.key, mine[t.key]) != mine[t.key]
                                  for s in t.stages if s != self.index)}
        return self._whole

    def _value(self, key: str) -> torch.Tensor:
        """What this process exchanges of tie ``key``'s gradient: its piece, or (redistributed)
        the whole gradient (gathered once per exchange: a collective of the stage's processes)."""
        grad = self.params[key].grad
        assert grad is not None
        if key not in self.redistributed():
            return local(grad)
        if key not in self._gathered:
            from pipeq.parallel.tensor import whole

            self._gathered[key] = whole(grad.detach())
        return self._gathered[key]

    def outgoing(self) -> dict[int, list[torch.Tensor]]:
        """Per peer stage, this stage's gradients of the ties they share (zeros for a copy this
        step did not use): pieces, or wholes for a redistributed tie. They are the gradients
        themselves: the caller sends copies."""
        self.rounds += 1
        self._gathered.clear()
        for p in self.params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return {peer: [self._value(t.key) for t in self.shared(peer)] for peer in self.peers}

    def add(self, received: Mapping[int, Sequence[torch.Tensor]]) -> None:
        """Replace each tied gradient by the sum of every copy's, in stage order. ``received[s]``:
        stage s's gradients, in :meth:`shared` order; they are this stage's to write to."""
        got = {}
        for peer in self.peers:
            ties, tensors = self.shared(peer), received.get(peer)
            if tensors is None or len(tensors) != len(ties):
                raise RuntimeError(f"stage {self.index}: stage {peer} sent {len(tensors or ())} tied gradient(s), "
                                   f"expected {len(ties)} (ties {[t.key for t in ties]})")
            for tie, t in zip(ties, tensors):
                got[(tie.key, peer)] = t if t.device.type == "cpu" else t.to("cpu")  # added on the host
        with torch.no_grad():
            for tie in self.ties:
                grad = self.params[tie.key].grad
                assert grad is not None  # outgoing() made it
                mine = self._value(tie.key).detach()
                own = mine if mine.device.type == "cpu" else mine.to("cpu")
                parts = [own if s == self.index else got[(tie.key, s)] for s in tie.stages]
                for s, t in zip(tie.stages, parts):
                    if t.shape != own.shape or t.dtype != own.dtype:
                        raise RuntimeError(f"stage {self.index}: stage {s} sent tie {tie.key!r}'s gradient as "
                                           f"{list(t.shape)} {t.dtype}, expected {list(own.shape)} {own.dtype}")
                total = ordered_sum(parts, tie.stages.index(self.index))
                if tie.key in self.redistributed():
                    from pipeq.parallel.tensor import like

                    total = local(like(total.to(grad.device), grad))
                local(grad).copy_(total)
        self._gathered.clear()


def piece_of(p: torch.Tensor) -> Piece:
    """Which part of the whole tensor ``p`` this process holds (the whole, for a plain tensor)."""
    if not hasattr(p, "device_mesh") or not hasattr(p, "placements"):
        return tuple(p.shape), tuple(p.shape), (0,) * p.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(p.shape), tuple(shape), tuple(offset)
