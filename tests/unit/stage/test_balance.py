"""pipeq.balance: optimal partitions, measured costs, the runner and job files given a model."""

from __future__ import annotations

import copy
import functools
import itertools
import random

import pytest
import torch
from torch import nn

import pipeq
from balance_cases import JOB, assert_equals_reference, job_file
from balance_jobs import train_batches, uneven_model
from models import TwoIn, TwoOut, reference_train
from pipeq import checkpoint
from pipeq.launch.job import load_job

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
pytestmark = pytest.mark.timeout(60)


def heavy() -> nn.Module:
    """Costs (time and memory) far more than the light layers beside it: 1-2 ms a pass here."""
    return nn.Sequential(nn.Linear(16, 2048), nn.Tanh(), nn.Linear(2048, 16))


def stage_costs(costs, counts) -> list[float]:
    out, start = [], 0
    for c in counts:
        out.append(sum(costs[start:start + c]))
        start += c
    return out


def brute_force(costs, n_stages) -> float:
    """The least largest stage cost over every contiguous split."""
    n = len(costs)
    return min(max(stage_costs(costs, [b - a for a, b in zip((0, *cuts), (*cuts, n))]))
               for cuts in itertools.combinations(range(1, n), n_stages - 1))


# -- partition ----------------------------------------------------------------------------------

def test_partition_is_optimal_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 8)
        k = rng.randint(1, n)
        costs = [rng.choice([0, 1, 2, 7, 0.25, round(rng.uniform(0, 5), 3)]) for _ in range(n)]
        counts = pipeq.balance.partition(costs, k)
        assert len(counts) == k and sum(counts) == n and min(counts) >= 1, (costs, k, counts)
        assert max(stage_costs(costs, counts)) == pytest.approx(brute_force(costs, k), abs=1e-12), (costs, k, counts)


@pytest.mark.parametrize(("costs", "n_stages", "counts"), [
    ([1, 1, 1, 1, 1, 1], 3, [2, 2, 2]),
    ([10, 1, 1, 1, 1, 1, 1], 3, [1, 3, 3]),  # optimal either way; the rest is split evenly
    ([1, 1, 9, 1, 1, 1], 3, [2, 1, 3]),
    ([0, 0, 0, 0], 2, [2, 2]),  # all ties: even layer counts
    ([5], 1, [1]),
    ([3, 1, 2], 3, [1, 1, 1]),
])
def test_partition_examples(costs, n_stages, counts) -> None:
    assert pipeq.balance.partition(costs, n_stages) == counts


@pytest.mark.parametrize(("costs", "n_stages", "message"), [
    ([1, 2], 3, "n_stages=3 but there are only 2 layers: every stage needs at least one layer, so use at most 2"),
    ([1, 2], 0, "n_stages must be a positive integer, got 0"),
    ([], 1, "costs is empty"),
    ([1, -1], 1, "costs must be finite numbers >= 0"),
    ([1, float("nan")], 1, "costs must be finite numbers >= 0"),
])
def test_partition_refuses_bad_input(costs, n_stages, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pipeq.balance.partition(costs, n_stages)


# -- measuring --------------------------------------------------------------------------------

def test_measured_balance_puts_the_heavy_layers_alone_and_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(heavy(), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.ReLU(), heavy())
    model[1].eval()  # a mixed training mode must survive too
    before = copy.deepcopy(model.state_dict())
    modes = [m.training for m in model.modules()]
    x = torch.randn(64, 16)
    rng = torch.get_rng_state()
    assert pipeq.balance(model, 3, x, by="time") == [1, 4, 1]
    assert pipeq.balance(model, 3, x, by="memory") == [1, 4, 1]
    assert torch.equal(torch.get_rng_state(), rng)  # dropout in the profiled copies drew elsewhere
    assert [m.training for m in model.modules()] == modes
    assert all(p.grad is None for p in model.parameters())
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # batch-norm statistics too


def test_profiles_follow_tuples_and_count_parameters_and_activations() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(TwoOut(8, 16), TwoIn(16, 4))  # a tuple passes as the next layer's arguments
    x = torch.randn(10, 8)
    times = pipeq.balance.profile_times(model, x, repeats=2)
    assert len(times) == 2 and all(t > 0 for t in times)
    sizes = pipeq.balance.profile_sizes(model, x, param_scale=3.0)
    lin = (8 * 16 + 16) * 4
    # TwoOut keeps its input (10 x 8) for the weight's gradient and its ReLU output (10 x 16)
    assert sizes[0] == 3 * lin + 10 * 8 * 4 + 10 * 16 * 4
    two_in = nn.Sequential(TwoIn(16, 4))
    assert len(pipeq.balance.profile_times(two_in, (torch.randn(10, 16), torch.ones(10).long()))) == 1


def test_balance_refuses_what_it_cannot_measure() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="by must be one of"):
        pipeq.balance(model, 2, torch.randn(2, 4), by="flops")
    with pytest.raises(ValueError, match="n_stages=3 but there are only 2 layers"):
        pipeq.balance(model, 3, torch.randn(2, 4))
    with pytest.raises(ValueError, match="model must be an nn.Sequential"):
        pipeq.balance(nn.Linear(4, 4), 1, torch.randn(2, 4))
    with pytest.raises(ValueError, match="sample must be the model's input"):
        pipeq.balance(model, 2, [1, 2])


# -- split ------------------------------------------------------------------------------------

def test_split_shares_the_layers_and_checks_the_counts() -> None:
    model = uneven_model()
    stages = pipeq.balance.split(model, [2, 3, 1])
    assert [len(s) for s in stages] == [2, 3, 1] and stages[1][0] is model[2]
    assert list(checkpoint.flat_model(stages).state_dict()) == list(model.state_dict())
    for counts, message in (([2, 3], "counts 5 layers, but the model has 6"), ([6, 0], "at least one layer"),
                            ("time", "give layer counts per stage"), ([2.0, 4], "integers")):
        with pytest.raises(ValueError, match=message):
            pipeq.balance.split(model, counts)
    own = nn.Sequential(nn.Linear(2, 2))
    own.register_parameter("scale", nn.Parameter(torch.ones(1)))
    with pytest.raises(ValueError, match=r"holds \['scale'\] itself, outside its layers"):
        pipeq.balance.split(own, [1])


# -- the runner ---------------------------------------------------------------------------------

def test_balanced_runner_equals_single_process_training() -> None:
    torch.manual_seed(0)
    model = uneven_model()
    reference = copy.deepcopy(model)
    data = train_batches(0)[:4]
    counts = pipeq.balance(model, 3, data[0][0][:4])
    runner = pipeq.PipelineRunner(model, nn.CrossEntropyLoss(), SGD, "1f1b", 4, mode="simulated", balance=counts)
    with runner:
        losses = [runner.step(x, y) for x, y in data]
        state = runner.state_dict()
    ref_model, ref_losses = reference_train(list(reference), nn.CrossEntropyLoss(), SGD, data)
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    assert list(state) == list(model.state_dict())  # the model's own names
    for name, ref in ref_model.state_dict().items():
        torch.testing.assert_close(state[name], ref, atol=1e-5, rtol=0, msg=name)


def test_runner_refuses_a_model_it_cannot_split() -> None:
    model = uneven_model()
    args = (nn.CrossEntropyLoss(), SGD)
    with pytest.raises(ValueError, match=r"stages is one Sequential: .* with balance=\[layers per stage\]"):
        pipeq.PipelineRunner(model, *args, mode="simulated")
    with pytest.raises(ValueError, match="balance= splits one nn.Sequential, but a list of stages was given"):
        pipeq.PipelineRunner(list(model), *args, mode="simulated", balance=[3, 3])
    with pytest.raises(ValueError, match=r"balance='time': give layer counts .* pipeq.balance\(model, n_stages"):
        pipeq.PipelineRunner(model, *args, mode="simulated", balance="time")
    with pytest.raises(ValueError, match=r"balance=\[2, 2\] counts 4 layers, but the model has 6"):
        pipeq.PipelineRunner(model, *args, mode="simulated", balance=[2, 2])
    with pytest.raises(ValueError, match="a job recipe names its own split"):
        pipeq.PipelineRunner(pipeq.Recipe("m:s", None, "torch.optim:SGD"), None, None, balance=[3, 3])


# -- job files ----------------------------------------------------------------------------------

def test_job_with_counts_builds_the_split_model(tmp_path) -> None:
    recipe = load_job(job_file(tmp_path, "balance = [2, 3, 1]\nseed = 3\n")).recipe
    assert recipe.count_stages() == 3 and recipe.prepared() is recipe
    assert recipe.describe()["balance"] == [2, 3, 1]
    torch.manual_seed(3)
    expected = uneven_model()
    built = [recipe.build_stage(k, 3) for k in range(3)]
    assert list(checkpoint.flat_model(built).state_dict()) == list(expected.state_dict())
    for name, t in checkpoint.flat_model(built).state_dict().items():
        assert torch.equal(t, expected.state_dict()[name]), name  # the job's seed: the same weights
    runner = pipeq.PipelineRunner(recipe, None, None, "1f1b", 4, mode="simulated")
    with runner:
        losses = [runner.step(x, y) for x, y in train_batches(0)[:4]]
        state = runner.state_dict()
    assert runner.n_stages == 3
    assert_equals_reference(losses, state, seed=3)


def test_job_with_a_measured_balance_measures_once(tmp_path) -> None:
    job = load_job(job_file(tmp_path, 'balance = "memory"\nbalance_sample = "balance_jobs:sample"\nn_stages = 2\n'))
    with pytest.raises(ValueError, match="balance = 'memory' is measured once, by the launching process"):
        job.recipe.count_stages()  # a stage process never measures
    with pytest.raises(ValueError, match="write the counts into the job instead"):
        job.recipe.prepared(multi_host=True)
    prepared = job.recipe.prepared()
    assert prepared.balance in ([2, 4], [3, 3], [4, 2]) and prepared.describe()["balance"] == prepared.balance
    assert job.recipe.balance == "memory"  # the job's own recipe is not changed
    runner = pipeq.PipelineRunner(job.recipe, None, None, "1f1b", 4, mode="simulated")
    assert runner.n_stages == 2


@pytest.mark.parametrize(("extra", "message"), [
    ('balance = [3, 3]\nstages = "launch_jobs:mlp_stages"\n', "stages and model both name the stages: keep one"),
    ("", "model needs balance: layer counts per stage"),
    ('balance = "tiem"\n', "balance = 'tiem'; did you mean 'time'?"),
    ('balance = "time"\nn_stages = 2\n', "balance = 'time' measures the layers on a sample .* set balance_sample"),
    ('balance = "time"\nbalance_sample = "balance_jobs:sample"\n', "set n_stages"),
    ("balance = [3, 0, 3]\n", "balance must be an array of layer counts per stage, each at least 1"),
    ("balance = 3\n", "balance must be an array or a string, got 3"),
    ('balance = [3, 3]\nbalance_sample = "balance_jobs:sample"\n', "remove balance_sample"),
    ("balance = [3, 3]\nn_stages = 3\n", "n_stages = 3, but balance = \\[3, 3\\] makes 2 stages"),
    ("balanse = [3, 3]\n", "unknown key\\(s\\) \\['balanse'\\]; did you mean 'balance'\\?"),
    ('balance = [3, 3]\nschedule = "al"\n', "schedule 'al' trains pipeq.research.ALLayer stages"),
])
def test_job_refuses_bad_model_keys(tmp_path, extra, message) -> None:
    with pytest.raises(ValueError, match=message):
        load_job(job_file(tmp_path, extra))


def test_job_refuses_balance_without_model(tmp_path) -> None:
    text = JOB.replace('model = "balance_jobs:uneven_model"', 'stages = "launch_jobs:mlp_stages"')
    with pytest.raises(ValueError, match="balance splits the nn.Sequential that model names"):
        load_job(job_file(tmp_path, "balance = [1, 2]\n", text))
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['stages'\]"):
        load_job(job_file(tmp_path, "", JOB.replace('model = "balance_jobs:uneven_model"\n', "")))


def test_job_counts_that_do_not_fit_the_model_fail_before_any_stage_starts(tmp_path) -> None:
    recipe = load_job(job_file(tmp_path, "balance = [3, 2]\n")).recipe
    with pytest.raises(ValueError, match=r"balance=\[3, 2\] counts 5 layers, but the model has 6"):
        pipeq.PipelineRunner(recipe, None, None, "1f1b", 4)
