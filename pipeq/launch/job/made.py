"""A job's stages made once per node: by the launching process (node 0), and once by each other
node's agent, from the stages function the job names, instead of once in every stage process.

Each stage is kept pickled, and each local stage process is handed its own stage's bytes when it
starts (the arguments multiprocessing passes a child it starts, as a :class:`~pipeq.PipelineRunner`
hands its stages over; never anything read from a socket). What two nodes compare is plain data:
:meth:`MadeStages.describe`, each stage's tensors and the split points, in the job's description
(:func:`pipeq.control.processes.job_identity`), so that a node whose stages function split the model
otherwise (a balance it measured itself) is refused before its stages start.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, replace
from typing import Any, Sequence

from torch import nn

from pipeq.control.main_guard import stage_pickle

__all__ = ["MadeStages"]


def _layout(module: nn.Module) -> str:
    """Stage ``module`` in a line: how many tensors its state holds, its first and last names."""
    names = list(module.state_dict())
    if not names:
        return f"{type(module).__name__}, no tensors"
    return f"{len(names)} tensors, {names[0]} .. {names[-1]}"


@dataclass(frozen=True)
class MadeStages:
    """The stages a job's stages function returned, each pickled (``pickles[k]``; None: not held
    here, or a stage that does not pickle, which its process builds itself as before)."""

    layout: tuple[str, ...]  # stage k in a line (see _layout): what the nodes compare
    split_points: tuple[str, ...] | None  # where pipeq.split cut, when the function returned its Split
    pickles: tuple[bytes | None, ...]

    @classmethod
    def of(cls, stages: Sequence[nn.Module]) -> "MadeStages":
        points = getattr(stages, "split_points", None)
        try:
            pickles: tuple[bytes | None, ...] = tuple(stage_pickle(s) for s in stages)
        except (pickle.PicklingError, TypeError, AttributeError):  # each stage process builds its own
            pickles = (None,) * len(stages)
        return cls(tuple(_layout(s) for s in stages), tuple(points) if points is not None else None, pickles)

    def __len__(self) -> int:
        return len(self.layout)

    def has(self, k: int) -> bool:
        """Whether stage ``k`` is held here (else its process calls the stages function)."""
        return self.pickles[k] is not None

    def module(self, k: int) -> nn.Module:
        """A fresh copy of stage ``k`` (every call its own, as a new call of the function made)."""
        data = self.pickles[k]
        if data is None:
            raise ValueError(f"stage {k} is not held here")
        return pickle.loads(data)  # bytes this process pickled, or its parent handed it at start

    def only(self, k: int) -> "MadeStages":
        """These stages holding stage ``k``'s bytes only (what stage k's process is handed)."""
        return replace(self, pickles=tuple(p if i == k else None for i, p in enumerate(self.pickles)))

    def describe(self) -> dict[str, Any]:
        """Plain data: what two nodes of a multi-host run compare."""
        return {"stages": list(self.layout), "split_points": list(self.split_points) if self.split_points else None}
