"""Associated Learning models: the layers (f, b, g, h), their builders, and one-process inference.

Pure model code (no processes, no I/O); :mod:`pipeq.research.al.executor` runs these layers in a
pipeline.

An AL layer's x side may pass a *tree* on, not just a tensor: ``s_i`` is whatever ``f_i`` returns
and ``f_{i+1}`` is called pipeq's way (a tuple is spread over its arguments, anything else is its
one argument); ``b_i`` is called on ``s_i`` the same way. So a sequence model's padding mask and an
LSTM's ``(h, c)`` ride along with the activations::

    tokens [N, L] -> TokenEmbedding -> (x, mask) -> LSTMLayer -> (out, mask, (h, c)) -> LSTMLayer -> ...
                          |  b: PooledBridge            |  b: LastHiddenBridge
    onehot(y) -> g_1 ----------------> t_1 -> g_2 -------------> t_2 -> ...

The label side ``t_i`` is a tensor (a tuple's first tensor is what the losses compare). Layer 1's
``g`` reads the class one-hot (:class:`LabelEmbedding`: an embedding of the class, i.e. a
bias-free Linear over the one-hot) or, when it starts with an ``nn.Embedding``, the class index.

Builders: :func:`build_al` (blocks + widths; flattens f's output, for MLP and CNN blocks),
:func:`build_al_lstm` and :func:`build_al_transformer` (text classifiers as in the AL papers).
:class:`ALModel` runs the inference path in one process, under the same names as a run's
``state_dict()`` and ``pipeq launch``'s model.pt.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from pipeq.tree import as_args

__all__ = ["ALLayer", "ALModel", "LabelEmbedding", "LastHiddenBridge", "LSTMLayer", "PooledBridge", "TokenEmbedding",
           "TransformerLayer", "build_al", "build_al_lstm", "build_al_transformer", "call", "code", "label_dtype",
           "label_input", "lengths_of", "masked_mean"]


def call(module: nn.Module, value: Any) -> Any:
    """``module`` called pipeq's way: a tuple is spread over its arguments (as a stage is)."""
    return module(*as_args(value))


def code(t: Any) -> torch.Tensor:
    """The tensor the losses compare: ``t`` itself, or a tuple's first tensor."""
    return t if isinstance(t, torch.Tensor) else t[0]


class ALLayer(nn.Module):
    """One AL layer: ``f`` (x side), ``b`` (bridge to the label side), ``g`` (label encoder), ``h``
    (label decoder). As a plain module it runs ``f`` (the inference path's x side)."""

    def __init__(self, f: nn.Module, b: nn.Module, g: nn.Module, h: nn.Module) -> None:
        super().__init__()
        self.f, self.b, self.g, self.h = f, b, g, h

    def forward(self, *s: Any) -> Any:
        return self.f(*s)

    def pipeq_compile(self, compile: Any) -> None:
        """Compiled stages (``compile=True``): each of f, b, g, h, which AL's executor calls apart."""
        for part in (self.f, self.b, self.g, self.h):
            part.forward = compile(part.forward)


def label_input(g: nn.Module) -> tuple[str, int]:
    """What layer 1's ``g`` reads: ``("onehot", classes)`` when its first Linear / Embedding is a
    Linear, ``("index", classes)`` when it is an Embedding."""
    for m in g.modules():
        if isinstance(m, nn.Linear):
            return "onehot", m.in_features
        if isinstance(m, nn.Embedding):
            return "index", m.num_embeddings
    raise ValueError("stage 0's g must start with an nn.Linear over the one-hot classes or an nn.Embedding "
                     "of the class index (pipeq.research.LabelEmbedding)")


def label_dtype(g: nn.Module) -> torch.dtype:
    """The floating dtype the label path computes in (its first floating parameter's)."""
    return next((p.dtype for p in g.parameters() if p.is_floating_point()), torch.get_default_dtype())


def _label_side(n_classes: int, widths: Sequence[int], first: nn.Module | None = None) -> list[tuple[nn.Module, nn.Module]]:
    """(g_i, h_i) for label widths ``widths``: Linear + Tanh encoders and their inverse decoders,
    ``h_1`` ending in plain class scores; ``first``: layer 1's g (default Linear + Tanh)."""
    out, prev = [], n_classes
    for i, lw in enumerate(widths):
        g = first if i == 0 and first is not None else nn.Sequential(nn.Linear(prev, lw), nn.Tanh())
        h = nn.Linear(lw, prev) if i == 0 else nn.Sequential(nn.Linear(lw, prev), nn.Tanh())
        out.append((g, h))
        prev = lw
    return out


def build_al(
    blocks: Sequence[nn.Module], widths: Sequence[int], n_classes: int, label_widths: Sequence[int] | None = None,
) -> list[ALLayer]:
    """AL layers from plain blocks: ``blocks[i]`` maps to ``widths[i]`` features (flattened).

    Layer i's label side is ``g_i: label_widths[i-1] -> label_widths[i]`` (``label_widths[-1]`` =
    ``n_classes`` for t_0) with ``b_i: widths[i] -> label_widths[i]`` and ``h_i`` its inverse
    (Linear + Tanh bridges and encoders; ``h_1`` ends in plain class scores). Default label widths:
    ``widths``. For sequence models see :func:`build_al_lstm` and :func:`build_al_transformer`.
    """
    if len(blocks) != len(widths):
        raise ValueError(f"{len(blocks)} blocks but {len(widths)} widths: give one width per block")
    label_widths = list(label_widths or widths)
    if len(label_widths) != len(blocks):
        raise ValueError(f"label_widths has {len(label_widths)} entries for {len(blocks)} blocks")
    return [ALLayer(nn.Sequential(blk, nn.Flatten()), nn.Sequential(nn.Linear(w, lw), nn.Tanh()), g, h)
            for blk, w, lw, (g, h) in zip(blocks, widths, label_widths, _label_side(n_classes, label_widths))]


# ---------------------------------------------------------------------------- sequence blocks


class LabelEmbedding(nn.Module):
    """Layer 1's ``g`` for text models: an embedding of the class (a bias-free Linear over the
    one-hot, so it also reads soft labels), squashed by tanh like the other codes."""

    def __init__(self, n_classes: int, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(n_classes, width, bias=False)

    def forward(self, onehot: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(onehot))


class TokenEmbedding(nn.Module):
    """Token ids ``[N, L]`` (int64, ``padding_idx`` for padding) -> ``(x [N, L, dim], mask [N, L])``,
    ``mask`` True at padding; ``max_len``: add learned positions (Transformers need them)."""

    def __init__(self, vocab_size: int, dim: int, padding_idx: int = 0, max_len: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=padding_idx)
        self.position = nn.Embedding(max_len, dim) if max_len else None
        self.padding_idx = padding_idx
        self.max_len = max_len

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if tokens.dim() != 2 or tokens.is_floating_point() or tokens.is_complex():
            raise ValueError(f"TokenEmbedding takes token ids [batch, length] as integers, got "
                             f"{tuple(tokens.shape)} {str(tokens.dtype).replace('torch.', '')}")
        x = self.embed(tokens)
        if self.position is not None:
            length = tokens.shape[1]
            if length > self.max_len:  # type: ignore[operator]
                raise ValueError(f"TokenEmbedding: sequences of length {length} but max_len={self.max_len}; "
                                 "build the model with a larger max_len")
            x = x + self.position(torch.arange(length, device=tokens.device))
        return x, tokens == self.padding_idx


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean of ``x [N, L, D]`` over the positions that are not padding (all of them without a
    mask; a row of padding only gives zeros)."""
    if mask is None:
        return x.mean(dim=1)
    keep = (~mask).unsqueeze(-1).to(x.dtype)
    return (x * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)


class PooledBridge(nn.Module):
    """``b`` over a sequence: the mean of the non-padding positions -> Linear -> Tanh. Called as
    ``b(x, mask, ...)`` (what :class:`TokenEmbedding` and :class:`TransformerLayer` pass on)."""

    def __init__(self, dim: int, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *rest: Any) -> torch.Tensor:
        return torch.tanh(self.proj(masked_mean(x, mask)))


def lengths_of(mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's length (its positions before the padding; at least 1), on the CPU."""
    return (~mask).sum(dim=1).clamp(min=1).cpu()


class LSTMLayer(nn.Module):
    """An LSTM as an AL ``f``: ``(x, mask[, (h, c)]) -> (out, mask, (h_n, c_n))``.

    The previous layer's ``(h, c)`` (when it rides along) is this LSTM's initial state, as in
    the AL papers' LSTM stacks; sequences are packed by their lengths (padding at the end), so
    ``h_n`` is each direction's state at the true end of its sequence. ``out`` keeps ``[N, L,
    D*hidden]`` (zeros at padding)."""

    def __init__(self, input_size: int, hidden: int, bidirectional: bool = True, num_layers: int = 1) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden, num_layers=num_layers, batch_first=True,
                            bidirectional=bidirectional)

    def forward(self, x: torch.Tensor, mask: torch.Tensor,
                state: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[Any, ...]:
        if state is not None:
            want = (self.lstm.num_layers * (2 if self.lstm.bidirectional else 1), x.shape[0], self.lstm.hidden_size)
            if tuple(state[0].shape) != want:
                raise ValueError(f"LSTMLayer: the incoming state h has shape {tuple(state[0].shape)}, this LSTM's "
                                 f"is {want}; stack LSTM layers of one hidden size and direction count")
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths_of(mask), batch_first=True, enforce_sorted=False)
        out, (h, c) = self.lstm(packed, state)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return out, mask, (h, c)


class LastHiddenBridge(nn.Module):
    """``b`` of an LSTM layer: the last layer's final hidden state, both directions concatenated
    for a bidirectional LSTM -> Linear -> Tanh. Called as ``b(out, mask, (h, c))``."""

    def __init__(self, hidden: int, width: int, bidirectional: bool = True) -> None:
        super().__init__()
        self.directions = 2 if bidirectional else 1
        self.proj = nn.Linear(hidden * self.directions, width)

    def forward(self, out: torch.Tensor, mask: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = state[0]
        last = torch.cat([h[-2], h[-1]], dim=-1) if self.directions == 2 else h[-1]
        return torch.tanh(self.proj(last))


class TransformerLayer(nn.Module):
    """A Transformer encoder layer as an AL ``f``: ``(x, mask) -> (x', mask)``, padding masked."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 256, dropout: float = 0.0) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, batch_first=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer(x, src_key_padding_mask=mask), mask


def build_al_lstm(vocab_size: int, n_classes: int, embed_dim: int = 64, hidden: int = 64, lstm_layers: int = 2,
                  bidirectional: bool = True, label_width: int = 64, padding_idx: int = 0) -> list[ALLayer]:
    """An LSTM text classifier as AL layers (the AL papers' LSTM model): layer 1 embeds the tokens
    (``b``: pooled embeddings), then ``lstm_layers`` LSTM layers, each starting from the previous
    one's ``(h, c)`` (``b``: the last hidden state, both directions). Label side of width
    ``label_width``: a class embedding, then Linear + Tanh codes."""
    if lstm_layers < 1:
        raise ValueError(f"build_al_lstm(lstm_layers={lstm_layers}): give at least one LSTM layer")
    d = 2 if bidirectional else 1
    fs: list[tuple[nn.Module, nn.Module]] = [(TokenEmbedding(vocab_size, embed_dim, padding_idx),
                                              PooledBridge(embed_dim, label_width))]
    for i in range(lstm_layers):
        fs.append((LSTMLayer(embed_dim if i == 0 else hidden * d, hidden, bidirectional),
                   LastHiddenBridge(hidden, label_width, bidirectional)))
    labels = _label_side(n_classes, [label_width] * len(fs), LabelEmbedding(n_classes, label_width))
    return [ALLayer(f, b, g, h) for (f, b), (g, h) in zip(fs, labels)]


def build_al_transformer(vocab_size: int, n_classes: int, d_model: int = 64, nhead: int = 4, layers: int = 2,
                         dim_feedforward: int = 128, label_width: int = 64, max_len: int = 64,
                         padding_idx: int = 0, dropout: float = 0.0) -> list[ALLayer]:
    """A Transformer text classifier as AL layers: layer 1 embeds tokens and positions, then
    ``layers`` encoder layers; every ``b`` pools the non-padding positions. Label side as
    :func:`build_al_lstm`'s."""
    if layers < 1:
        raise ValueError(f"build_al_transformer(layers={layers}): give at least one encoder layer")
    if d_model % nhead:
        raise ValueError(f"build_al_transformer: d_model={d_model} must divide by nhead={nhead}")
    fs: list[tuple[nn.Module, nn.Module]] = [(TokenEmbedding(vocab_size, d_model, padding_idx, max_len),
                                              PooledBridge(d_model, label_width))]
    fs += [(TransformerLayer(d_model, nhead, dim_feedforward, dropout), PooledBridge(d_model, label_width))
           for _ in range(layers)]
    labels = _label_side(n_classes, [label_width] * len(fs), LabelEmbedding(n_classes, label_width))
    return [ALLayer(f, b, g, h) for (f, b), (g, h) in zip(fs, labels)]


# ---------------------------------------------------------------------------- inference


class ALModel(nn.Sequential):
    """AL layers as one module whose ``forward(x)`` is the inference path, in one process:
    ``f_1 .. f_l``, then ``b_l``, then ``h_l .. h_1`` (tanh-bounded scores with the ``"ce"``
    first loss, as ``runner.predict`` returns them). ``l``: ``inference_layer`` (default the last).

    Its ``state_dict()`` names are a run's (``runner.state_dict()``, ``pipeq launch``'s model.pt),
    so ``ALModel(build_al_lstm(...)).load_state_dict(torch.load("model.pt"))`` serves a trained run.
    """

    def __init__(self, layers: Sequence[ALLayer], inference_layer: int | None = None, first_loss: str = "ce") -> None:
        super().__init__(*layers)
        for k, layer in enumerate(layers):
            if not isinstance(layer, ALLayer):
                raise ValueError(f"ALModel: layer {k} is a {type(layer).__name__}, "
                                 "not a pipeq.research.ALLayer")
        top = len(layers) - 1 if inference_layer is None else inference_layer
        if not 0 <= top < len(layers):
            raise ValueError(f"ALModel(inference_layer={inference_layer}) but there are {len(layers)} layers")
        if first_loss not in ("ce", "mse"):
            raise ValueError(f"ALModel(first_loss=...) must be 'ce' or 'mse', got {first_loss!r}")
        self.inference_layer, self.first_loss = top, first_loss

    def forward(self, x: Any) -> torch.Tensor:  # type: ignore[override]
        s = x
        for layer in list(self)[: self.inference_layer + 1]:
            s = call(layer.f, s)
        t = call(self[self.inference_layer].b, s)
        for k in range(self.inference_layer, -1, -1):
            t = self[k].h(t)
        return torch.tanh(t) if self.first_loss == "ce" else t
