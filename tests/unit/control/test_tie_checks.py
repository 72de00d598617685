"""The runner's ``ties=`` (pipeq.control.ties): turned into each stage's ties, its mistakes named, sharing left undeclared and unsupported runs refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeq
from pipeq.runtime.executors import make_executor
from pipeq.stage.info import Tie, info_of, set_info
from pipeq.stage.spec import StageSpec

from tie_cases import SGD, TIE, lm_stages

ARGS = (nn.CrossEntropyLoss(), SGD)


def runner(stages, **kw):
    kw.setdefault("mode", "simulated")
    return pipeq.PipelineRunner(stages, *ARGS, microbatches=2, **kw)


def test_undeclared_sharing_is_refused_naming_the_ties_that_fix_it():
    with pytest.raises(ValueError, match=r"stage 2's '1.weight' is the same tensor as stage 0's '0.weight'.*"
                                         r"pass ties=\[\['0.weight', '3.weight'\]\]"):
        runner(lm_stages())
    buffer = torch.zeros(3)
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    a.register_buffer("b", buffer)
    b.register_buffer("b", buffer)
    with pytest.raises(ValueError, match="buffer 'b' is the same tensor as stage 0's 'b'.*keep it in one stage"):
        runner([a, b])


@pytest.mark.parametrize("ties, match", [
    ([["0.weight", "3.wieght"]], r"'3.wieght' is not a name of runner.state_dict\(\); did you mean '3.weight'"),
    ([["0.weight"]], "a list of lists of two or more names"),
    ("0.weight", "a list of lists of two or more names"),
    ([["0.weight", "3.weight"], ["3.weight", "1.weight"]], "'3.weight' is named twice"),
    ([["0.weight", "1.weight"]], r"'0.weight' is \(11, 6\) torch.float32 but '1.weight' is \(6, 6\)"),
    ([["0.weight", "2.weight", "3.weight"]], r"'0.weight' is \(11, 6\).* but '2.weight' is \(6,\)"),
])
def test_bad_ties_are_named(ties, match):
    with pytest.raises(ValueError, match=match):
        runner(lm_stages(shared=False), ties=ties)


def test_a_buffer_and_two_tensors_of_one_stage_cannot_be_tied():
    norm = nn.BatchNorm1d(6)
    stages = [nn.Sequential(nn.Linear(6, 6)), nn.Sequential(norm)]
    with pytest.raises(ValueError, match="'1.running_mean' .* is a buffer, not a parameter"):
        runner(stages, ties=[["0.bias", "1.running_mean"]])
    stages = [nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6)), nn.Linear(6, 6)]
    with pytest.raises(ValueError, match="'0.weight' and '1.weight' are both stage 0's, but different tensors"):
        runner(stages, ties=[["0.weight", "1.weight", "2.weight"]])


@pytest.mark.parametrize("schedule", ["async", "local"])
def test_ties_train_with_plain_backprop_only(schedule):
    with pytest.raises(ValueError, match=f"schedule '{schedule}' computes its own way: tied weights with"):
        runner(lm_stages(), ties=[TIE], schedule=schedule)


def test_ties_compose_with_tensor_parallelism_and_sharding_but_a_recipe_declares_its_own():
    runner(lm_stages(), ties=[TIE], tensor_parallel=2, tp_plan=[{}, {}, {}], mode="process")  # built, no process
    runner(lm_stages(), ties=[TIE], data_parallel=2, sharding="fsdp", mode="process")

    class Recipe(pipeq.stage.spec.StageBuilder):
        pass

    with pytest.raises(ValueError, match="with a stage recipe, tied weights come from the stages it builds"):
        pipeq.PipelineRunner(Recipe(), None, None, ties=[TIE])
    # a stage process building a tied stage refuses a schedule that cannot sum it
    stage = set_info(nn.Linear(2, 2), ties=[Tie("weight", "0.weight", (0, 1))])
    with pytest.raises(ValueError, match="stage 0 holds tied weights \\(0.weight\\), and schedule 'async' computes"):
        make_executor("async", 0, 2, StageSpec(stage, SGD), torch.device("cpu"))


def test_copies_start_equal_without_changing_a_tied_model():
    stages = lm_stages()
    emb = stages[0][0].weight
    r = runner(stages, ties=[TIE])
    assert stages[2][1].weight is emb  # your model stays tied: stage 2 trains a copy of its module
    assert info_of(stages[0]).ties == (Tie("0.weight", "0.weight", (0, 2)),)
    assert info_of(stages[2]).ties == (Tie("1.weight", "0.weight", (0, 2)),)
    runner(stages, ties=[TIE])  # declaring again (a second runner on the same stages) is fine
    assert len(info_of(stages[2]).ties) == 1
    with r:
        state = r.state_dict()
    assert torch.equal(state["0.weight"], emb.detach())
    # different tensors: every copy takes the first name's value
    apart = lm_stages(shared=False)
    assert not torch.equal(apart[0][0].weight, apart[2][1].weight)
    runner(apart, ties=[["3.weight", "0.weight"]])
    assert torch.equal(apart[0][0].weight, apart[2][1].weight)
    assert info_of(apart[0]).ties[0].key == "3.weight"


def test_stages_that_carry_their_ties_need_no_ties_argument_and_must_agree():
    stages = lm_stages(shared=False)
    set_info(stages[0], ties=[Tie("0.weight", "emb", (0, 2))])
    set_info(stages[2], ties=[Tie("1.weight", "emb", (0, 2))])
    with runner(stages) as r:
        assert "emb" in r.state_dict() and "0.weight" not in r.state_dict()
    set_info(stages[2], ties=[Tie("1.weight", "emb", (0, 1, 2))])
    with pytest.raises(ValueError, match="stage 0 ties 'emb' with stages \\[0, 2\\], but stage 2 ties it with stages \\[0, 1, 2\\]"):
        runner(stages)


def test_data_parallel_replicas_of_one_list_are_tied_alike():
    from pipeq.control import checks, ties

    stages = lm_stages()
    model = checks.check_model(stages, *ARGS, None, pipeq.schedules.resolve("1f1b"), aux_heads=None, aux_loss=None,
                               data_parallel=2, mode="process", rendezvous=None, ties=[TIE])
    assert model.ties and len(model.replicas) == 2
    for replica in model.replicas:
        mods = [spec.module for spec in replica]
        assert mods[2][1].weight is not mods[0][0].weight
        ties.check_untied(mods)
    assert all(info_of(spec.module).ties for spec in (model.replicas[1][0], model.replicas[1][2]))


def test_the_runner_and_a_stage_process_refuse_by_one_rule():
    """The runner's check before anything starts and the stage process's (a recipe's stages are
    built there) are one rule, pipeq.stage.tie_groups.refuse_ties: the same refusal, word for word."""
    with pytest.raises(ValueError) as up_front:
        runner(lm_stages(), ties=[TIE], schedule="async")
    stage = set_info(nn.Linear(2, 2), ties=[Tie("weight", "0.weight", (0, 2))])
    with pytest.raises(ValueError) as in_process:
        make_executor("async", 0, 3, StageSpec(stage, SGD), torch.device("cpu"))
    assert str(up_front.value) == str(in_process.value)
    assert str(up_front.value).startswith("stage 0 holds tied weights (0.weight), and schedule 'async' computes its "
                                          "own way")
