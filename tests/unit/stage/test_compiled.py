"""Compiled stages without stage processes (pipeq.stage.compiled): the ``compile`` setting checked
once, a split stage compiled without a graph break, a compiled stage's split backward, stages and
models compiled before pipeq sees them, the job key's cache in the run directory.

Compiles with torch's ``eager`` / ``aot_eager`` backends (Dynamo and AOTAutograd, no code
generation): what is tested is pipeq's part, in a second or two."""

from __future__ import annotations

import copy
import functools
import os
import warnings

import pytest
import torch
from torch import nn

import pipeq
from compile_cases import BY_NAME, GPT, model
from pipeq.control.assembly import uncompiled
from pipeq.control.config import RunConfig
from pipeq.stage.compiled import CompileOptions, compile_stage, options
from pipeq.stage.executor import StageExecutor
from pipeq.stage.numerics import Numerics
from pipeq.stage.spec import StageSpec


def test_the_setting_is_checked_once_and_names_what_is_wrong():
    assert options(False) is None and options(True) == CompileOptions()
    got = options({"backend": "aot_eager", "cache_dir": "rel/cache"})
    assert got == CompileOptions({"backend": "aot_eager"}, os.path.abspath("rel/cache"))
    assert options({"mark_dynamic": False}) == CompileOptions({}, None, False)
    with pytest.raises(ValueError, match="mark_dynamic must be True or False"):
        options({"mark_dynamic": "no"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['backnd'\]"):
        options({"backnd": "eager"})
    with pytest.raises(ValueError, match="registered backend's name"):
        options({"backend": lambda gm, ex: gm})
    with pytest.raises(ValueError, match="compile must be True, False or a dict"):
        pipeq.PipelineRunner([nn.Linear(2, 2)], nn.MSELoss(), torch.optim.SGD, mode="simulated", compile="yes")
    RunConfig.from_kwargs(compile=True, tensor_parallel=2, data_parallel=2, sharding="fsdp")  # they compose


def _graph_breaks(stage: nn.Module, x: torch.Tensor, whole: bool) -> int:
    """Graph breaks compiling split stage 1 (it receives the batch size as a 0-d tensor): its graph
    (what pipeq compiles), or its whole forward, pipeq's wrapper included."""
    stage = copy.deepcopy(stage)
    if whole:
        from pipeq.stage.compiled import CompileWatch

        watch = CompileWatch(CompileOptions({"backend": "eager"}))
        stage.forward = watch.wrap(stage.forward)
    else:
        watch = compile_stage(stage, CompileOptions({"backend": "eager"}))
    stage(*x)
    assert watch.compiles >= 1
    return watch.graph_breaks


def test_a_split_stage_compiles_its_graph_without_a_break_where_its_wrapper_would_break():
    torch.manual_seed(0)
    stages = pipeq.split(GPT(layers=2), (torch.zeros(2, 32, dtype=torch.long),), n_stages=2)  # cut at blocks.1
    assert stages[1].flow.int_inputs  # the size it receives as a tensor, made an int by the wrapper
    sent = stages[0](torch.randint(0, 64, (4, 32)))
    assert _graph_breaks(stages[1], sent, whole=False) == 0
    assert _graph_breaks(stages[1], sent, whole=True) > 0  # int(tensor) in the wrapper


@pytest.mark.parametrize("recompute", [False, True])
def test_a_compiled_stage_cut_in_two_computes_its_weight_gradients_at_W_not_at_I(recompute):
    """Cut (a split-backward schedule's stage: pipeq.stage.split_backward): after I the parameters
    have no gradient and W computes them; whole (a backward compiled as one): I computes them all
    and W has nothing left. Every way gives B's gradients."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    got = {}
    for how in ("B", "I+W", "compiled B", "compiled whole I+W", "compiled cut I+W", "compiled cut B"):
        ex = StageExecutor(1, 3, StageSpec(copy.deepcopy(block), functools.partial(torch.optim.SGD, lr=0.1)),
                           torch.device("cpu"))
        if recompute:
            ex.set_numerics(Numerics(recompute=(False, True, False)))
        if how.startswith("compiled"):
            opts = CompileOptions({"backend": "aot_eager"}, split_backward="cut" in how)
            ex.compile_watch = compile_stage(ex.module, opts)
        ex.begin(0, [4], True)
        (out,) = ex.forward(0, (x.clone(),))  # a fresh leaf, as a received tensor is
        g = (torch.linspace(-1, 1, out.numel()).reshape(out.shape),)
        if how.endswith("I+W"):
            gin = ex.input_grad(0, g)
            if "cut" in how:
                assert all(p.grad is None for p in ex.module.parameters())  # W's to compute
                assert [type(d).__name__ for d in ex.backprop.pending[0]] == ["DeferredWeights"]
            elif how.startswith("compiled"):
                assert ex.backprop.pending[0] == []  # the weight gradients are in already
            ex.weight_grad(0)
        else:
            gin = ex.backward(0, g)  # a cut stage's B runs both graphs at once
        got[how] = (gin[0], [p.grad.clone() for p in ex.module.parameters()])
        if how.startswith("compiled"):
            stats = ex.stats()
            # (recompute: its forward runs without grad in F, with grad in I: two graphs)
            assert stats["compiles"] == 1 + recompute and list(ex.module.state_dict()) == list(block.state_dict())
            assert stats["backward_split"] == ("I+W" if "cut" in how else None), stats
    for how, (gin, grads) in got.items():
        torch.testing.assert_close(gin, got["B"][0], atol=1e-6, rtol=0, msg=how)
        for a, b in zip(grads, got["B"][1]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=how)


def test_a_deferred_W_runs_as_the_engine_runs_a_backward_without_grad_mode():
    """(inductor's kernels write into ``out=`` buffers, which grad mode refuses with a parameter among
    the inputs)"""
    from pipeq.stage.split_backward import DeferredWeights

    p = nn.Parameter(torch.zeros(3))
    modes = []

    def w_graph(args):
        modes.append(torch.is_grad_enabled())
        return [args[0] * 2]

    edge = torch.autograd.graph.get_gradient_edge(p)
    DeferredWeights(w_graph, [torch.ones(3)], [(edge.node, edge.output_nr)]).run()
    assert modes == [False] and torch.equal(p.grad, torch.full((3,), 2.0))


def test_a_backward_that_cannot_be_cut_runs_whole_in_I_and_says_why():
    """A backend pipeq does not cut (one of AOTAutograd's own), and a graph whose weight gradients
    need nothing of their own (an added parameter of the output's shape): I computes everything, and the stage's figures say why."""
    torch.manual_seed(0)
    for module, setting, why in [(nn.Linear(8, 8), {"backend": "aot_eager_default_partitioner"}, "backend "),
                                 (_Bias(), {"backend": "aot_eager"}, "need nothing beyond")]:
        ex = StageExecutor(1, 3, StageSpec(module, functools.partial(torch.optim.SGD, lr=0.1)), torch.device("cpu"))
        ex.compile_watch = compile_stage(ex.module, CompileOptions(setting, split_backward=True))
        ex.begin(0, [4], True)
        (out,) = ex.forward(0, (torch.randn(4, 8),))
        ex.input_grad(0, (torch.ones_like(out),))
        assert all(p.grad is not None for p in ex.module.parameters())
        assert why in ex.stats()["backward_split"] and ex.stats()["backward_split"].startswith("whole: ")
        ex.weight_grad(0)


class _Bias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.zeros(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + self.b  # its gradient is the output's: nothing to compute in a W


def test_stages_compiled_before_the_runner_run_as_their_own_modules_compiled_in_their_processes():
    stages = list(pipeq.split(model(), modules=BY_NAME))
    compiled_one = copy.deepcopy(stages[1])
    compiled_one.compile(backend="eager")
    with pytest.warns(UserWarning, match=r"stage\(s\) \[0, 1\] were compiled in this process"):
        got, cfg = uncompiled([torch.compile(stages[0], backend="eager"), compiled_one], RunConfig())
    assert got[0] is stages[0] and got[1] is compiled_one and compiled_one._compiled_call_impl is None
    assert cfg.numerics.compile is True and not any(n.startswith("_orig_mod") for n in got[0].state_dict())
    given = RunConfig.from_kwargs(compile={"backend": "eager"})  # the run's own setting is kept, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert uncompiled([torch.compile(stages[0])], given)[1] is given
        assert uncompiled(stages, RunConfig())[0] is stages  # nothing compiled: as given


def test_a_model_compiled_before_the_split_is_split_through_its_original_module():
    m = model()
    with pytest.warns(UserWarning, match="pass compile=True to the runner"):
        stages = pipeq.split(torch.compile(m), (torch.zeros(2, 32, dtype=torch.long),), n_stages=2)
    names = [n for s in stages for n in s.state_dict()]
    assert "tok_emb.weight" in names and not any(n.startswith("_orig_mod") for n in names)


def test_a_job_compiles_into_its_run_directory_unless_it_names_a_cache(tmp_path):
    from pipeq.launch.job.recipe import Recipe
    from pipeq.launch.job.spec import Job

    job = Job(recipe=Recipe(stages="m:stages", loss="m:loss", optimizer="m:opt"), data="m:data",
              out=str(tmp_path / "run"), compile=True)
    assert job.run_config().numerics.compile == {"cache_dir": str(tmp_path / "run" / "compile-cache")}
    job.compile = {"mode": "max-autotune", "cache_dir": "/elsewhere"}
    assert job.run_config().numerics.compile == {"mode": "max-autotune", "cache_dir": "/elsewhere"}
    job.compile = False
    assert job.run_config().numerics.compile is False


def test_pipeq_launch_logs_each_stages_compile_figures_for_the_last_metrics_line():
    from types import SimpleNamespace

    from pipeq.launch.loop import TrainingLoop
    from pipeq.stage.compiled import NO_COMPILE_FIGURES

    stats = [{"peak_bytes": 1, "shm_waits": 0, **NO_COMPILE_FIGURES, "compile_s": 12.25, "compiles": 1},
             {"peak_bytes": 1, "shm_waits": 0, **NO_COMPILE_FIGURES, "compile_s": 3.0, "compiles": 2, "recompiles": 1,
              "compile_cache_hits": 4}]
    said: list[str] = []
    loop = SimpleNamespace(job=SimpleNamespace(compile={"cache_dir": "c"}), runner=SimpleNamespace(stats=lambda: stats),
                           log=said.append)
    got = TrainingLoop._compile_figures(loop)
    assert got == [{k: s[k] for k in NO_COMPILE_FIGURES} for s in stats]
    assert said == ["compiled stages: stage 0: 12.2 s compiling, 1 graph(s), 0 recompile(s), 0 cache hit(s); "
                    "stage 1: 3.0 s compiling, 2 graph(s), 1 recompile(s), 4 cache hit(s)"]
    loop.job.compile = False
    assert TrainingLoop._compile_figures(loop) is None


@pytest.mark.parametrize("mark,recompiles", [(True, 0), (False, 1)])
def test_a_new_length_reuses_the_first_compile_when_its_dimensions_are_marked(mark, recompiles):
    """Marked (the default): dynamic from the first compile; unmarked: torch's automatic dynamic
    shapes, static until the length changes, then one recompile; never one per length."""
    m = model()
    watch = compile_stage(m, CompileOptions({"backend": "eager"}, None, mark))
    for T in (32, 24, 40, 17):
        m(torch.randint(0, 64, (4, T)))
    assert (watch.compiles, watch.recompiles) == (1 + recompiles, recompiles)
