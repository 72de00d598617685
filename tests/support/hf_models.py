"""Hugging Face models for the tests (tiny configs, random weights; nothing is downloaded): Llama, its loss and batches."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

#: Llama split by module names into two stages (the embedding tied to the head, across them).
LLAMA_BY_NAMES = [["model.embed_tokens", "model.layers.0", "model.layers.1"],
                  ["model.layers.2", "model.layers.3", "model.norm", "lm_head"]]


def tiny_llama(seed: int = 0, layers: int = 4):
    """A ``LlamaForCausalLM`` (vocab 64, hidden 32, 2 heads, tied embeddings, no KV cache)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                      tie_word_embeddings=True, use_cache=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def hf_loss(out, target: torch.Tensor) -> torch.Tensor:
    """A causal LM's loss on its ``ModelOutput`` (what the last stage returns)."""
    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), target.reshape(-1))


def llama_batches(lengths=(16, 12, 20), batch: int = 4, seed: int = 5) -> list[tuple[dict, torch.Tensor]]:
    """``({"input_ids", "attention_mask"}, target)`` of each length; the mask hides a sample's first tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for T in lengths:
        ids = torch.randint(0, 64, (batch, T), generator=g)
        mask = torch.ones(batch, T, dtype=torch.long)
        mask[1, :3] = 0
        out.append(({"input_ids": ids, "attention_mask": mask}, torch.randint(0, 64, (batch, T), generator=g)))
    return out


def reference_run(model, batches: list, lr: float = 0.1) -> list[float]:
    """Plain one-process training of ``model`` (in place; SGD, momentum 0.9; :func:`models.reference_train`):
    each step's loss."""
    from models import reference_train

    sgd = functools.partial(torch.optim.SGD, lr=lr, momentum=0.9)
    return reference_train([], None, sgd, batches, model=model, loss_of=lambda m, b: hf_loss(m(**b[0]), b[1]))[1]
