"""A job's stages made once (Recipe.stages_made, as Recipe.prepared does): counted, built and described without calling the
stages function again; each stage process handed its own stage only."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from pipeq.launch.job import Recipe
from startup_jobs import stages


def _recipe(tmp_path, fn: str = "startup_jobs:stages", **extra) -> tuple[Recipe, str]:
    calls = str(tmp_path / "calls.txt")
    return Recipe(fn, "torch.nn:MSELoss", "torch.optim:SGD", stages_args={"calls": calls}, seed=3, **extra), calls


def _count(calls: str) -> int:
    try:
        with open(calls) as f:
            return len(f.read().split())
    except FileNotFoundError:
        return 0


def test_prepared_makes_the_stages_once_and_every_build_is_a_fresh_copy_of_them(tmp_path) -> None:
    recipe, calls = _recipe(tmp_path)
    prepared = recipe.stages_made()
    assert _count(calls) == 1 and recipe.made is None
    assert prepared.prepared() is prepared and prepared.stages_made() is prepared
    assert prepared.count_stages() == 3
    torch.manual_seed(3)
    want = stages(str(tmp_path / "direct.txt"))
    a, b = prepared.build_stage(1, 3), prepared.build(1, 3).module
    assert a is not b and _count(calls) == 1  # built from what was made, not by calling the function
    for m in (a, b):
        assert m.state_dict().keys() == want[1].state_dict().keys()
        assert all(torch.equal(t, want[1].state_dict()[k]) for k, t in m.state_dict().items())
    with pytest.raises(ValueError, match="returned 3 stages, the run has 2"):
        prepared.build_stage(0, 2)
    # what two nodes compare: plain data, the split points and each stage's tensors
    made = json.loads(json.dumps(prepared.describe()))["made"]
    assert made["split_points"] == ["blocks.1", "blocks.2"]
    assert made["stages"] == ["2 tensors, blocks.0.weight .. blocks.0.bias", "2 tensors, blocks.1.weight .. blocks.1.bias",
                              "4 tensors, blocks.2.weight .. head.bias"]
    assert "made" not in recipe.describe()


def test_each_stage_process_is_handed_its_own_stage_only(tmp_path) -> None:
    prepared = _recipe(tmp_path)[0].prepared()
    one = prepared.for_stage(1)
    assert one.made.has(1) and not one.made.has(0) and not one.made.has(2)
    assert one.describe() == prepared.describe()  # every stage's process describes the same job
    assert len(pickle.dumps(one)) < len(pickle.dumps(prepared))
    again = pickle.loads(pickle.dumps(one))  # as multiprocessing hands it to the process it starts
    got, want = again.build_stage(1, 3).state_dict(), prepared.build_stage(1, 3).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(t, want[k]) for k, t in got.items())
    with pytest.raises(ValueError, match="n_stages = 2, but startup_jobs:stages returns 3 stages"):
        _recipe(tmp_path, n_stages=2)[0].prepared()


def test_a_stage_k_of_n_function_a_model_and_stages_that_do_not_pickle_are_built_in_each_process(tmp_path) -> None:
    per_stage, calls = _recipe(tmp_path, "startup_jobs:per_stage", n_stages=2)
    assert per_stage.prepared() is per_stage and per_stage.stages_made() is per_stage and _count(calls) == 0
    model = Recipe(None, "torch.nn:MSELoss", "torch.optim:SGD", model="startup_jobs:Net", balance=[2, 2])
    assert model.stages_made() is model  # a model's part: built in each stage process
    assert per_stage.for_stage(1) is per_stage
    odd, calls = _recipe(tmp_path, "startup_jobs:unpicklable")
    prepared = odd.prepared()
    assert prepared.count_stages() == 2 and _count(calls) == 1
    assert not prepared.made.has(1)
    assert isinstance(prepared.for_stage(1).build_stage(1, 2), torch.nn.Linear) and _count(calls) == 2


def test_a_node_whose_stages_function_split_otherwise_is_refused_with_what_to_do(tmp_path, monkeypatch) -> None:
    from types import SimpleNamespace

    from pipeq.control.processes import job_identity
    from pipeq.launch import agent
    from pipeq.stage.numerics import Numerics

    told = []
    monkeypatch.setattr(agent, "_tell_driver", lambda control, rz, message: told.append(message))
    prepared = _recipe(tmp_path)[0].prepared()
    theirs = json.loads(json.dumps(job_identity(prepared.for_stage(0), "1f1b", Numerics())))
    rz, setup = SimpleNamespace(node_rank=1), SimpleNamespace(numerics=Numerics(), tp_plans=None)
    agent._check_job(rz, "tcp://node0:1", theirs, prepared, "1f1b", setup)  # node 0's job: accepted
    theirs["recipe"]["made"]["split_points"] = ["blocks.2"]
    with pytest.raises(agent.AgentError, match=r"node 1's stages function made other stages than node 0's: "
                                               r"recipe.made.split_points is \['blocks.2'\] on node 0 but "
                                               r"\['blocks.1', 'blocks.2'\] here; .* give pipeq.split the "
                                               "split_points node 0 chose instead"):
        agent._check_job(rz, "tcp://node0:1", theirs, prepared, "1f1b", setup)
    assert told and "split_points" in told[0]
