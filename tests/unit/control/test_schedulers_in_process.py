"""Learning-rate schedulers stepped per step or per epoch (simulated runners), evaluation metrics, and job files' factory arguments (``*_args``), checked without a process."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR

import pipeq
from pipeq.launch.cli import main as pipeq_main
from pipeq.launch.job import load_job
from job_files import MLP, launch_code, write
from scheduler_cases import (
    PLATEAU, PLATEAU_METRICS, SGD, assert_close, epochs_of_data, make_stages, reference, train_by_epoch
)

pytestmark = pytest.mark.timeout(60)

STEP_LR = functools.partial(StepLR, step_size=1, gamma=0.5)


# -- lr_scheduler_interval ----------------------------------------------------------------------------
@pytest.mark.parametrize(("scheduler", "metrics_fed"), [(STEP_LR, None), (PLATEAU, PLATEAU_METRICS)],
                         ids=["StepLR", "ReduceLROnPlateau"])
def test_epoch_interval_equals_a_single_process_loop(scheduler, metrics_fed) -> None:
    data = epochs_of_data()
    ref_state, ref_lrs = reference(scheduler, metrics_fed, data)
    runner = pipeq.PipelineRunner(make_stages(), nn.CrossEntropyLoss(), SGD, "1f1b", 2, lr_scheduler=scheduler,
                                  lr_scheduler_interval="epoch", mode="simulated")
    with runner:
        lrs = train_by_epoch(runner, metrics_fed, data)
        assert_close(runner.state_dict(), ref_state)
        after = runner.learning_rates()
    assert lrs == pytest.approx(ref_lrs)
    assert ref_lrs == ([0.2, 0.1, 0.05] if metrics_fed is None else [0.2, 0.2, 0.1])
    assert after == ([[0.025]] * 2 if metrics_fed is None else [[0.1]] * 2)


def test_step_interval_steps_after_every_optimizer_step_and_reports_each_steps_lr() -> None:
    runner = pipeq.PipelineRunner(make_stages(), nn.CrossEntropyLoss(), SGD, "1f1b", 2, lr_scheduler=STEP_LR,
                                  mode="simulated")
    assert runner.last_step_lr is None
    with runner:
        seen = []
        for _ in runner.stream(epochs_of_data(1, 3)[0]):
            seen.append(runner.last_step_lr)
        assert seen == pytest.approx([0.2, 0.1, 0.05])
        assert runner.learning_rates() == [[0.025], [0.025]]


def test_epoch_interval_holds_the_lr_of_per_microbatch_schedules() -> None:
    """"async" and "al" update per microbatch: with "epoch" their schedulers (AL: both paths')
    step only when told."""
    import launch_jobs

    x, y = launch_jobs.train_batches(0)[0]
    adam = functools.partial(torch.optim.Adam, lr=0.01)
    for stages, schedule in ((launch_jobs.mlp_stages(), "async"), (launch_jobs.al_layers(), "al")):
        runner = pipeq.PipelineRunner(stages, None if schedule == "al" else nn.CrossEntropyLoss(), adam,
                                      schedule, 4, lr_scheduler=STEP_LR, lr_scheduler_interval="epoch",
                                      mode="simulated")
        groups = 2 if schedule == "al" else 1  # AL: f and b's optimizer, g and h's
        with runner:
            for _ in runner.stream([(x, y), (x, y)]):
                pass
            assert runner.learning_rates() == [[0.01] * groups] * 3, schedule
            runner.scheduler_step()
            assert runner.learning_rates() == [[0.005] * groups] * 3, schedule


@pytest.mark.parametrize("factory", [PLATEAU, ReduceLROnPlateau, lambda opt: ReduceLROnPlateau(opt)],
                         ids=["partial", "class", "lambda"])
def test_plateau_stepped_per_step_is_refused_at_construction(factory) -> None:
    with pytest.raises(ValueError, match=r"it needs a metric: use lr_scheduler_interval='epoch' and "
                                         r"runner\.scheduler_step\(metric\)"):
        pipeq.PipelineRunner(make_stages(), nn.CrossEntropyLoss(), SGD, lr_scheduler=factory, mode="simulated")


def test_scheduler_settings_that_cannot_apply_are_refused(tmp_path) -> None:
    def runner(**kw):
        return pipeq.PipelineRunner(make_stages(), nn.CrossEntropyLoss(), SGD, "1f1b", 2, mode="simulated", **kw)

    with pytest.raises(ValueError, match="lr_scheduler_interval must be 'step'.* or 'epoch'.*got 'weekly'"):
        runner(lr_scheduler=STEP_LR, lr_scheduler_interval="weekly")
    with pytest.raises(ValueError, match="lr_scheduler_interval='epoch' but there is no lr_scheduler"):
        runner(lr_scheduler_interval="epoch")
    with pytest.raises(ValueError, match=r"runner\.scheduler_step\(\): the runner has no lr_scheduler"):
        runner().scheduler_step()
    with pytest.raises(ValueError, match="already step the scheduler after every optimizer step"):
        runner(lr_scheduler=STEP_LR).scheduler_step()
    plateau = runner(lr_scheduler=PLATEAU, lr_scheduler_interval="epoch")
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau, which needs the metric it monitors"):
        plateau.scheduler_step()
    with pytest.raises(ValueError, match="the metric must be a number"):
        plateau.scheduler_step("low")
    with pytest.raises(ValueError, match=r"the scheduler takes no metric.*call runner\.scheduler_step\(\)"):
        runner(lr_scheduler=STEP_LR, lr_scheduler_interval="epoch").scheduler_step(0.3)
    recipe = load_job(write(tmp_path, MLP + "steps = 1\n")).recipe
    with pytest.raises(ValueError, match="with a stage recipe, the scheduler and its interval come from it"):
        pipeq.PipelineRunner(recipe, None, None, mode="simulated", lr_scheduler_interval="epoch")


# -- evaluation metrics -------------------------------------------------------------------------------
def first_score(output: torch.Tensor, target: torch.Tensor) -> float:
    """A metric whose value differs per batch: the mean first score."""
    return float(output[:, 0].mean())


def test_evaluate_reduces_every_metric_as_a_sample_mean() -> None:
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in (5, 3)]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    runner = pipeq.PipelineRunner(make_stages(), nn.CrossEntropyLoss(), SGD, "1f1b", 2, mode="simulated")
    with runner:
        got = runner.evaluate(batches, metrics={"first": first_score})
        out = runner.predict(x)
        one = runner.evaluate((x, y))  # one (x, target) pair is one batch
        summed = runner.evaluate(batches, loss_fn=nn.CrossEntropyLoss(reduction="sum"))
        mine = runner.evaluate(batches, metrics={"accuracy": lambda o, t: 0.25})
    assert list(got) == ["loss", "accuracy", "first"]
    # the whole set's mean, not the mean of the two batches' means
    assert got["loss"] == pytest.approx(float(nn.functional.cross_entropy(out, y)), abs=1e-6)
    assert got["accuracy"] == pytest.approx(float((out.argmax(1) == y).float().mean()))
    assert got["first"] == pytest.approx(float(out[:, 0].mean()), abs=1e-6)
    assert got["first"] != pytest.approx((float(out[:5, 0].mean()) + float(out[5:, 0].mean())) / 2, abs=1e-6)
    assert one == pytest.approx({"loss": got["loss"], "accuracy": got["accuracy"]})
    assert summed["loss"] == pytest.approx(got["loss"], abs=1e-6)  # a sum-reduced loss, per sample
    assert mine["accuracy"] == 0.25  # a metric named like a default replaces it


def test_evaluate_has_no_accuracy_for_regression_and_names_a_failing_metric() -> None:
    torch.manual_seed(0)
    runner = pipeq.PipelineRunner([nn.Linear(4, 4), nn.Linear(4, 2)], nn.MSELoss(), SGD, "1f1b", 2,
                                  mode="simulated")
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    with runner:
        got = runner.evaluate([(x, y)], metrics={"mae": lambda o, t: (o - t).abs().mean()})
        out = runner.predict(x)
        with pytest.raises(ValueError, match="metric 'bad' returned a str, not a number"):
            runner.evaluate([(x, y)], metrics={"bad": lambda o, t: "high"})
        with pytest.raises(ValueError, match=r"metric 'shape' returned a tensor of shape \(6,\)"):
            runner.evaluate([(x, y)], metrics={"shape": lambda o, t: (o - t).abs().mean(1)})
        with pytest.raises(ValueError, match="metrics\\['top'\\] must be callable"):
            runner.evaluate([(x, y)], metrics={"top": 3})
        with pytest.raises(ValueError, match="the evaluation set holds no batch"):
            runner.evaluate([])
    assert sorted(got) == ["loss", "mae"]
    assert got["mae"] == pytest.approx(float((out - y).abs().mean()), abs=1e-6)


# -- job files: factory arguments, scheduler keys, metrics ---------------------------------------------
JOB_MODULE = '''\
import torch
from torch import nn

def stages(width, depth=1):
    return [nn.Sequential(nn.Linear(4, width), nn.ReLU())] + [nn.Linear(width, width) for _ in range(depth)]

def stage(k, n, width):
    return nn.Linear(4 if k == 0 else width, width)

def make_loss(smoothing):
    return nn.CrossEntropyLoss(label_smoothing=smoothing)

def data(epoch, batches, size=4):
    return [(torch.full((size, 4), float(epoch)), torch.zeros(size, dtype=torch.long))] * batches

def eval_data(n):
    return torch.zeros(n, 4), torch.zeros(n, dtype=torch.long)

def heads(width):
    return [nn.Linear(width, 3), nn.Linear(width, 3)]
'''


@pytest.fixture
def job_dir(tmp_path):
    (tmp_path / "argsjob.py").write_text(JOB_MODULE)
    yield tmp_path
    import sys

    sys.modules.pop("argsjob", None)


def test_job_args_reach_their_factories_and_the_recipe_description(job_dir) -> None:
    job = load_job(write(job_dir, """\
stages = "argsjob:stages"
stages_args = { width = 5, depth = 2 }
loss = "argsjob:make_loss"
loss_args = { smoothing = 0.25 }
optimizer = "torch.optim:SGD"
optimizer_args = { lr = 0.1 }
lr_scheduler = "torch.optim.lr_scheduler:ReduceLROnPlateau"
lr_scheduler_args = { patience = 2, mode = "max" }
lr_scheduler_interval = "epoch"
lr_scheduler_monitor = "eval_top1"
data = "argsjob:data"
data_args = { batches = 3, size = 2 }
eval_data = "argsjob:eval_data"
eval_data_args = { n = 7 }
metrics = { top1 = "pipeq.control.evaluation:accuracy" }
schedule = "pairwise"
aux_heads = "argsjob:heads"
aux_heads_args = { width = 5 }
aux_loss = "torch.nn:CrossEntropyLoss"
aux_loss_args = { label_smoothing = 0.5 }
steps = 1
"""))
    recipe = job.recipe
    assert recipe.count_stages() == 3
    spec = recipe.build(2, 3)
    assert spec.module.in_features == 5 and spec.lr_scheduler_interval == "epoch"
    assert spec.loss_fn.label_smoothing == 0.25
    assert spec.aux_loss.label_smoothing == 0.5
    assert [h.in_features for h in recipe.heads(3)] == [5, 5]
    sched = spec.lr_scheduler(spec.optimizer(list(spec.module.parameters())))
    assert isinstance(sched, ReduceLROnPlateau) and sched.patience == 2 and sched.mode == "max"
    batches = list(job.batches(4))
    assert len(batches) == 3 and batches[0][0].shape == (2, 4) and float(batches[0][0][0, 0]) == 4.0
    assert job.eval_batches()[0][0].shape == (7, 4)
    assert job.monitor() == "eval_top1" and list(job.metric_fns()) == ["top1"]
    # what two hosts compare: plain data, the arguments included
    described = recipe.describe()
    assert described["stages_args"] == {"width": 5, "depth": 2} and described["loss_args"] == {"smoothing": 0.25}
    assert described["aux_heads_args"] == {"width": 5} and described["aux_loss_args"] == {"label_smoothing": 0.5}
    assert described["lr_scheduler_interval"] == "epoch"
    # the (k, n) form takes them too
    per_stage = load_job(write(job_dir, 'stages = "argsjob:stage"\nn_stages = 2\nstages_args = { width = 6 }\n'
                                        'loss = "torch.nn:MSELoss"\noptimizer = "torch.optim:SGD"\n'
                                        'data = "argsjob:data"\ndata_args = { batches = 1 }\nsteps = 1\n', "kn"))
    assert per_stage.recipe.build(1, 2).module.in_features == 6


@pytest.mark.parametrize(("extra", "message"), [
    ("stages_args = { widht = 5 }", "stages_args: stages = 'argsjob:stages' does not take the argument(s) "
                                    "['widht']; did you mean 'width'?"),
    ("loss_args = { smoothing = 0.1, weight = 2 }", "loss_args: loss = 'argsjob:make_loss' does not take the "
                                                    "argument(s) ['weight']"),
    ("data_args = { batches = 1, shuffle = true }", "data_args: data = 'argsjob:data' does not take the "
                                                    "argument(s) ['shuffle']"),
    ("optimizer_args = { lr = 0.1, betas = [0.9, 0.99] }", "optimizer_args: optimizer = 'torch.optim:SGD' does "
                                                           "not take the argument(s) ['betas']"),
])
def test_an_argument_the_factory_does_not_take_is_refused_naming_both(job_dir, capsys, extra, message) -> None:
    text = ('stages = "argsjob:stages"\nstages_args = { width = 5 }\nloss = "argsjob:make_loss"\n'
            'loss_args = { smoothing = 0.1 }\noptimizer = "torch.optim:SGD"\noptimizer_args = { lr = 0.1 }\n'
            'data = "argsjob:data"\ndata_args = { batches = 1 }\nsteps = 1\n')
    for line in text.splitlines():
        if line.split(" = ")[0] == extra.split(" = ")[0]:
            text = text.replace(line + "\n", "")
    path = write(job_dir, text + extra + f'\nout = "{job_dir / "out"}"\n')
    assert pipeq_main(["launch", path, "--quiet"]) == 2  # before any process starts
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("extra", "message"), [
    ("aux_loss_args = { label_smoothing = 0.1 }", "aux_loss_args is given, but aux_loss is not"),
    ("NO_EVAL eval_data_args = { n = 3 }", "eval_data_args is given, but eval_data is not"),
    ('NO_EVAL metrics = { top2 = "launch_jobs:top2" }', "metrics are computed on the evaluation data, but "
                                                          "eval_data is not set"),
    ('NO_EVAL lr_scheduler = "torch.optim.lr_scheduler:ReduceLROnPlateau"\nlr_scheduler_interval = "epoch"\n'
     'lr_scheduler_monitor = "eval_loss"', "lr_scheduler_monitor = 'eval_loss' is not a value the run measures; "
                                           "the eval_* values need eval_data"),
    ("loss_args = { when = 1979-05-27 }", "loss_args.when = datetime.date(1979, 5, 27): a factory's arguments "
                                          "are strings, numbers, booleans, arrays and tables"),
    ("loss_arg = { weight = 1 }", "unknown key(s) ['loss_arg']; did you mean 'loss_args'?"),
    ('lr_scheduler_interval = "epoch"', "lr_scheduler_interval is given, but there is no lr_scheduler"),
    ('lr_scheduler = "torch.optim.lr_scheduler:StepLR"\nlr_scheduler_interval = "weekly"',
     'lr_scheduler_interval = \'weekly\'; use "step"'),
    ('lr_scheduler = "torch.optim.lr_scheduler:ReduceLROnPlateau"\nlr_scheduler_monitor = "eval_loss"',
     'lr_scheduler_monitor = \'eval_loss\' feeds a ReduceLROnPlateau at the end of each epoch: set '
     'lr_scheduler_interval = "epoch"'),
    ('lr_scheduler = "torch.optim.lr_scheduler:ReduceLROnPlateau"\nlr_scheduler_interval = "epoch"\n'
     'lr_scheduler_monitor = "eval_los"', "lr_scheduler_monitor = 'eval_los' is not a value the run measures; "
                                          "did you mean 'eval_loss'?"),
    ('metrics = { top3 = "launch_jobs.top3" }', "metrics.top3 = 'launch_jobs.top3': expected 'package.module:name'"),
])
def test_job_keys_without_what_they_belong_to_are_refused(tmp_path, extra, message) -> None:
    base = MLP
    if extra.startswith("NO_EVAL "):  # a job without eval data
        base, extra = MLP.replace('eval_data = "launch_jobs:heldout"\n', ""), extra[len("NO_EVAL "):]
    with pytest.raises(ValueError) as info:
        load_job(write(tmp_path, base + "steps = 1\n" + extra + "\n"))
    assert message in str(info.value)


def test_launch_refuses_a_monitor_for_a_scheduler_without_metric(tmp_path, capsys) -> None:
    path = write(tmp_path, MLP + 'lr_scheduler = "torch.optim.lr_scheduler:StepLR"\nlr_scheduler_args = '
                 '{ step_size = 2 }\nlr_scheduler_interval = "epoch"\nlr_scheduler_monitor = "train_loss"\n'
                 f'steps = 1\nout = "{tmp_path / "out"}"\n')
    assert launch_code(path) == 2
    assert "takes no metric (only a ReduceLROnPlateau does): drop lr_scheduler_monitor" in capsys.readouterr().err


