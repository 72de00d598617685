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
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from pipeq.stage.info import Tie, info_of
from pipeq.stage.tie_groups import tied_parameters
from pipeq.stage.transfer import ordered_sum

__all__ = ["TiedGrads"]


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

    @classmethod
    def of(cls, module: nn.Module, index: int) -> "TiedGrads | None":
        """``module``'s tied parameters (its :class:`~pipeq.stage.info.StageInfo`), None without."""
        ties = info_of(module).ties
        return cls(module, index, ties) if ties else None

    def shared(self, peer: int) -> list[Tie]:
        """The ties this stage and stage ``peer`` both hold, ordered by key (their messages' order)."""
        return [t for t in self.ties if peer in t.stages]

    def peer_params(self) -> dict[int, list[torch.Tensor]]:
        """Per peer stage, the parameters whose gradients go to it, in message order."""
        return {p: [self.params[t.key] for t in self.shared(p)] for p in self.peers}

    def not_owned(self) -> set[int]:
        """The ids of this stage's tied parameters that another stage counts in the global
        gradient norm (each tied parameter counts once: on its :attr:`Tie.owner`)."""
        return {id(self.params[t.key]) for t in self.ties if t.owner != self.index}

    def outgoing(self) -> dict[int, list[torch.Tensor]]:
        """Per peer stage, this stage's gradients of the ties they share (zeros for a copy this
        step did not use). They are the gradients themselves: the caller sends copies."""
        self.rounds += 1
        for p in self.params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return {peer: [p.grad for p in params] for peer, params in self.peer_params().items()}  # type: ignore[misc]

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
                own = grad.detach() if grad.device.type == "cpu" else grad.detach().to("cpu")
                parts = [own if s == self.index else got[(tie.key, s)] for s in tie.stages]
                for s, t in zip(tie.stages, parts):
                    if t.shape != own.shape or t.dtype != own.dtype:
                        raise RuntimeError(f"stage {self.index}: stage {s} sent tie {tie.key!r}'s gradient as "
                                           f"{list(t.shape)} {t.dtype}, expected {list(own.shape)} {own.dtype}")
                grad.copy_(ordered_sum(parts, tie.stages.index(self.index)))
