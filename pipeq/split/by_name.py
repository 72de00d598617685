"""Split by module names: each stage is a copy of the model that keeps only its own modules.

Each stage runs the model's own ``forward``. What a stage holds of the model:

- the modules its list names (and the modules on the way to them);
- the modules no stage lists that hold no state (no parameter, no persistent buffer): rotary
  embeddings, mask builders, activations. They compute from their inputs alike on every stage, so
  every stage keeps a copy. Dropout with ``p > 0`` is the exception: it changes what it is applied
  to, so it must be listed in the stage that applies it (refused otherwise);
- in place of a module another stage holds: ``None`` (a ModuleList, Sequential or ModuleDict entry
  is removed, the others keeping their names), as torchtitan's models expect (``h = self.tok_emb(idx)
  if self.tok_emb is not None else idx``); or, in a Hugging Face model (a ``transformers`` class,
  whose forward calls every module unconditionally), a pass-through (:class:`Elsewhere`): it returns
  its first input. A layer list keeps its pass-throughs, so each layer keeps its index: the forward
  picks a layer's mask by it (``config.layer_types[i]``: sliding-window or full attention). There a stage k > 0 takes the hidden state as the model's first input
  (``input_ids``), the embedding held by stage 0 passes it on (only it: called on any other value,
  as GPT-2 calls its position embedding, it raises, naming the module), and a stage before the
  last stops at the norm and head held after it. Such a stage sends the first tensor of the
  model's output (``logits`` of a ``CausalLMOutputWithPast``: the hidden state), never a cache;
  its ``config.use_cache`` is turned off (a pipeline stage keeps no KV cache).

Given example inputs, :func:`split_by_names` checks that the stages, one after the other, compute
what the model computes on them (eval mode, no gradient), and refuses the split otherwise; a
Hugging Face model must be given them.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
from collections.abc import Mapping
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from pipeq.stage.info import set_info

__all__ = ["split_by_names", "Elsewhere", "own_mapping", "without_cache"]

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def hugging_face(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face model (its class, or one it derives from, is transformers')."""
    return any(c.__module__.partition(".")[0] == "transformers" for c in type(model).__mro__)


def own_mapping(cls: Any) -> type | None:
    """``cls`` when it is a mapping class of its own (a ModelOutput: ``predict`` rebuilds it), else None."""
    return cls if isinstance(cls, type) and issubclass(cls, Mapping) and cls is not dict else None


def _under(name: str, names: Sequence[str]) -> bool:
    return any(name == n or name.startswith(n + ".") for n in names)


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
    orphans = [n for n, _ in model.named_parameters(remove_duplicate=False) if not _under(n, kept)]
    orphans += [n for n in model.state_dict() if "." in n and not _under(n, kept) and n not in orphans]
    if orphans:
        raise ValueError(f"no stage holds {', '.join(orphans[:4])}{' ...' if len(orphans) > 4 else ''}: "
                         "name the modules that hold every parameter and buffer (a parameter held by the model "
                         "itself, outside any submodule, cannot be split by name: move it into a module)")
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and not _under(name, kept):
            raise ValueError(f"no stage lists {name!r} ({m}): a dropout changes what it is applied to, so it "
                             "belongs to the one stage that applies it: add it to that stage's modules")
    return [list(s) for s in modules]


class _Received:
    """What a stage of a Hugging Face model received as its first input, while its forward runs
    (:class:`Elsewhere` passes only that on)."""

    value: Any = None

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.value = args[0] if args else next(iter(kwargs.values()), None)


class Elsewhere(nn.Module):
    """In a stage split by names from a Hugging Face model, the module ``name`` that stage
    ``holder`` holds: it returns its first input. Held by an earlier stage (an embedding), it
    must be called on what this stage received (that stage's result), or it raises."""

    def __init__(self, name: str, holder: int, stage: int, received: _Received, model: str) -> None:
        super().__init__()
        self.name, self.holder, self.stage, self.model = name, holder, stage, model
        object.__setattr__(self, "received", received)  # the stage's, shared (not a child module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        value = args[0] if args else next(iter(kwargs.values()), None)
        if self.holder < self.stage and value is not self.received.value:
            raise ValueError(
                f"stage {self.stage} runs {self.model}.forward, which calls {self.name!r} (held by stage "
                f"{self.holder}) on another value than what stage {self.stage} receives: its result is combined "
                f"with more than the stage before's output, which a split by module names cannot do. Split this "
                f"model traced (pipeq.split(model, (x,), n_stages=...)), or put {self.name!r} with the modules "
                "that use its result")
        return value

    def extra_repr(self) -> str:
        return f"{self.name!r}, held by stage {self.holder}"


class _Handoff:
    """A forward hook on stage ``stage`` of a Hugging Face model: forgets what the stage received
    and, before the last stage, sends the first tensor of the model's output (the hidden state in
    ``logits`` or ``last_hidden_state``; caches and the other fields stay behind)."""

    def __init__(self, received: _Received, stage: int, last: bool) -> None:
        self.received, self.stage, self.last = received, stage, last

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        self.received.value = None
        if self.last or isinstance(output, torch.Tensor):
            return None
        values = output.values() if hasattr(output, "values") else output if isinstance(output, (tuple, list)) else ()
        first = next((v for v in values if isinstance(v, torch.Tensor)), None)
        if first is None:
            raise ValueError(f"stage {self.stage} of {type(module).__name__} returns a {type(output).__name__} "
                             "without a tensor: a stage before the last sends its output's first tensor")
        return first


def _holders(model: nn.Module, modules: list[list[str]]) -> dict[str, list[int]]:
    """Each module of the model that holds state and is no stage's own part, or on the way to
    one, by the stages that hold what is in it (a listed module: its stage)."""
    listed = {name: k for k, names in enumerate(modules) for name in names}
    out: dict[str, list[int]] = {}
    for name, m in model.named_modules():
        if name in listed:
            out[name] = [listed[name]]
        elif name and not _under(name, list(listed)) and m.state_dict():
            out[name] = sorted({k for n, k in listed.items() if n.startswith(name + ".")})
    return out


def _stage(model: nn.Module, modules: list[list[str]], k: int, holders: dict[str, list[int]],
           inputs: Sequence[str]) -> nn.Module:
    """Stage ``k``: a deep copy of ``model`` holding the modules ``modules[k]`` names and those no
    stage holds, the others replaced (see the module)."""
    keep = modules[k]
    hf = hugging_face(model)
    received = _Received()
    memo: dict[int, Any] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if not name or name not in holders or any(n == name or n.startswith(name + ".") for n in keep):
            continue  # its own, on the way to its own, stateless, or inside a module replaced here
        if not hf:
            memo[id(m)] = None
        else:
            memo[id(m)] = Elsewhere(name, min(holders[name]) if min(holders[name]) < k else max(holders[name]), k,
                                    received, type(model).__name__)
    stage = copy.deepcopy(model, memo)
    for m in stage.modules():
        for key, child in list(m._modules.items()):
            if child is None and isinstance(m, CONTAINERS):
                del m._modules[key]  # iterating the container skips it; the others keep their names
    if hf:
        if getattr(getattr(stage, "config", None), "use_cache", None):
            stage.config.use_cache = False
        stage.register_forward_pre_hook(received, with_kwargs=True)
        stage.register_forward_hook(_Handoff(received, k, k == len(modules) - 1))
    return set_info(stage, model_names=True, inputs=tuple(inputs))


@contextlib.contextmanager
def without_cache(model: nn.Module) -> Iterator[None]:
    """``model.config.use_cache`` (a Hugging Face model's KV cache) off meanwhile, then restored."""
    config = getattr(model, "config", None)
    was = getattr(config, "use_cache", None)
    if was:
        config.use_cache = False
    try:
        yield
    finally:
        if was:
            config.use_cache = was


@contextlib.contextmanager
def _evaluating(*modules: nn.Module) -> Iterator[None]:
    """``modules`` in eval mode, without gradients or drawing from the RNG; their modes restored."""
    modes = [(m, m.training) for module in modules for m in module.modules()]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for module in modules:
                module.eval()
            yield
    finally:
        for m, training in modes:
            m.training = training


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` (tuples, lists and dicts walked; anything else, a cache, skipped)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict) or hasattr(value, "values") and hasattr(value, "keys"):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _verify(model: nn.Module, stages: list[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The stages chained on the example compute the model's output (a ValueError otherwise);
    returns that output."""
    with _evaluating(model, *stages), without_cache(model):
        want = model(*args, **kwargs)
        value: Any = args
        for stage in stages:
            out = stage(*value, **kwargs)
            value = out if isinstance(out, tuple) else (out,)
    a, b = _tensors(want), _tensors(out)
    worst = max(((x - y).abs().max().item() for x, y in zip(a, b) if x.shape == y.shape), default=0.0)
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)) or not all(
            torch.allclose(x.float(), y.float(), rtol=1e-4, atol=1e-5) for x, y in zip(a, b)):
        raise ValueError(
            f"the stages split by module names do not compute {type(model).__name__}.forward on the example "
            f"(output {', '.join(str(tuple(t.shape)) for t in b)} against {', '.join(str(tuple(t.shape)) for t in a)}"
            f", largest difference {worst:.3g}): its forward does more between two stages' modules than pass the "
            "hidden state on (a scale or a sum after the embedding, a transform after the head). Split it traced "
            "(pipeq.split(model, (x,), n_stages=...)), or move those modules together")
    return want


def split_by_names(model: nn.Module, modules: Any, inputs: Sequence[str] = (), example: tuple[Any, ...] = (),
                   example_kwargs: dict[str, Any] | None = None) -> list[nn.Module]:
    """One stage per list of ``modules`` (see the module), each declaring the keyword ``inputs``;
    checked on ``example`` (the model's positional inputs) and ``example_kwargs`` when given."""
    names = _check(model, modules)
    if hugging_face(model) and not example:
        raise ValueError(f"pass an example input to split {type(model).__name__} by module names: "
                         "pipeq.split(model, (input_ids,), {'attention_mask': mask}, modules=[...]); the stages "
                         "are checked against the model on it")
    holders = _holders(model, names)
    stages = [_stage(model, names, k, holders, inputs) for k in range(len(names))]
    if example:
        out = _verify(model, stages, example, dict(example_kwargs or {}))
        set_info(stages[-1], returns=own_mapping(type(out)))
    return stages
