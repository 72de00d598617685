"""The global names of a pipeline's tensors: those of the flat model its stages make.

Everything is named by *global* names, those of the flat model ``nn.Sequential(*layers)``
(:func:`flat_model`), where a stage that is an ``nn.Sequential`` contributes each of its children
as one layer and any other stage module contributes itself as one layer. Stage k's ``offset`` is
the number of layers of stages 0..k-1; its local ``"i.rest"`` is global ``f"{offset + i}.rest"``
(sequential) and its local ``"rest"`` is ``f"{offset}.rest"`` (otherwise). The same flat model cut
another way maps to the same names, so 3 stages load into 2. ``runner.state_dict()``,
``runner.load_state_dict()``, checkpoints and ``pipeq launch``'s model.pt all use these names
(:func:`global_state`, :func:`split_state`).

Two kinds of stage name their tensors otherwise (:class:`StageNames` says how one stage's names
read): a stage whose :class:`~pipeq.StageInfo` says ``model_names`` contributes its
local names unchanged (they are the whole model's own names, no flat offset), and a tied
parameter (``StageInfo.ties``), of which every stage holding it has a copy, is held once, under
its tie's key, taken from its owner (the first stage holding it); loading hands that one tensor
to every copy. (Each copy's optimizer state is its stage's: checkpoints keep it under the copy's
own name.) A stage module that names one tensor twice (two local aliases) loads the second name
from the first's entry when the state holds only that one.

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

from pipeq.stage.info import ATTRIBUTE, info_of

__all__ = ["StageLayout", "StageNames", "is_sequential", "positional", "layers_of", "dtype_name", "naming_of", "layout_of",
           "flat_model", "layer_of", "to_global", "AUX_PREFIX", "aux_name", "global_names", "global_state",
           "split_state", "tie_aliases"]


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
    names_global: bool = False  # StageInfo.model_names: the local names are the model's, no flat offset
    ties: dict[str, str] = field(default_factory=dict)  # every local name of a tied parameter -> its tie's key
    tie_stages: dict[str, list[int]] = field(default_factory=dict)  # tie key -> the stages holding a copy
    aliases: dict[str, str] = field(default_factory=dict)  # a second local name of a tensor -> its first

    def names(self, index: int, offset: int) -> "StageNames":
        """How this stage's names read, as stage ``index`` starting at layer ``offset``."""
        return StageNames(index, offset, self.sequential, self.names_global, self.ties, self.tie_stages)


@dataclass(frozen=True)
class StageNames:
    """How stage ``index``'s local names read in the whole model's state (it starts at layer
    ``offset`` of the flat model; see the module and :func:`naming_of` for the rest)."""

    index: int
    offset: int
    sequential: bool
    names_global: bool = False
    ties: Mapping[str, str] = field(default_factory=dict)
    tie_stages: Mapping[str, Sequence[int]] = field(default_factory=dict)

    def own(self, local: str) -> str:
        """The global name of this stage's own tensor ``local`` (and of its optimizer state)."""
        return local if self.names_global else to_global(local, self.offset, self.sequential)

    def model(self, local: str) -> str:
        """The name the model's state holds ``local`` under: a tied copy's tie key, else :meth:`own`."""
        key = self.ties.get(local)
        return key if key is not None else self.own(local)

    def saved(self, names: Iterable[str]) -> list[tuple[str, str]]:
        """``(local, model name)`` of the ``names`` the model's state takes from this stage: every
        untied one, and each tie once, from its owner (the first stage holding a copy)."""
        out, seen = [], set()
        for name in names:
            key = self.ties.get(name)
            if key is not None:
                stages = self.tie_stages.get(key)
                if key in seen or (stages and stages[0] != self.index):
                    continue
                seen.add(key)
            out.append((name, self.model(name)))
        return out


def is_sequential(module: nn.Module) -> bool:
    """Whether the stage contributes its children as layers: an ``nn.Sequential`` whose state
    all lives in its children (one with parameters or buffers of its own is one layer)."""
    return isinstance(module, nn.Sequential) and all(
        name.partition(".")[0].isdigit() for name in module.state_dict())


def positional(module: nn.Module) -> nn.Module:
    """A plain nn.Sequential stage whose children are not named 0, 1, ... (a slice ``model[2:4]``
    keeps the names 2, 3) as one that names them so, holding the same children: :func:`to_global`
    counts a stage's layers from its first, so the sliced names would be counted twice. Any other
    stage (one that declares its names with a StageInfo among them) as it is."""
    if (type(module) is not nn.Sequential or getattr(module, ATTRIBUTE, None) is not None
            or list(module._modules) == [str(i) for i in range(len(module))]):
        return module
    renamed = nn.Sequential(*module)
    renamed.training = module.training  # the children keep their own modes
    return renamed


def layers_of(module: nn.Module) -> int:
    """How many layers of the flat model this stage module is."""
    return len(module) if is_sequential(module) else 1


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as a checkpoint's layout names it: ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def naming_of(module: nn.Module) -> dict[str, Any]:
    """How the stage module's names read beyond layers (:class:`StageLayout`'s fields
    ``names_global``, ``ties``, ``tie_stages`` and ``aliases``), from its
    :class:`~pipeq.StageInfo` and the tensors it names twice."""
    info = info_of(module)
    sd = module.state_dict(keep_vars=True)
    first: dict[int, str] = {}
    aliases = {}
    for name, t in sd.items():
        if first.setdefault(id(t), name) != name:
            aliases[name] = first[id(t)]
    params = dict(module.named_parameters())
    ties = {}
    for tie in info.ties:
        p = params.get(tie.name)
        ties.update((name, tie.key) for name, t in sd.items() if p is not None and t is p)
    return {"names_global": info.model_names, "ties": ties,
            "tie_stages": {tie.key: list(tie.stages) for tie in info.ties}, "aliases": aliases}


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
        **naming_of(module),
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
"""The prefix of the auxiliary heads' names in a state (interlocking schedules)."""


def aux_name(stage: int, local: str) -> str:
    """Stage ``stage``'s auxiliary head's ``local`` name as a checkpoint holds it."""
    return f"{AUX_PREFIX}.{stage}.{local}"


def global_names(layouts: Sequence[StageLayout]) -> list[list[str]]:
    """Each stage's model names (in order) under the names the model's state holds them by
    (a tied copy's: its tie's key)."""
    out, offset = [], 0
    for k, lay in enumerate(layouts):
        names = lay.names(k, offset)
        out.append([names.model(name) for name in lay.model_names])
        offset += lay.layers
    return out


def global_state(per_stage: Sequence[tuple[Sequence[str], Sequence[torch.Tensor]]],
                 layouts: Sequence[StageLayout]) -> "collections.OrderedDict[str, torch.Tensor]":
    """Each stage's (local names, tensors) as one state_dict under global names, in the flat
    model's order (what ``runner.state_dict()`` returns; a tied parameter once, see the module)."""
    out: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
    offset = 0
    for k, ((names, tensors), lay) in enumerate(zip(per_stage, layouts)):
        by_name = dict(zip(names, tensors))
        for name, key in lay.names(k, offset).saved(names):
            out[key] = by_name[name]
        offset += lay.layers
    return out


def _optional(layouts: Sequence[StageLayout], required: set[str]) -> set[str]:
    """The names a state may hold beside the ``required`` ones: a tied copy's own name, and a
    second name of a tensor (its first's entry loads it)."""
    out, offset = set(), 0
    for k, lay in enumerate(layouts):
        names = lay.names(k, offset)
        out |= {names.own(n) for n in lay.model_names if n in lay.ties} | {names.model(n) for n in lay.aliases}
        offset += lay.layers
    return out - required


def tie_aliases(layouts: Sequence[StageLayout]) -> dict[str, str]:
    """Every other name of a tensor the model's state holds once (a tied copy's own global name,
    a stage's second name of one tensor) -> the name it is held under: what the unsplit model's
    ``state_dict()`` has beside it (``lm_head.weight`` -> ``tok_emb.weight``)."""
    out: dict[str, str] = {}
    offset = 0
    for k, lay in enumerate(layouts):
        names = lay.names(k, offset)
        for local in lay.model_names:
            held = names.model(lay.aliases.get(local, local))
            own = names.own(local)
            if own != held:
                out[own] = held
        offset += lay.layers
    return out


def split_state(state: Mapping[str, torch.Tensor], layouts: Sequence[StageLayout]
                ) -> list[tuple[list[str], list[torch.Tensor]]]:
    """A state_dict under global names as each stage's (local names, tensors), every key and
    shape checked before anything is loaded (a ``ValueError`` naming the key otherwise). A tied
    parameter's one entry (under its key) goes to every stage holding a copy; a tied copy's own
    name, or a second name of one tensor, may be there too (it is not read).

    Also accepted, for state_dicts of earlier pipeq versions and of ``nn.Sequential(*stages)``:
    stage-prefixed names ``f"{k}.{local}"``, when the keys are exactly those.
    """
    flat = global_names(layouts)
    prefixed = [[f"{k}.{name}" for name in lay.model_names] for k, lay in enumerate(layouts)]
    keys = set(state)
    want_flat = {g for k, names in enumerate(flat) for g, n in zip(names, layouts[k].model_names)
                 if n not in layouts[k].aliases}
    optional = _optional(layouts, want_flat)
    want_prefixed = {g for names in prefixed for g in names}
    if want_flat <= keys <= want_flat | optional:
        chosen = flat
    elif keys == want_prefixed:
        chosen = prefixed
    else:  # report against the naming the keys are closer to
        chosen, want = ((prefixed, want_prefixed) if len(keys & want_prefixed) > len(keys & want_flat)
                        else (flat, want_flat))
        raise ValueError(
            f"state_dict does not fit these {len(layouts)} stages: missing keys {sorted(want - keys)}, "
            f"unexpected keys {sorted(keys - want - optional)} (keys are the flat model's names, as "
            "runner.state_dict() and pipeq.checkpoint.flat_model(stages).state_dict() give them)")
    per_stage = []
    for k, (lay, keys_k) in enumerate(zip(layouts, chosen)):
        key_of = dict(zip(lay.model_names, keys_k))
        tensors = []
        for name, key in zip(lay.model_names, keys_k):
            if key not in state and name in lay.aliases:
                key = key_of[lay.aliases[name]]
            t = state[key]
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"state_dict['{key}'] is a {type(t).__name__}, not a tensor")
            shape = lay.shapes.get(name)
            if shape is not None and list(t.shape) != list(shape):
                raise ValueError(f"state_dict['{key}'] has shape {tuple(t.shape)}, stage {k} expects {tuple(shape)}")
            tensors.append(t.detach().cpu())
        per_stage.append((list(lay.model_names), tensors))
    return per_stage
