"""A batch given as its microbatches (``pipeq.Microbatches``), of different lengths and rows, trains
equal to one process computing the loss over the whole batch; the loss is weighted per token or per
sample (``loss_weighting``), for any loss, a plain function too. Simulated mode: starts no process."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import pipeq
from pipeq import Microbatches
from pipeq.checkpoint import flat_model
from pipeq.stage.loss import microbatch_weights, tokens

pytestmark = pytest.mark.timeout(120)

V, D = 13, 6  # vocabulary, width
SGD = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.5)
LENGTHS, ROWS = (7, 4, 9), (2, 3, 2)  # three microbatches: lengths and rows all differ


class Embed(nn.Module):
    """Stage 0: tokens (B, L) -> (B, L, D), for any L."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)

    def forward(self, tokens):
        return self.emb(tokens)


class Head(nn.Module):
    """Stage 1: a per-position MLP, (B, L, D) -> logits (B, L, V)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, V))

    def forward(self, h):
        return self.mlp(h)


def stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [Embed().double(), Head().double()]


def lm_loss(out, y):
    """A plain function: the mean cross-entropy over the tokens whose target is not -100."""
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1))


def microbatches(seed: int, pad: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Token and target microbatches of ``LENGTHS`` x ``ROWS``; ``pad``: each row's tail targets
    are -100 (padding), a different number per row."""
    g = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for length, rows in zip(LENGTHS, ROWS):
        xs.append(torch.randint(0, V, (rows, length), generator=g))
        y = torch.randint(0, V, (rows, length), generator=g)
        if pad:
            for i in range(rows):
                y[i, 1 + int(torch.randint(0, length - 1, (1,), generator=g)):] = -100
        ys.append(y)
    return xs, ys


def token_mean(model, xs, ys):
    """One process: the mean cross-entropy over every token of the batch, padding left out."""
    logits = torch.cat([model(x).reshape(-1, V) for x in xs])
    return F.cross_entropy(logits, torch.cat([y.reshape(-1) for y in ys]))


def sample_mean(model, xs, ys):
    """One process: the mean over the batch's samples of each sample's mean over its tokens."""
    per = [lm_loss(model(x[i:i + 1]), y[i:i + 1]) for x, y in zip(xs, ys) for i in range(x.shape[0])]
    return torch.stack(per).mean()


def reference(loss_of, steps):
    """Plain training of the whole model, one optimizer step per batch (:func:`models.reference_train`): (state, losses)."""
    from models import reference_train

    model, losses = reference_train([], None, SGD, steps, model=nn.Sequential(*copy.deepcopy(stages())),
                                    loss_of=lambda m, step: loss_of(m, *step))
    return flat_model(list(model)).state_dict(), losses


def assert_states_close(got, want):
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5, msg=k)


STEPS = [microbatches(s, pad=False) for s in range(2)]
PADDED = [microbatches(s, pad=True) for s in range(2)]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("weighting, loss_of", [("token", token_mean), ("sample", sample_mean)])
def test_a_plain_function_over_microbatches_of_different_lengths_equals_one_process(schedule, weighting, loss_of):
    want_state, want = reference(loss_of, STEPS)
    runner = pipeq.PipelineRunner(stages(), lm_loss, SGD, schedule, 3, mode="simulated", loss_weighting=weighting)
    with runner:
        got = [runner.step(Microbatches(xs), Microbatches(ys)) for xs, ys in STEPS[:1]]
        got += [runner.step([(x, y) for x, y in zip(*STEPS[1])])]  # pairs, the target left out
        state = runner.state_dict()
    assert got == pytest.approx(want, abs=1e-9)
    assert_states_close(state, want_state)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_cross_entropy_on_padded_microbatches_is_the_token_mean(schedule):
    """nn.CrossEntropyLoss(ignore_index=-100), the default weighting: the mean over every kept
    token of the batch, as one process computes it; a stream and evaluate agree."""
    want_state, want = reference(token_mean, PADDED)
    loss = nn.CrossEntropyLoss(ignore_index=-100)
    runner = pipeq.PipelineRunner(stages(), lambda o, y: loss(o.reshape(-1, V), y.reshape(-1)), SGD, schedule, 3,
                                  mode="simulated")
    with runner:
        batches = [(Microbatches(PADDED[0][0]), Microbatches(PADDED[0][1])), Microbatches(zip(*PADDED[1]))]
        got = list(runner.stream(batches))  # x and target item by item, then pairs
        state = runner.state_dict()
        out = runner.predict(Microbatches(PADDED[0][0]))
        evaluated = runner.evaluate([(Microbatches(xs), Microbatches(ys)) for xs, ys in PADDED[:1]])
        assert runner.evaluate((Microbatches(PADDED[0][0]), Microbatches(PADDED[0][1]))) == evaluated  # one batch
        pairs = Microbatches(zip(*PADDED[0]))  # two batches, each given as (x, target) pairs
        assert runner.evaluate((pairs, pairs)) == pytest.approx(evaluated)
    assert got == pytest.approx(want, abs=1e-9)
    assert_states_close(state, want_state)
    assert isinstance(out, Microbatches) and [tuple(o.shape) for o in out] == [(r, n, V) for n, r in zip(LENGTHS, ROWS)]
    model = nn.Sequential(*stages())
    model.load_state_dict(dict(zip(model.state_dict(), state.values())))
    with torch.no_grad():
        assert evaluated["loss"] == pytest.approx(token_mean(model, *PADDED[0]).item(), abs=1e-9)


def test_a_plain_function_on_one_padded_tensor_batch_is_the_token_mean():
    """The default weighting for a plain function, on an ordinary batch split by the runner: rows
    padded differently weigh by their kept tokens, so the step equals one process's loss."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, V, (6, 8), generator=g), torch.randint(0, V, (6, 8), generator=g)
    for i, keep in enumerate((8, 1, 3, 8, 2, 5)):
        y[i, keep:] = -100
    want_state, want = reference(lambda m, xs, ys: lm_loss(m(xs[0]), ys[0]), [([x], [y])])
    with pipeq.PipelineRunner(stages(), lm_loss, SGD, "1f1b", 3, mode="simulated") as runner:
        got = runner.step(x, y)
        state = runner.state_dict()
    assert got == pytest.approx(want[0], abs=1e-9)
    assert_states_close(state, want_state)


def test_misgiven_microbatches_are_refused_naming_the_microbatch_and_the_setting():
    xs, ys = STEPS[0]
    with pipeq.PipelineRunner(stages(), lm_loss, SGD, "1f1b", 2, mode="simulated") as runner:
        with pytest.raises(ValueError, match=r"holds 3 microbatches; it must hold 1 to microbatches=2"):
            runner.step(Microbatches(xs), Microbatches(ys))
        with pytest.raises(ValueError, match=r"microbatch 1: x has 3 samples \(\(3, 4\) int64\) but its target has 2"):
            runner.step(Microbatches(xs[:2]), Microbatches([ys[0], ys[0]]))
        with pytest.raises(ValueError, match="x holds 2 microbatches but target holds 1"):
            runner.step(Microbatches(xs[:2]), Microbatches(ys[:1]))
        with pytest.raises(ValueError, match="x is a pipeq.Microbatches, but target is a list"):
            runner.step(Microbatches(xs[:2]), ys[:2])
        with pytest.raises(ValueError, match=r"microbatch 0 is a Tensor: .* \(x, target\) pairs"):
            runner.step(xs[:2])
        with pytest.raises(ValueError, match=r"x \(microbatch 1\) must have a non-empty batch dimension"):
            runner.step(Microbatches([xs[0], xs[1][:0]]), Microbatches(ys[:2]))
        assert runner.step(Microbatches(xs[:1]), Microbatches(ys[:1])) > 0  # fewer than microbatches: fine
    with pipeq.PipelineRunner(stages(), lm_loss, SGD, "async", 3, mode="simulated") as runner:
        with pytest.raises(ValueError, match="batches given as Microbatches, run with the backprop schedules"):
            runner.step(Microbatches(xs), Microbatches(ys))
    from pipeq.control.batching import Batcher

    replicated = Batcher("1f1b", 2, 2, lm_loss, replicas=2)  # 3 microbatches over 2 replicas: not a multiple
    with pytest.raises(ValueError, match=r"holds 3 microbatches, not a multiple of data_parallel=2; it must hold 1 "
                                         r"to microbatches=2 per replica"):
        replicated.given_sizes(Microbatches(xs))
    with pytest.raises(ValueError, match=r"holds 3 microbatches per replica \(data_parallel=2: 6 in all\)"):
        replicated.given_sizes(Microbatches(xs + xs))


def test_microbatch_weights_count_tokens_or_rows():
    y = Microbatches([torch.tensor([[1, 2, -100]]), torch.tensor([[3, -100, -100], [4, 5, 6]])])
    assert microbatch_weights(lm_loss, y, [1, 2]) == [2 / 6, 4 / 6]
    assert microbatch_weights(lm_loss, y, [1, 2], "sample") == [1 / 3, 2 / 3]
    assert microbatch_weights(nn.CrossEntropyLoss(reduction="sum"), y, [1, 2]) == [1.0, 1.0]
    own = nn.CrossEntropyLoss(ignore_index=3)  # its own ignore_index: -100 is then a token
    assert tokens(own, y[1]) == 5
    bound = functools.partial(F.cross_entropy, ignore_index=3)  # a partial's keywords too
    assert tokens(bound, y[1]) == 5
    assert microbatch_weights(functools.partial(F.cross_entropy, reduction="sum"), y, [1, 2]) == [1.0, 1.0]
    weighted = nn.CrossEntropyLoss(weight=torch.arange(7, dtype=torch.float))  # class weights count
    assert microbatch_weights(weighted, y, [1, 2]) == [3 / 21, 18 / 21]
    floats = torch.zeros(5, 4)  # float targets: every element counts (-100 is a value)
    assert microbatch_weights(nn.MSELoss(), floats - 100, [3, 2]) == [0.6, 0.4]
    assert microbatch_weights(lm_loss, torch.full((4, 2), -100), [2, 2]) == [0.5, 0.5]  # nothing counts: NaN
    with pytest.raises(ValueError, match="loss_weighting must be 'token' or 'sample'"):
        microbatch_weights(lm_loss, y, [1, 2], "tokens")
    with pytest.raises(ValueError, match=r"loss_weighting must be 'token' \(each .*\) or 'sample'"):
        pipeq.PipelineRunner(stages(), lm_loss, SGD, "1f1b", 2, mode="simulated", loss_weighting="row")
