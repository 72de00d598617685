"""What a stage module says of itself besides its weights: its tensors' names, the inputs it takes, its tied weights.

A stage made by :func:`pipeq.split` (or given ``ties=`` by the runner) carries a
:class:`StageInfo` as its ``pipeq_stage`` attribute. It travels with the module (pickled to
its process, or built there by a recipe), so the stage process, the driver and checkpoints all
read the same facts:

- ``model_names``: the module's ``state_dict()`` keys are the whole model's own names
  (``"blocks.2.attn.qkv.weight"``), not the flat model's (``"5.attn.qkv.weight"``, see
  :mod:`pipeq.checkpoint.names`);
- ``inputs``: keyword arguments of its ``forward`` that the driver hands it with every microbatch
  (``runner.step(x, y, stage_inputs={"mask": m})``), beside what the previous stage sends;
- ``ties``: parameters it holds a copy of, shared with other stages (tied embeddings): their
  gradients are summed over every stage holding one before each optimizer step, so the
  copies stay bitwise equal, and checkpoints hold the tensor once, under ``key``;
- ``returns`` (the last stage): the class of the model's output when it is a mapping of its own
  (a Hugging Face ``ModelOutput``): the driver rebuilds ``predict``'s result as one from the dict
  the stage sends (the wire carries plain trees).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from collections.abc import Mapping
from typing import Sequence

from torch import nn

__all__ = ["Tie", "StageInfo", "ATTRIBUTE", "info_of", "set_info"]

#: The stage module's attribute that holds its :class:`StageInfo`.
ATTRIBUTE = "pipeq_stage"


@dataclass(frozen=True)
class Tie:
    """One parameter of this stage that other stages hold a copy of.

    ``name``: its name in this stage module (``named_parameters``); ``key``: the name the whole
    model keeps it under (the first of its names; checkpoints and ``state_dict`` hold it once,
    there); ``stages``: every stage that holds a copy, in increasing order (this one included).
    """

    name: str
    key: str
    stages: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.stages) < 2 or list(self.stages) != sorted(set(self.stages)):
            raise ValueError(f"tie {self.key!r}: stages must be two or more distinct stages in increasing "
                             f"order, got {self.stages!r}")

    @property
    def owner(self) -> int:
        """The stage whose copy a checkpoint saves (the first)."""
        return self.stages[0]


@dataclass(frozen=True)
class StageInfo:
    """What a stage module says of itself (see the module)."""

    model_names: bool = False
    inputs: tuple[str, ...] = ()
    ties: tuple[Tie, ...] = ()
    returns: type | None = None

    def __post_init__(self) -> None:
        if self.returns is not None and not (isinstance(self.returns, type) and issubclass(self.returns, Mapping)
                                             and self.returns is not dict):
            raise ValueError(f"a stage's returns is the model's own mapping class (a ModelOutput), "
                             f"got {self.returns!r}")
        if not all(type(n) is str and n.isidentifier() for n in self.inputs):
            raise ValueError(f"a stage's inputs are keyword argument names, got {self.inputs!r}")
        names = [t.name for t in self.ties]
        if len(set(names)) != len(names):
            raise ValueError(f"a parameter is tied twice: {sorted(names)}")


def info_of(module: nn.Module) -> StageInfo:
    """``module``'s :class:`StageInfo` (the default one when it carries none)."""
    info = getattr(module, ATTRIBUTE, None)
    if info is None:
        return StageInfo()
    if not isinstance(info, StageInfo):
        raise ValueError(f"{type(module).__name__}.{ATTRIBUTE} must be a pipeq.StageInfo, "
                         f"got {type(info).__name__}")
    return info


def set_info(module: nn.Module, *, model_names: bool | None = None, inputs: Sequence[str] | None = None,
             ties: Sequence[Tie] | None = None, returns: type | None = None) -> nn.Module:
    """Set (some of) ``module``'s :class:`StageInfo`, keeping the rest; returns ``module``."""
    info = info_of(module)
    changes: dict = {}
    if model_names is not None:
        changes["model_names"] = model_names
    if inputs is not None:
        changes["inputs"] = tuple(inputs)
    if ties is not None:
        changes["ties"] = tuple(ties)
    if returns is not None:
        changes["returns"] = returns
    object.__setattr__(module, ATTRIBUTE, replace(info, **changes))
    return module
