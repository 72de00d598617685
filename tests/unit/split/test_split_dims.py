"""pipeq.split's dynamic dimensions: every input dimension the model lets vary (the batch, the
sequence length) stays dynamic by default; ``dynamic=`` fixes or names them; ``Split.dynamic`` /
``Split.static`` say what the trace did; a named dimension the model fixes is refused with
torch's reason."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn
from torch.export import Dim

import pipeq
from pipeq.split import SpecializedDim
from pipeq.split.dims import requested
from pipeq.stage.info import info_of
from split_models import TinyGPT, lm_loss

AUTO = Dim.AUTO


class Feature(nn.Module):
    """(B, T, 8) features through two Linear layers: the feature dim is the model's to fix."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h if scale is None else h * scale)


def _chain(stages, x, named):
    value = (x,)
    for s in stages:
        value = s(*value, **{n: named[n] for n in info_of(s).inputs})
        value = value if isinstance(value, tuple) else (value,)
    return value[0]


@pytest.fixture(scope="module")
def gpt3():
    """TinyGPT of context 48, positions 0..T-1 (an arange of the length, looked up in a learned
    embedding), traced from an example of length 32 into 3 stages."""
    torch.manual_seed(0)
    model = TinyGPT(context=48, layers=2)
    idx = torch.randint(0, 40, (2, 32))
    return model, pipeq.split(model, (idx,), {"mask": torch.ones(2, 32)}, n_stages=3)


def test_every_input_dimension_the_model_lets_vary_is_dynamic_by_default(gpt3):
    model, stages = gpt3
    assert stages.dynamic == {"idx": {0: (2, None), 1: (2, None)}, "mask": {0: (2, None), 1: (2, None)}}
    assert stages.static == {}
    assert "dynamic={'idx': [0, 1], 'mask': [0, 1]}" in repr(stages)
    # the batch and the length travel to the later stages as sizes (0-d tensors), next to activations
    assert all(s.flow.int_inputs for s in stages[1:])


@pytest.mark.parametrize("T", [17, 40, 48, 2])
def test_the_traced_stages_run_lengths_other_than_the_examples(gpt3, T):
    """Lengths up to the context (positions 0..T-1 in the embedding), shorter and longer than the
    example's, down to 2 (where the trace's range starts): outputs and every gradient equal the
    model's."""
    model, stages = gpt3
    g = torch.Generator().manual_seed(T)
    idx, target = torch.randint(0, 40, (3, T), generator=g), torch.randint(0, 40, (3, T), generator=g)
    mask = (torch.rand(3, T, generator=g) > 0.2).float()
    model.zero_grad()
    for s in stages:
        s.zero_grad()
    want = lm_loss(model(idx, mask), target)
    want.backward()
    got = lm_loss(_chain(stages, idx, {"mask": mask}), target)
    got.backward()
    assert torch.allclose(got, want, atol=1e-6)
    params = dict(model.named_parameters(remove_duplicate=False))
    grads: dict[str, torch.Tensor] = {}
    for s in stages:
        for name, p in s.named_parameters():
            grads[name] = grads.get(name, 0) + p.grad
    tied = grads.pop("lm_head.weight", 0)
    grads["tok_emb.weight"] = grads["tok_emb.weight"] + tied
    for name, g in grads.items():
        assert torch.allclose(g, params[name].grad, atol=1e-5), name


def _devices_in_code(stage):
    graphs = [stage._graph] + ([stage._eval] if stage._eval is not None else [])
    return {str(n.kwargs["device"]) for g in graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if "device" in n.kwargs}


def test_the_devices_the_trace_burnt_in_follow_the_stage_to_its_device(gpt3):
    """Positions ``torch.arange(T, device=idx.device)`` of a dynamic length trace to an arange
    node on the trace's device (the CPU): a stage placed on another device (``.to``, in its stage
    process after unpickling) runs it there (on CUDA it failed: index on cpu, weights on cuda:0)."""
    _, stages = gpt3
    assert _devices_in_code(stages[0]) == {"cpu"}
    stage = pickle.loads(pickle.dumps(stages[0])).to("meta")
    assert _devices_in_code(stage) == {"meta"}
    out = stage(torch.randint(0, 40, (2, 9), device="meta"), mask=torch.ones(2, 9, device="meta"))
    assert {t.device.type for t in out if t.dim()} == {"meta"}  # the sizes (0-d) stay on the CPU
    assert _devices_in_code(stage.to_empty(device="cpu")) == {"cpu"}


def test_dynamic_false_keeps_only_the_batch_dynamic():
    torch.manual_seed(0)
    model = TinyGPT(context=48, layers=1)
    idx = torch.randint(0, 40, (2, 32))
    stages = pipeq.split(model, (idx,), {"mask": torch.ones(2, 32)}, n_stages=2, dynamic=False)
    assert stages.dynamic == {"idx": {0: (2, None)}, "mask": {0: (2, None)}}
    assert stages.static == {"idx": {1: 32}, "mask": {1: 32}}
    _chain(stages, torch.randint(0, 40, (5, 32)), {"mask": torch.ones(5, 32)})  # another batch size
    with pytest.raises(ValueError, match="input 'idx' has size 24 in dim 1, but the trace fixed that dimension at 32"):
        _chain(stages, torch.randint(0, 40, (2, 24)), {"mask": torch.ones(2, 24)})


def test_a_dimension_the_model_fixes_is_static_and_said():
    stages = pipeq.split(Feature(), (torch.randn(2, 5, 8),), {"scale": torch.ones(2, 5, 1)}, n_stages=2)
    assert stages.dynamic == {"x": {0: (2, None), 1: (2, None)}, "scale": {0: (2, None), 1: (2, None)}}
    assert stages.static == {"x": {2: 8}, "scale": {2: 1}}  # the Linear's 8; the example's 1 (broadcast)
    assert stages.explain().splitlines() == [
        "x: dim 0 varies (2..); dim 1 varies (2..); dim 2 fixed at 8: the model's code fixes it",
        "scale: dim 0 varies (2..); dim 1 varies (2..); dim 2 fixed at 1: the example has size 1 there "
        "(torch.export fixes sizes 0 and 1)"]
    assert _chain(stages, torch.randn(3, 9, 8), {"scale": torch.ones(3, 9, 1)}).shape == (3, 9, 3)


@pytest.mark.parametrize("named", [Dim("features"), Dim.DYNAMIC])
def test_a_dimension_named_dynamic_that_the_model_fixes_is_refused_with_torchs_reason(named):
    with pytest.raises(SpecializedDim, match=r"x dim 2 to stay dynamic.*constant \(8\)"):
        pipeq.split(Feature(), (torch.randn(2, 5, 8),), n_stages=2, dynamic={"x": {2: named}})


def test_a_named_length_keeps_its_range_and_the_rest_its_default():
    seq = Dim("seq", max=48)
    stages = pipeq.split(Feature(), (torch.randn(2, 5, 8),), n_stages=2, dynamic={"x": {1: seq}})
    assert stages.dynamic == {"x": {0: (2, None), 1: (0, 48)}}
    stages = pipeq.split(Feature(), (torch.randn(2, 5, 8),), n_stages=2, dynamic={"x": {0: None}})
    assert stages.dynamic == {"x": {1: (2, None)}} and stages.static == {"x": {0: 2, 2: 8}}
    assert stages.why_static == {"x": {0: "dynamic= fixes it", 2: "the model's code fixes it"}}


def test_requested_shapes_by_default_false_and_per_dimension():
    m, x, s = Feature(), torch.randn(2, 5, 8), torch.ones(1, 5, 1)
    assert requested(m, (x,), {"scale": s}, None).shapes == {"x": {0: AUTO, 1: AUTO, 2: AUTO}, "scale": {1: AUTO}}
    assert requested(m, (x,), {"scale": s}, True).shapes == requested(m, (x,), {"scale": s}, None).shapes
    assert requested(m, (x,), {"scale": s}, False).shapes == {"x": {0: AUTO}, "scale": {0: AUTO}}
    seq = Dim("seq")
    got = requested(m, (x,), {"scale": s}, {"x": {-2: seq, 2: None}, "scale": None})
    assert got.shapes == {"x": {0: AUTO, 1: seq}, "scale": None} and got.required == [("x", 1, seq)]
    assert requested(m, (x, None), {}, None).shapes == {"x": {0: AUTO, 1: AUTO, 2: AUTO}, "scale": None}


@pytest.mark.parametrize("dynamic, message", [
    ({"y": None}, r"names 'y', not among the inputs of Feature.forward .*\(x\)"),
    ({"x": {3: None}}, r"names dim 3, but the example x has 3 dims \(shape \(2, 1, 8\)\)"),
    ({"x": {1: Dim.DYNAMIC}}, r"x dim 1 dynamic, but the example has size 1 there"),
    ({"x": {2: Dim("f", min=9)}}, r"x dim 2 the range 9\.\..*example has size 8"),
    ("yes", r"dynamic= takes True, False or a dict"),
])
def test_bad_dynamic_arguments_say_what_to_pass(dynamic, message):
    with pytest.raises(ValueError, match=message):
        pipeq.split(Feature(), (torch.randn(2, 1, 8),), n_stages=2, dynamic=dynamic)


def test_dynamic_is_for_a_traced_split():
    with pytest.raises(ValueError, match="do not pass n_stages, split_points, balance or dynamic"):
        pipeq.split(Feature(), modules=[["a"], ["b"]], dynamic=False)


def test_sizes_outside_what_the_trace_holds_are_refused_naming_the_input_and_the_dimension():
    """A forward may branch on a size of 1 (torch.export traces it apart from the range 2..), so a
    stage refuses a length of 1 rather than compute other numbers than the model's; a length the
    trace fixed is refused naming why (dim 0, the microbatch's rows, takes any size)."""

    class Branches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(10, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            return self.head(h * 2 if h.shape[1] > 1 else h)

    model = Branches()
    stages = pipeq.split(model, (torch.randint(0, 10, (2, 5)),), split_points=["head"])
    x = torch.randint(0, 10, (3, 4))
    assert torch.allclose(stages[1](*stages[0](x)), model(x))
    with pytest.raises(ValueError, match=r"split stage 0: input 'x' has size 1 in dim 1, outside the sizes the "
                                         r"trace holds for it \(2 or more"):
        stages[0](torch.randint(0, 10, (3, 1)))
    fixed = pipeq.split(model, (torch.randint(0, 10, (2, 5)),), split_points=["head"], dynamic=False)
    with pytest.raises(ValueError, match=r"input 'x' has size 4 in dim 1, but the trace fixed that dimension at 5 "
                                         r"\(dynamic= fixes it"):
        fixed[0](x)
    assert fixed[0](torch.randint(0, 10, (1, 5)))[0].shape == (1, 5, 4)  # one row: any microbatch size
