"""Split by module names: each stage is a copy of the model that keeps only its own modules."""

from __future__ import annotations

import copy
import difflib
from typing import Any, Sequence

from torch import nn

from pipeq.stage.info import set_info

__all__ = ["split_by_names"]

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _check(model: nn.Module, modules: Any) -> list[list[str]]:
    if (not isinstance(modules, (list, tuple)) or not modules
            or not all(isinstance(s, (list, tuple)) and s and all(type(n) is str for n in s) for s in modules)):
        raise ValueError("modules must list each stage's module names, e.g. [['tok_emb', 'blocks.0'], "
                         f"['blocks.1', 'norm', 'lm_head']], got {modules!r}")
    known = dict(model.named_modules())
    seen: dict[str, int] = {}
    for k, names in enumerate(modules):
        for name in names:
            if name not in known or name == "":
                close = difflib.get_close_matches(name, [n for n in known if n], n=3)
                raise ValueError(f"stage {k}: {type(model).__name__} has no module {name!r}"
                                 + (f"; did you mean {', '.join(map(repr, close))}?" if close else ""))
            for other, j in seen.items():
                if name == other or name.startswith(other + ".") or other.startswith(name + "."):
                    raise ValueError(f"module {name!r} (stage {k}) overlaps {other!r} (stage {j}): every module "
                                     "belongs to one stage")
            seen[name] = k
    kept = list(seen)
    orphans = [n for n, _ in model.named_parameters(remove_duplicate=False)
               if not any(n.startswith(m + ".") for m in kept)]
    if orphans:
        raise ValueError(f"no stage holds {', '.join(orphans[:4])}{' ...' if len(orphans) > 4 else ''}: "
                         "name the modules that hold every parameter (a parameter held by the model itself, "
                         "outside any submodule, cannot be split by name: move it into a module)")
    return [list(s) for s in modules]


def _stage(model: nn.Module, keep: Sequence[str], inputs: Sequence[str]) -> nn.Module:
    """A deep copy of ``model`` holding only ``keep`` (and the modules on the way to them)."""
    memo: dict[int, Any] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if not name or any(name == k or name.startswith(k + ".") or k.startswith(name + ".") for k in keep):
            continue
        memo[id(m)] = None
    stage = copy.deepcopy(model, memo)
    for m in stage.modules():
        for key, child in list(m._modules.items()):
            if child is None and isinstance(m, CONTAINERS):
                del m._modules[key]  # iterating the container skips it; the others keep their names
    return set_info(stage, model_names=True, inputs=tuple(inputs))


def split_by_names(model: nn.Module, modules: Any, inputs: Sequence[str] = ()) -> list[nn.Module]:
    """One stage per list of ``modules``: a deep copy of ``model`` without the other stages'
    modules (an attribute becomes None; a ModuleList, Sequential or ModuleDict entry is removed,
    the others keeping their names). Each stage runs ``model.forward``, which must skip what is
    missing and take the stage before's output in place of the model's input, as torchtitan's
    models do: ``h = self.tok_emb(idx) if self.tok_emb is not None else idx``."""
    return [_stage(model, keep, inputs) for keep in _check(model, modules)]
