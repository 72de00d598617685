"""The global names of a pipeline's tensors: those of the flat model its stages make.

Everything is named by *global* names, those of the flat model ``nn.Sequential(*layers)``
(:func:`flat_model`), where a stage that is an ``nn.Sequential`` contributes each of its children
as one layer and any other stage module contributes itself as one layer. Stage k's ``offset`` is
the number of layers of stages 0..k-1; its local ``"i.rest"`` is global ``f"{offset + i}.rest"``
(sequential) and its local ``"rest"`` is ``f"{offset}.rest"`` (otherwise). The same flat model cut
another way maps to the same names, so 3 stages load into 2. ``runner.state_dict()``,
``runner.load_state_dict()``, checkpoints and ``pipeq launch``'s model.pt all use these names
(:func:`global_state`, :func:`split_state`).

An interlocking run's auxiliary heads are no layers of the flat model: stage k's head is saved
under ``aux_heads.{k}.{local}`` (:func:`aux_name`; parameters, buffers and their optimizer state),
and loads only into a run of as many stages (a head belongs to its stage's boundary).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

__all__ = ["StageLayout", "is_sequential", "layers_of", "dtype_name", "layout_of", "flat_model", "layer_of",
           "to_global", "AUX_PREFIX", "aux_name", "global_names", "global_state", "split_state"]


@dataclass
class StageLayout:
    """What :func:`pipeq.checkpoint.split` and :func:`split_state` need to know of one current stage (local names)."""

    model_names: list[str]
    param_names: list[str]
    layers: int
    sequential: bool
    shapes: dict[str, list[int]] = field(default_factory=dict)  # model name -> shape (empty: unchecked)
    dtypes: dict[str, str] = field(default_factory=dict)  # model name -> dtype, "float32"
    aux: dict[str, Any] | None = None  # the auxiliary head's layout (these fields of it), if any


def is_sequential(module: nn.Module) -> bool:
    """Whether the stage contributes its children as layers: an ``nn.Sequential`` whose state
    all lives in its children (one with parameters or buffers of its own is one layer)."""
    return isinstance(module, nn.Sequential) and all(
        name.partition(".")[0].isdigit() for name in module.state_dict())


def layers_of(module: nn.Module) -> int:
    """How many layers of the flat model this stage module is."""
    return len(module) if is_sequential(module) else 1


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as a checkpoint's layout names it: ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def layout_of(module: nn.Module) -> StageLayout:
    """What a checkpoint needs to know of this stage module to hand it its part."""
    sd = module.state_dict()
    return StageLayout(
        model_names=list(sd.keys()),
        param_names=[name for name, _ in module.named_parameters()],
        layers=layers_of(module),
        sequential=is_sequential(module),
        shapes={name: list(t.shape) for name, t in sd.items()},
        dtypes={name: dtype_name(t.dtype) for name, t in sd.items()},
    )


def flat_model(stages: Iterable[nn.Module]) -> nn.Sequential:
    """The flat model ``nn.Sequential(*layers)`` of these stages (sharing their modules): its
    ``state_dict()`` keys are the names ``runner.state_dict()``, checkpoints and model.pt use, so
    ``flat_model(stages).load_state_dict(runner.state_dict())`` loads a run into your model."""
    layers: list[nn.Module] = []
    for stage in stages:
        layers += list(stage) if is_sequential(stage) else [stage]
    return nn.Sequential(*layers)


def layer_of(global_: str) -> int:
    """The flat-model layer a global name belongs to."""
    head = global_.split(".", 1)[0]
    if not head.isdigit():
        raise ValueError(f"{global_!r} is not a global name: it must start with a layer number")
    return int(head)


def to_global(local: str, offset: int, sequential: bool) -> str:
    """A stage's ``local`` name as a global name (the stage starts at layer ``offset``)."""
    if not sequential:
        return f"{offset}.{local}"
    head, dot, rest = local.partition(".")
    if not head.isdigit():
        raise ValueError(
            f"{local!r} does not start with a child index; an nn.Sequential stage must hold its "
            "parameters and buffers in its children (or pass sequential=False)"
        )
    return f"{offset + int(head)}{dot}{rest}"


#: The first part of an auxiliary head's names in a checkpoint (see the module docstring).
AUX_PREFIX = "aux_heads"


def aux_name(stage: int, local: str) -> str:
    """Stage ``stage``'s auxiliary head's ``local`` name as a checkpoint holds it."""
    return f"{AUX_PREFIX}.{stage}.{local}"


def global_names(layouts: Sequence[StageLayout]) -> list[list[str]]:
    """Each stage's model names (in order) as global names."""
    out, offset = [], 0
    for lay in layouts:
        out.append([to_global(name, offset, lay.sequential) for name in lay.model_names])
        offset += lay.layers
    return out


def global_state(per_stage: Sequence[tuple[Sequence[str], Sequence[torch.Tensor]]],
                 layouts: Sequence[StageLayout]) -> "collections.OrderedDict[str, torch.Tensor]":
    """Each stage's (local names, tensors) as one state_dict under global names, in the flat
    model's order (what ``runner.state_dict()`` returns)."""
    out: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
    offset = 0
    for (names, tensors), lay in zip(per_stage, layouts):
        for name, t in zip(names, tensors):
            out[to_global(name, offset, lay.sequential)] = t
        offset += lay.layers
    return out


def split_state(state: Mapping[str, torch.Tensor], layouts: Sequence[StageLayout]
                ) -> list[tuple[list[str], list[torch.Tensor]]]:
    """A state_dict under global names as each stage's (local names, tensors), every key and
    shape checked before anything is loaded (a ``ValueError`` naming the key otherwise).

    Also accepted, for state_dicts of earlier pipeq versions and of ``nn.Sequential(*stages)``:
    stage-prefixed names ``f"{k}.{local}"``, when the keys are exactly those.
    """
    flat = global_names(layouts)
    prefixed = [[f"{k}.{name}" for name in lay.model_names] for k, lay in enumerate(layouts)]
    keys = set(state)
    want_flat = {g for names in flat for g in names}
    want_prefixed = {g for names in prefixed for g in names}
    if keys == want_flat:
        chosen = flat
    elif keys == want_prefixed:
        chosen = prefixed
    else:  # report against the naming the keys are closer to
        chosen, want = ((prefixed, want_prefixed) if len(keys & want_prefixed) > len(keys & want_flat)
                        else (flat, want_flat))
        raise ValueError(
            f"state_dict does not fit these {len(layouts)} stages: missing keys {sorted(want - keys)}, "
            f"unexpected keys {sorted(keys - want)} (keys are the flat model's names, as "
            "runner.state_dict() and pipeq.checkpoint.flat_model(stages).state_dict() give them)")
    per_stage = []
    for k, (lay, keys_k) in enumerate(zip(layouts, chosen)):
        tensors = []
        for name, key in zip(lay.model_names, keys_k):
            t = state[key]
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"state_dict['{key}'] is a {type(t).__name__}, not a tensor")
            shape = lay.shapes.get(name)
            if shape is not None and list(t.shape) != list(shape):
                raise ValueError(f"state_dict['{key}'] has shape {tuple(t.shape)}, stage {k} expects {tuple(shape)}")
            tensors.append(t.detach().cpu())
        per_stage.append((list(lay.model_names), tensors))
    return per_stage
