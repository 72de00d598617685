"""A batch given as a dict of the model's inputs (a tokenizer's ``BatchEncoding``), matched to the stages in the driver.

``runner.step({"input_ids": ids, "attention_mask": mask}, y)``: each key is the name of an input
of the model, and goes where that input goes, before anything is sent to a stage:

- a key that some stage declares as an input (``pipeq_stage.inputs``: ``pipeq.split``'s example
  keyword inputs) goes to the stages that take it, as if given in ``stage_inputs``;
- the other keys are stage 0's positional inputs, in its forward's order (a traced split's: the
  model's positional inputs; else ``forward``'s parameters): x is the one value, or a tuple of
  them. They must be the first parameters of that order, none missing in between (give a later
  one as a stage input: ``pipeq.split(model, (ids,), {"attention_mask": m, "position_ids": p})``).

Anything else is refused with a ValueError saying which keys the stages take. A plain ``dict`` none
of whose keys names such an input stays what it was, stage 0's one argument (a forward taking a
dict), except where stage 0 takes tensors only: a traced split's, or a forward whose first
parameter is annotated as a tensor (a Hugging Face model's ``input_ids``). With a recipe (the stages
built in their processes) stage 0's forward is not known here: the one key that no stage declares
is x, more are refused (give x as a tuple).

:meth:`DictBatch.output` does the reverse for ``predict``: the last stage's output arrives as a
plain tree (a dict for a ``ModelOutput``), rebuilt as the model's class when the stage says which
(``pipeq_stage.returns``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Sequence

from torch import nn

from pipeq.stage import microbatch
from pipeq.stage.info import info_of
from pipeq.stage.microbatch import Microbatches

__all__ = ["DictBatch", "stage0_inputs"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def stage0_inputs(module: nn.Module | None) -> tuple[tuple[str, ...] | None, bool, bool]:
    """Stage 0's positional inputs by name, in order (None: unknown), whether it may take a dict
    as its one argument, and whether it needs every one of them (a traced split's stage 0)."""
    if module is None:
        return None, True, False
    receives = getattr(module, "model_inputs", None)  # pipeq.split's stage 0 (GraphStage.model_inputs)
    if isinstance(receives, tuple) and receives:
        return receives, False, True
    try:
        params = [p for p in inspect.signature(module.forward).parameters.values() if p.kind in _POSITIONAL]
    except (TypeError, ValueError):
        return None, True, False
    tensor = bool(params) and "Tensor" in str(params[0].annotation)  # input_ids: torch.LongTensor | None
    return tuple(p.name for p in params), not tensor, False


def _names(names: Sequence[str]) -> str:
    return ", ".join(map(repr, names)) or "none"


class DictBatch:
    """Matches a dict batch to stage 0's positional inputs (``positional``; None: unknown) and the
    stages' declared inputs (``declared``, per stage; None: asked of the running stages), see the
    module; ``takes_dict``: stage 0 may take a dict as its one argument; ``every``: it needs
    every positional input; ``returns``: the class of the model's output (``predict``)."""

    def __init__(self, positional: tuple[str, ...] | None, takes_dict: bool = True, every: bool = False,
                 declared: list[tuple[str, ...]] | None = None, returns: type | None = None) -> None:
        self.positional, self.takes_dict, self.every = positional, takes_dict, every
        self.declared, self.returns = declared, returns

    @classmethod
    def of(cls, modules: Sequence[nn.Module] | None) -> DictBatch:
        """What the driver knows of ``modules`` (None: a recipe builds them in the stage processes)."""
        if not modules:
            return cls(None)
        return cls(*stage0_inputs(modules[0]), [info_of(m).inputs for m in modules], info_of(modules[-1]).returns)

    def match(self, x: Any, given: Any, declared: Sequence[Sequence[str]], where: str = "x") -> tuple[Any, Any]:
        """``(x, stage_inputs)`` with a dict ``x`` matched (see the module); of a batch given as its
        microbatches (:class:`~pipeq.stage.microbatch.Microbatches`), each dict microbatch with its
        own ``stage_inputs``; anything else as it is."""
        if isinstance(x, Microbatches):
            return self._match_each(x, given, declared, where)
        if not isinstance(x, Mapping) or not all(type(k) is str for k in x):
            return x, given  # (a dict with other keys is refused as every batch is: pipeq.tree)
        known = {n for names in declared for n in names}
        if type(x) is dict and self.takes_dict and not set(x) & (known | set(self.positional or ())):
            return x, given
        x = dict(x)
        microbatch.check(where, x)  # refused as any batch is (a tensor without samples...), before its keys
        inputs = {k: v for k, v in x.items() if k in known}
        rest = [k for k in x if k not in known]
        value = self._positional(x, rest, known, where)
        return value, self._merged(given, inputs, where)

    def _match_each(self, x: Microbatches, given: Any, declared: Sequence[Sequence[str]],
                    where: str) -> tuple[Any, Any]:
        each = given if isinstance(given, Microbatches) and len(given) == len(x) else None
        if not any(isinstance(v, Mapping) for v in x) or (given is not None and each is None):
            return x, given  # (stage_inputs that do not fit the microbatches: refused as they are routed)
        pairs = [self.match(v, each[j] if each is not None else None, declared, f"{where} (microbatch {j})")
                 for j, v in enumerate(x)]
        inputs = [g for _, g in pairs]
        return (Microbatches(v for v, _ in pairs),
                Microbatches(inputs) if any(g is not None for g in inputs) else None)

    def _positional(self, x: Mapping[str, Any], rest: list[str], known: set[str], where: str) -> Any:
        takes = (f"stage 0 takes {_names([n for n in self.positional if n not in known])} positionally"
                 if self.positional is not None else "stage 0's forward is built in its process")
        takes += f", the stages take {_names(sorted(known))} as stage inputs"
        if self.positional is None:
            if len(rest) != 1:
                raise ValueError(f"{where} is a dict with the keys {_names(rest)} besides the stages' inputs ({takes}):"
                                 " give x as a tuple in the order of stage 0's forward, and the rest in stage_inputs")
            return x[rest[0]]
        chosen = []
        for name in self.positional:
            if name not in rest:
                break
            chosen.append(name)
        left = [k for k in rest if k not in chosen]
        if left or not chosen:
            what = (f"gives {_names(left)}, which no stage takes" if left
                    else f"gives none of {_names(self.positional[:1])}")
            late = [k for k in left if k in self.positional]
            if late:
                stop = self.positional[len(chosen)]
                what = (f"gives {_names(late)}, which stage 0's forward takes after {stop!r}, not given positionally"
                        f" (declare {_names(late)} as stage inputs: pipeq.split(model, (x,), {{name: example, ...}}))")
            raise ValueError(f"{where} is a dict that {what}: {takes}; pass a dict of those keys")
        if self.every and len(chosen) != len(self.positional):
            missing = [n for n in self.positional if n not in chosen]
            raise ValueError(f"{where} is a dict without {_names(missing)}: {takes}; pass a dict of those keys")
        return x[chosen[0]] if len(chosen) == 1 else tuple(x[name] for name in chosen)

    @staticmethod
    def _merged(given: Any, inputs: dict[str, Any], where: str) -> Any:
        if not inputs:
            return given
        if given is None or (isinstance(given, Mapping) and not given):
            return inputs
        if not isinstance(given, Mapping) or not all(type(k) is str for k in given):
            raise ValueError(f"{where} is a dict holding stage inputs ({_names(list(inputs))}): give stage_inputs by "
                             "name too ({'mask': m}), not by stage index")
        both = [k for k in inputs if k in given]
        if both:
            raise ValueError(f"{_names(both)} is given twice, in {where} and in stage_inputs: give it once")
        return {**given, **inputs}

    def output(self, value: Any) -> Any:
        """``predict``'s joined output as the model returns it: a dict rebuilt as its class."""
        if self.returns is not None and type(value) is dict:
            return self.returns(**value)
        return value
