"""Associated learning of sequence models (LSTM state tuples, embeddings) in stage processes: the same numbers as the reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from al_seq_cases import (
    ADAM, CLASSES, LENGTH, VOCAB, al_reference, assert_close, lstm_layers, reference_predict, run, tokens
)
from pipeq.research import build_al

pytestmark = pytest.mark.timeout(120)


# -- 1. equality with the reference -------------------------------------------------------------
@pytest.mark.parametrize("mode", ["simulated", "process"])
def test_lstm_al_with_tuple_state_equals_the_reference(mode):
    """Embedding first layer (int64 tokens), then two bidirectional LSTM layers, the second one
    starting from the first one's (h, c): (out, mask, (h, c)) travels between the stages."""
    layers = lstm_layers()
    x, y = tokens(24)
    batches = [(x[:12], y[:12]), (x[12:], y[12:])]
    state, scores = run(layers, batches, mode)
    ref = al_reference(layers, x.split(3), y.split(3), ADAM)
    assert_close(state, nn.Sequential(*ref).state_dict())
    init = nn.Sequential(*layers).state_dict()
    assert all(not torch.equal(state[k], init[k]) for k in init if k.split(".")[1] in "fbgh"
               and not k.endswith("embed.weight")), "every part trains"
    assert torch.allclose(scores, reference_predict(ref, x[:12]), atol=1e-5)


def test_embedding_first_layer_through_build_al_equals_the_reference():
    """The issue's own case: build_al over an nn.Embedding block (its output flattened): the
    label path's one-hot is float whatever the integer input is."""
    torch.manual_seed(2)
    blocks = [nn.Embedding(VOCAB, 3), nn.Sequential(nn.Linear(3 * LENGTH, 8), nn.ReLU())]
    layers = build_al(blocks, [3 * LENGTH, 8], CLASSES, label_widths=[5, 4])
    x, y = tokens(20, seed=7)
    state, _ = run(layers, [(x, y)], "process", microbatches=5)
    assert_close(state, nn.Sequential(*al_reference(layers, x.split(4), y.split(4), ADAM)).state_dict())
