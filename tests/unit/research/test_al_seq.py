"""Associated Learning on sequence models: token ids into an Embedding first layer, an LSTM's
``(h, c)`` and a padding mask riding along with ``s``, against a one-process AL loop
(``tests/support/al_seq_cases.py``); the one-process inference module (:class:`pipeq.research.ALModel`)
against ``predict``; the blocks' errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from al_seq_cases import (
    ADAM, CLASSES, LENGTH, VOCAB, al_reference, assert_close, lstm_layers, reference_predict, run, tokens
)
from pipeq.research import (ALLayer, ALModel, LSTMLayer, TokenEmbedding, build_al_lstm, build_al_transformer)

pytestmark = pytest.mark.timeout(120)


# -- 1. equality with the reference -------------------------------------------------------------
def test_unidirectional_lstm_al_equals_the_reference():
    layers = lstm_layers(seed=1, bidirectional=False)
    x, y = tokens(16, seed=5)
    state, _ = run(layers, [(x, y)], "simulated")
    assert_close(state, nn.Sequential(*al_reference(layers, x.split(4), y.split(4), ADAM)).state_dict())


def test_transformer_al_with_its_mask_equals_the_reference():
    torch.manual_seed(3)
    layers = build_al_transformer(VOCAB, CLASSES, d_model=8, nhead=2, layers=2, dim_feedforward=12, label_width=4,
                                  max_len=LENGTH)
    x, y = tokens(16, seed=9)
    state, scores = run(layers, [(x, y)], "simulated")
    ref = al_reference(layers, x.split(4), y.split(4), ADAM)
    assert_close(state, nn.Sequential(*ref).state_dict())
    assert torch.allclose(scores, reference_predict(ref, x), atol=1e-5)


def test_a_label_path_that_embeds_the_class_index():
    """g_1 an nn.Embedding of the class: it is fed the index, not the one-hot."""
    layers = lstm_layers(seed=4)
    layers[0].g = nn.Sequential(nn.Embedding(CLASSES, 4), nn.Tanh())
    x, y = tokens(12, seed=11)
    state, _ = run(layers, [(x, y)], "simulated")
    ref = al_reference(layers, x.split(3), y.split(3), ADAM, label_index=True)
    assert_close(state, nn.Sequential(*ref).state_dict())


# -- 2. one-process inference -------------------------------------------------------------------
def test_al_model_loads_a_runs_state_and_predicts_like_the_run():
    layers = lstm_layers(seed=6)
    x, y = tokens(16, seed=13)
    state, scores = run(layers, [(x, y)], "simulated")
    model = ALModel(lstm_layers(seed=99))  # other weights, then the run's
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model(x), scores, atol=1e-6)
    shortcut = ALModel(layers, inference_layer=0)
    with torch.no_grad():  # f_0, b_0, h_0: the pooled embedding decoded
        want = torch.tanh(layers[0].h(layers[0].b(*layers[0].f(x))))
        assert torch.allclose(shortcut.eval()(x), want)


def test_al_model_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="layer 1 is a Linear"):
        ALModel([lstm_layers()[0], nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="inference_layer=5"):
        ALModel(lstm_layers(), inference_layer=5)


# -- 3. the blocks' errors ----------------------------------------------------------------------
def test_token_embedding_wants_integer_ids_and_fits_max_len():
    with pytest.raises(ValueError, match=r"token ids \[batch, length\] as integers, got \(2, 3\) float32"):
        TokenEmbedding(VOCAB, 4)(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="length 9 but max_len=7"):
        TokenEmbedding(VOCAB, 4, max_len=7)(torch.ones(2, 9, dtype=torch.long))


def test_an_lstm_state_of_another_shape_is_refused_naming_both():
    lstm = LSTMLayer(4, 5, bidirectional=True)
    x, mask = torch.zeros(3, 6, 4), torch.zeros(3, 6, dtype=torch.bool)
    h = torch.zeros(1, 3, 5)
    with pytest.raises(ValueError, match=r"shape \(1, 3, 5\), this LSTM's is \(2, 3, 5\)"):
        lstm(x, mask, (h, h))


def test_builders_refuse_empty_stacks_and_bad_heads():
    with pytest.raises(ValueError, match="lstm_layers=0"):
        build_al_lstm(VOCAB, CLASSES, lstm_layers=0)
    with pytest.raises(ValueError, match="d_model=6 must divide by nhead=4"):
        build_al_transformer(VOCAB, CLASSES, d_model=6, nhead=4)


def test_a_g_without_a_linear_or_embedding_is_refused():
    layers = lstm_layers()
    layers[0].g = nn.Tanh()
    x, y = tokens(4)
    with pytest.raises(ValueError, match="stage 0's g must start with an nn.Linear"):
        run(layers, [(x, y)], "simulated")


def test_al_layers_are_al_layers():
    assert all(isinstance(lay, ALLayer) for lay in lstm_layers())
