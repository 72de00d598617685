"""Checkpoints: name mapping, optimizer snapshots, save/load on disk, and re-splitting 3 stages into 2."""

from __future__ import annotations

import copy
import hashlib
import json
import os

import pytest
import torch
from torch import nn

import pipeq

from pipeq.checkpoint import (
    CheckpointError,
    StageSnapshot,
    checkpoint_dir,
    flat_model,
    global_names,
    global_state,
    latest,
    layer_of,
    layout_of,
    load,
    load_optimizer_snapshot,
    optimizer_snapshot,
    prune,
    save,
    split,
    split_state,
    stage_snapshot,
    to_global,
)

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


def flat_layers(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)]


def cut(layers: list[nn.Module], sizes: list[int]) -> list[nn.Sequential]:
    layers = copy.deepcopy(layers)
    bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    return [nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:])]


def train(stages: list[nn.Module], optims: list[torch.optim.Optimizer], steps: int, seed: int) -> None:
    """Train the stages chained in one process; the same ops as the flat model, so the same bits."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 3, generator=gen)
        for opt in optims:
            opt.zero_grad()
        out = x
        for stage in stages:
            out = stage(out)
        nn.functional.mse_loss(out, y).backward()
        for opt in optims:
            opt.step()


def assert_same_params(stages: list[nn.Module], flat: nn.Module) -> None:
    got = nn.Sequential(*[m for s in stages for m in (s if isinstance(s, nn.Sequential) else [s])])
    want = flat.state_dict()
    assert got.state_dict().keys() == want.keys()
    for name, t in got.state_dict().items():
        assert torch.equal(t, want[name]), name


# ---------------------------------------------------------------------------- names


def test_names_map_to_the_flat_model_for_any_split():
    three, two = cut(flat_layers(), [3, 2, 1]), cut(flat_layers(), [1, 5])
    flat = set(nn.Sequential(*flat_layers()).state_dict())
    for stages in (three, two):
        offset, names = 0, set()
        for s in stages:
            for local in s.state_dict():
                names.add(to_global(local, offset, True))
            offset += len(s)
        assert names == flat
    assert to_global("1.weight", 3, True) == "4.weight" and layer_of("4.weight") == 4
    with pytest.raises(ValueError, match="child index"):
        to_global("weight", 3, True)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))
        self.register_buffer("shift", torch.zeros(8))

    def forward(self, x):
        return self.lin(x) * self.scale + self.shift


def test_a_non_sequential_stage_is_one_layer():
    stages = [nn.Sequential(nn.Linear(4, 8), nn.ReLU()), Block(), nn.Sequential(nn.Linear(8, 3))]
    offsets = [0, 2, 3]
    names = {to_global(n, off, isinstance(s, nn.Sequential)) for s, off in zip(stages, offsets) for n in s.state_dict()}
    assert {"2.lin.weight", "2.scale", "2.shift", "3.weight"} <= names
    assert names == set(nn.Sequential(*[stages[0][0], stages[0][1], stages[1], stages[2][0]]).state_dict())
    lay = layout_of(stages[1])
    assert (lay.model_names, lay.param_names, lay.layers, lay.sequential) == (
        ["scale", "shift", "lin.weight", "lin.bias"], ["scale", "lin.weight", "lin.bias"], 1, False)
    assert lay.shapes["lin.weight"] == [8, 8] and lay.dtypes["shift"] == "float32"


class OwnScale(nn.Sequential):
    """An nn.Sequential with a parameter of its own: not a chain of layers, so one layer."""

    def __init__(self):
        super().__init__(nn.Linear(8, 8), nn.ReLU())
        self.scale = nn.Parameter(torch.ones(8))


def test_flat_model_names_are_the_global_names():
    stages = [nn.Sequential(nn.Linear(4, 8), nn.ReLU()), OwnScale(), Block(), nn.Linear(8, 3)]
    layouts = [layout_of(s) for s in stages]
    assert [lay.layers for lay in layouts] == [2, 1, 1, 1] and not layouts[1].sequential
    flat = flat_model(stages)
    assert flat[2] is stages[1] and len(flat) == 5
    names = [g for per in global_names(layouts) for g in per]
    assert names == list(flat.state_dict()) and "2.scale" in names and "2.0.weight" in names
    per_stage = [(list(s.state_dict()), list(s.state_dict().values())) for s in stages]
    state = global_state(per_stage, layouts)
    assert list(state) == names
    back = split_state(state, layouts)  # the round trip gives each stage its own names
    assert [names for names, _ in back] == [names for names, _ in per_stage]


# ---------------------------------------------------------------------------- optimizer


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_optimizer_snapshot_round_trips_bit_identically(kind):
    (module,) = cut(flat_layers(), [6])
    opt = OPTIMIZERS[kind](module.parameters())
    train([module], [opt], 2, seed=1)
    snap = optimizer_snapshot(module, opt)
    assert set(snap) == {n for n, _ in module.named_parameters()}
    frozen = copy.deepcopy(snap)

    fresh = cut(flat_layers(seed=9), [6])[0]
    fresh.load_state_dict(module.state_dict())
    fresh_opt = OPTIMIZERS[kind](fresh.parameters())
    load_optimizer_snapshot(fresh, fresh_opt, snap, "cpu")
    train([module], [opt], 3, seed=2)
    train([fresh], [fresh_opt], 3, seed=2)
    assert_same_params([fresh], module)
    for name, entry in snap.items():  # neither training touched the snapshot
        for key, value in entry["state"].items():
            assert not isinstance(value, torch.Tensor) or torch.equal(value, frozen[name]["state"][key])


def test_param_groups_keep_their_hyperparameters():
    module = nn.Linear(4, 3)
    opt = torch.optim.Adam([{"params": [module.weight]}, {"params": [module.bias], "lr": 0.5}], lr=1e-2)
    snap = optimizer_snapshot(module, opt)
    assert snap["bias"]["group"]["lr"] == 0.5 and snap["bias"]["group"]["betas"] == [0.9, 0.999]
    assert snap["weight"]["state"] == {}  # no step yet: empty state, still listed
    fresh_opt = torch.optim.Adam([{"params": [module.weight]}, {"params": [module.bias]}], lr=1e-2)
    load_optimizer_snapshot(module, fresh_opt, snap, "cpu")
    assert fresh_opt.param_groups[1]["lr"] == 0.5 and fresh_opt.param_groups[0]["betas"] == (0.9, 0.999)

    one_group = torch.optim.Adam(module.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="weight and bias"):
        load_optimizer_snapshot(module, one_group, snap, "cpu")
    with pytest.raises(ValueError, match="bias"):
        load_optimizer_snapshot(module, fresh_opt, {"weight": snap["weight"]}, "cpu")
    stranger = torch.optim.SGD([*module.parameters(), nn.Parameter(torch.zeros(7))], lr=0.1)
    with pytest.raises(ValueError, match=r"\(7,\)"):
        optimizer_snapshot(module, stranger)


# ---------------------------------------------------------------------------- disk


def make_checkpoint(directory, kind="adam", sizes=(3, 2, 1), steps=2):
    stages = cut(flat_layers(), list(sizes))
    optims = [OPTIMIZERS[kind](s.parameters()) for s in stages]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in optims]
    train(stages, optims, steps, seed=1)
    for s in scheds:
        s.step()
    save(directory, [stage_snapshot(s, o, sc) for s, o, sc in zip(stages, optims, scheds)], {"step": steps})
    return stages, optims


def test_save_load_round_trip(tmp_path):
    stages, _ = make_checkpoint(str(tmp_path / "ck"))
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert manifest["format"] == "pipeq-checkpoint" and manifest["n_stages"] == 3
    assert [f["name"] for f in manifest["files"]] == ["stage-0.pt", "stage-1.pt", "stage-2.pt"]
    assert not [n for n in os.listdir(tmp_path / "ck") if n.endswith(".tmp")]
    ckpt = load(str(tmp_path / "ck"))
    assert ckpt.n_stages == 3 and ckpt.layers == [3, 2, 1] and ckpt.meta == {"step": 2}
    flat = nn.Sequential(*[m for s in stages for m in s]).state_dict()
    assert ckpt.model.keys() == flat.keys() and all(torch.equal(ckpt.model[k], flat[k]) for k in flat)
    assert set(ckpt.optim) == {n for n, _ in nn.Sequential(*[m for s in stages for m in s]).named_parameters()}
    assert [s["_last_lr"] for s in ckpt.sched] == [[5e-3]] * 3 and all(r.dtype == torch.uint8 for r in ckpt.rng)

    resplit = split(ckpt, [layout_of(s) for s in stages])  # same stage count: rng stays per stage
    assert all(torch.equal(r["rng"], ckpt.rng[k]) for k, r in enumerate(resplit))


def test_saving_over_a_checkpoint_replaces_it(tmp_path):
    make_checkpoint(str(tmp_path), sizes=(3, 2, 1))
    make_checkpoint(str(tmp_path), sizes=(1, 5))
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", "stage-0.pt", "stage-1.pt"]
    assert load(str(tmp_path)).layers == [1, 5]


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_three_stages_resume_as_two_bit_identically(tmp_path, kind):
    flat = nn.Sequential(*copy.deepcopy(flat_layers()))
    flat_opt = OPTIMIZERS[kind](flat.parameters())
    flat_sched = torch.optim.lr_scheduler.StepLR(flat_opt, step_size=1, gamma=0.5)
    train([flat], [flat_opt], 2, seed=1)
    flat_sched.step()  # as make_checkpoint does: the saved lr is half the initial one
    make_checkpoint(str(tmp_path), kind=kind, sizes=(3, 2, 1), steps=2)

    two = cut(flat_layers(seed=5), [1, 5])  # other weights: everything must come from the checkpoint
    two_opts = [OPTIMIZERS[kind](s.parameters()) for s in two]
    snaps = split(load(str(tmp_path)), [layout_of(s) for s in two])
    for stage, opt, snap in zip(two, two_opts, snaps):
        stage.load_state_dict(snap["model"])
        load_optimizer_snapshot(stage, opt, snap["optim"], "cpu")
        assert snap["rng"] is None and snap["sched"] == flat_sched.state_dict()
    assert_same_params(two, flat)
    train([flat], [flat_opt], 3, seed=2)
    train(two, two_opts, 3, seed=2)
    assert_same_params(two, flat)


def test_split_without_optimizer_state(tmp_path):
    stages = cut(flat_layers(), [3, 3])
    save(str(tmp_path), [stage_snapshot(s) for s in stages], {})
    snaps = split(load(str(tmp_path)), [layout_of(s) for s in cut(flat_layers(), [2, 4])])
    assert [s["optim"] for s in snaps] == [{}, {}] and snaps[1]["model"]["0.weight"].shape == (8, 8)


def test_mismatched_layouts_list_missing_and_unexpected_names(tmp_path):
    make_checkpoint(str(tmp_path))
    ckpt = load(str(tmp_path))
    short = [nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))]
    with pytest.raises(CheckpointError) as err:
        split(ckpt, [layout_of(s) for s in short])
    text = str(err.value)
    assert text.startswith("checkpoint does not fit these 2 stages")
    assert "the checkpoint has 6 layers, these stages 5" in text
    assert "missing 4.weight (stage 1), 4.bias (stage 1)" in text
    assert "unexpected 3.weight, 3.bias, 3.running_mean" in text and "and 1 more" in text

    del ckpt.optim["5.bias"]
    with pytest.raises(CheckpointError, match=r"missing optimizer state of 5.bias \(stage 1\)"):
        split(ckpt, [layout_of(s) for s in cut(flat_layers(), [1, 5])])


def test_damaged_checkpoints_are_refused(tmp_path):
    make_checkpoint(str(tmp_path))
    path = tmp_path / "stage-1.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"stage-1\.pt does not match its sha256"):
        load(str(tmp_path))
    path.write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointError, match=r"stage-1\.pt has 100 bytes"):
        load(str(tmp_path))
    path.unlink()
    with pytest.raises(CheckpointError, match=r"stage-1\.pt is missing"):
        load(str(tmp_path))
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="has no manifest.json: not a pipeq checkpoint"):
        load(str(tmp_path))


class Payload:
    """Not a tensor: a weights_only load must refuse to build it."""


def test_load_never_unpickles_arbitrary_objects(tmp_path):
    make_checkpoint(str(tmp_path))
    path = tmp_path / "stage-0.pt"
    torch.save({"model": {}, "optim": {}, "sched": None, "rng": None, "layers": 3, "payload": Payload()}, path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())


    manifest["files"][0].update(bytes=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"stage-0\.pt cannot be loaded safely"):
        load(str(tmp_path))


def test_latest_picks_the_highest_complete_step(tmp_path):
    root = str(tmp_path)
    assert latest(root) is None and latest(str(tmp_path / "nowhere")) is None
    make_checkpoint(checkpoint_dir(root, 5))
    make_checkpoint(checkpoint_dir(root, 12))
    (tmp_path / "step-00000012" / "manifest.json").unlink()  # a save that did not finish
    os.makedirs(checkpoint_dir(root, 30))
    (tmp_path / "step-abc").mkdir()
    (tmp_path / "step-00000099").write_text("a file, not a checkpoint")
    assert checkpoint_dir(root, 5) == os.path.join(root, "step-00000005")
    assert latest(root) == checkpoint_dir(root, 5)
    make_checkpoint(checkpoint_dir(root, 7))
    assert latest(root) == checkpoint_dir(root, 7)


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path) -> None:
    root = str(tmp_path)
    snap = stage_snapshot(nn.Linear(2, 2))
    for step in (5, 10, 15, 20):
        save(checkpoint_dir(root, step), [snap], {"step": step})
    os.makedirs(checkpoint_dir(root, 25))  # an unfinished save: no manifest, never counted
    gone = prune(root, 2)
    assert [os.path.basename(p) for p in gone] == ["step-00000025", "step-00000005", "step-00000010"]
    assert sorted(os.listdir(root)) == ["step-00000015", "step-00000020"]
    assert latest(root) == checkpoint_dir(root, 20)
    assert prune(root, 0) == []  # 0 keeps everything


# ---------------------------------------------------------------------------- crash safety
#
# A saver process re-saves into a folder that holds a checkpoint and is killed (SIGKILL: no
# cleanup runs) at some moment; the folder must still load, as the last checkpoint whose save
# finished or as the one whose save was being killed, never as a mix, never not at all.

N_FILES = 4  # tiny tensors but several files: a save is mostly file creation and fsyncs


def numbered(gen: int, n_files: int = N_FILES) -> list[StageSnapshot]:
    """Snapshots whose every tensor holds ``gen``: a loaded checkpoint shows which save wrote it."""
    return [StageSnapshot(model={"0.weight": torch.full((4,), float(gen))}, optim={}, sched=None, rng=None,
                          layers=1, sequential=True) for _ in range(n_files)]


def leftovers(parent: str, name: str = "ck") -> list[str]:
    return sorted(e for e in os.listdir(parent) if e != name)


def test_a_step_checkpoint_left_as_old_is_found_and_put_back(tmp_path):
    root = str(tmp_path)
    save(checkpoint_dir(root, 5), numbered(5, 2), {"gen": 5})
    save(checkpoint_dir(root, 10), numbered(10, 2), {"gen": 10})
    os.rename(checkpoint_dir(root, 10), os.path.join(root, ".step-00000010.old"))  # killed mid-swap
    os.makedirs(os.path.join(root, ".step-00000015.0123456789abcdef.tmp"))  # killed before its swap
    os.makedirs(checkpoint_dir(root, 20))  # an older pipeq's unfinished save
    (tmp_path / "step-00000020" / "stage-0.pt").write_bytes(b"half")
    os.makedirs(checkpoint_dir(root, 30))  # not ours to delete: it holds a file no checkpoint holds
    (tmp_path / "step-00000030" / "notes.txt").write_text("mine")
    assert latest(root) == checkpoint_dir(root, 10) and load(latest(root)).meta["gen"] == 10
    gone = prune(root, 5)
    assert sorted(os.path.basename(p) for p in gone) == [".step-00000015.0123456789abcdef.tmp", "step-00000020"]
    assert sorted(os.listdir(root)) == ["step-00000005", "step-00000010", "step-00000030"]
    assert load(checkpoint_dir(root, 10)).meta["gen"] == 10


def test_save_refuses_a_folder_holding_other_files(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"holds files no checkpoint holds \(notes\.txt\)"):
        save(str(tmp_path / "run"), numbered(1, 2), {"gen": 1})
    assert os.listdir(tmp_path / "run") == ["notes.txt"] and leftovers(str(tmp_path), "run") == []
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        with pytest.raises(CheckpointError, match="current directory"):
            save(".", numbered(1, 2), {"gen": 1})
    finally:
        os.chdir(cwd)


def test_split_refuses_shapes_and_dtypes_that_do_not_fit(tmp_path):
    make_checkpoint(str(tmp_path))
    ckpt = load(str(tmp_path))
    wide = [nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 8)), nn.Sequential(nn.BatchNorm1d(8), nn.ReLU()),
            nn.Linear(8, 3).double()]
    with pytest.raises(CheckpointError) as err:
        split(ckpt, [layout_of(s) for s in wide])
    text = str(err.value)
    assert "0.weight has shape (8, 4) in the checkpoint, stage 0 expects (9, 4)" in text
    assert "2.weight has shape (8, 8) in the checkpoint, stage 0 expects (8, 9)" in text
    assert "5.weight is float32 in the checkpoint, stage 2 holds float64" in text
    assert "3.weight" not in text  # what fits is not named


def test_split_state_takes_flat_or_stage_prefixed_names():
    stages = cut(flat_layers(), [3, 2, 1])
    layouts = [layout_of(s) for s in stages]
    flat = nn.Sequential(*flat_layers()).state_dict()
    per_stage = split_state(flat, layouts)
    assert per_stage[1][0] == list(stages[1].state_dict()) and torch.equal(per_stage[1][1][0], flat["3.weight"])
    prefixed = nn.Sequential(*stages).state_dict()  # "1.0.weight" (older pipeq): mapped to the same
    for (names_a, xs), (names_b, ys) in zip(split_state(prefixed, layouts), split_state(
            global_state([(list(s.state_dict()), list(s.state_dict().values())) for s in stages], layouts),
            layouts)):
        assert names_a == names_b and all(torch.equal(a, b) for a, b in zip(xs, ys))
    with pytest.raises(ValueError, match=r"missing keys \['5.bias'\], unexpected keys \[\]"):
        split_state({k: v for k, v in flat.items() if k != "5.bias"}, layouts)
    with pytest.raises(ValueError, match=r"state_dict\['3.weight'\] has shape \(2,\), stage 1 expects \(8,\)"):
        split_state({**flat, "3.weight": torch.zeros(2)}, layouts)


def test_stages_sliced_from_a_sequential_are_named_as_the_whole_model():
    """``model[2:4]`` keeps its children's names (2, 3): the state still loads into ``model``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    stages = [model[0:2], model[2:4], model[4:]]
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), lambda p: torch.optim.SGD(p, lr=0.1),
                                  microbatches=2, mode="simulated")
    with runner:
        runner.step(torch.randn(8, 4), torch.randint(0, 3, (8,)))
        state = runner.state_dict()
    assert list(state) == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    model.load_state_dict(state)  # strict: every name is the whole model's
    assert list(stages[1]._modules) == ["2", "3"]  # the caller's stage is left as it was


def test_positional_renames_a_slice_only():
    """What both the runner and a job's recipe do to a stage: a slice's children named 0, 1, ...;
    a stage named as it should be, or declaring its names (a StageInfo), is the same object."""
    from pipeq.checkpoint.names import positional
    from pipeq.stage.info import set_info

    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    sliced = positional(model[1:].eval())
    assert list(sliced._modules) == ["0", "1"] and sliced[1] is model[2] and not sliced.training
    assert positional(model) is model and positional(model[0]) is model[0]
    declared = set_info(model[1:], model_names=True)
    assert positional(declared) is declared
