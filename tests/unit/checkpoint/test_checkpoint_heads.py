"""Checkpoints of the research schedules without processes: the heads saved under their own names and loaded only into their cut, an AL checkpoint serving inference in one process or loading without lr schedulers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeq
from checkpoint_cases import ADAM, al_layers, al_run, batches, heads, interlocking, stages, tokens
from pipeq import checkpoint
from pipeq import schedules
from pipeq.research import ALModel
from pipeq.checkpoint import CheckpointError

pytestmark = pytest.mark.timeout(120)


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
