"""Checkpoints of the research schedules without processes: the heads saved under their own names and loaded only into their cut, an AL checkpoint serving inference in one process or loading without lr schedulers."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipeq
from pipeq import checkpoint
from pipeq import schedules
from pipeq.research.al.executor import ALModel, build_al_lstm
from pipeq.checkpoint import CheckpointError

pytestmark = pytest.mark.timeout(120)

FAST = dict(start_method="forkserver")
ADAM = functools.partial(torch.optim.Adam, lr=1e-2)
STEP_LR = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5)
# its milestones are a Counter of ints, keys the wire refuses: they travel as items
MULTISTEP = functools.partial(torch.optim.lr_scheduler.MultiStepLR, milestones=[2, 3], gamma=0.1)


def stages(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.3)),
            nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()), nn.Linear(8, 4)]


def heads(seed: int = 1) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Dropout(0.2), nn.Linear(8, 4)), nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 4))]


def batches(steps: int, size: int = 12, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 6, generator=g), torch.randint(0, 4, (size,), generator=g)) for _ in range(steps)]


def interlocking(schedule, mode: str, seed: int = 0):
    # in process mode (the snapshots cross the wire) a MultiStepLR, StepLR otherwise
    scheduler = MULTISTEP if mode == "process" else STEP_LR
    return lambda: pipeq.PipelineRunner(stages(seed), nn.CrossEntropyLoss(), ADAM, schedule, 3, mode=mode,
                                        aux_heads=heads(seed + 1), lr_scheduler=scheduler, **FAST)


def test_heads_are_saved_under_their_own_names(tmp_path):
    with interlocking("pairwise", "simulated")() as r:
        r.step(*batches(1)[0])
        r.save(str(tmp_path / "c"))
        main = r.state_dict()
    ck = checkpoint.load(str(tmp_path / "c"))
    assert list(ck.model) == list(main)  # the flat model's names, heads apart
    assert sorted(ck.aux_model) == sorted(
        ["aux_heads.0.1.weight", "aux_heads.0.1.bias", "aux_heads.1.0.weight", "aux_heads.1.0.bias",
         "aux_heads.1.0.running_mean", "aux_heads.1.0.running_var", "aux_heads.1.0.num_batches_tracked",
         "aux_heads.1.1.weight", "aux_heads.1.1.bias"])
    assert set(ck.aux_optim) == {"aux_heads.0.1.weight", "aux_heads.0.1.bias", "aux_heads.1.0.weight",
                                 "aux_heads.1.0.bias", "aux_heads.1.1.weight", "aux_heads.1.1.bias"}
    assert set(ck.aux_optim["aux_heads.1.1.weight"]["state"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert not any(k.startswith("aux_heads") for k in ck.optim)


def test_heads_load_only_into_the_stage_cut_they_were_saved_from(tmp_path):
    with interlocking("pairwise", "simulated")() as r:
        r.step(*batches(1)[0])
        r.save(str(tmp_path / "heads"))
    two = pipeq.PipelineRunner([nn.Sequential(*stages()[0], *stages()[1]), stages()[2]], nn.CrossEntropyLoss(),
                               ADAM, "pairwise", 3, mode="simulated", aux_heads=[heads()[1]])
    with two:
        with pytest.raises(CheckpointError, match="saved from 3 stages and holds auxiliary heads.*load_state_dict"):
            two.load(str(tmp_path / "heads"))
    with pipeq.PipelineRunner(stages(), nn.CrossEntropyLoss(), ADAM, "1f1b", 3, mode="simulated") as plain:
        plain.save(str(tmp_path / "plain"))
        with pytest.raises(CheckpointError, match="unexpected aux_heads.0.1.weight"):
            plain.load(str(tmp_path / "heads"))
    with interlocking("pairwise", "simulated")() as r:
        with pytest.raises(CheckpointError, match=r"missing aux_heads.0.1.weight \(stage 0\)"):
            r.load(str(tmp_path / "plain"))


# -- Associated Learning ----------------------------------------------------------------------------
VOCAB, CLASSES = 13, 3


def tokens(steps: int, size: int = 8, seed: int = 4):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(1, VOCAB, (size, 6), generator=g)
        x[:, 4:][torch.rand(size, 2, generator=g) < 0.5] = 0
        x[:, 5][x[:, 4] == 0] = 0  # padding at the end only
        out.append((x, torch.randint(0, CLASSES, (size,), generator=g)))
    return out


def al_layers(seed: int = 0):
    torch.manual_seed(seed)
    return build_al_lstm(VOCAB, CLASSES, embed_dim=5, hidden=4, lstm_layers=2, label_width=3)


def al_run(mode: str):
    return lambda: pipeq.PipelineRunner(al_layers(), None, ADAM, schedules.AssociatedLearning(), 2, mode=mode,
                                        lr_scheduler=STEP_LR, **FAST)


def test_an_al_checkpoint_serves_inference_in_one_process(tmp_path):
    data = tokens(2)
    with al_run("simulated")() as r:
        for x, y in data:
            r.step(x, y)
        r.save(str(tmp_path / "c"))
        want = r.predict(data[0][0])
    model = ALModel(al_layers(seed=7))
    model.load_state_dict(checkpoint.load(str(tmp_path / "c")).model)
    with torch.no_grad():
        assert torch.allclose(model.eval()(data[0][0]), want, atol=1e-6)


def test_an_al_checkpoint_loads_into_a_run_without_lr_schedulers(tmp_path):
    with al_run("simulated")() as r:
        r.step(*tokens(1)[0])
        r.save(str(tmp_path / "c"))
    bare = pipeq.PipelineRunner(al_layers(), None, ADAM, schedules.AssociatedLearning(), 2, mode="simulated")
    with bare:  # no scheduler here: the saved schedules are not needed, the rest loads
        bare.load(str(tmp_path / "c"))
