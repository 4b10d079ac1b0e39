"""The tiny random Llama the rollout tests decode with (nothing can be downloaded here)."""

from __future__ import annotations

import torch


def tiny_llama(seed: int):
    """A 2-layer ``LlamaForCausalLM`` over 32 tokens and 64 positions, seeded, in eval mode; its output layer is
    sharper than the 0.02-std init, so samples and greedy choices are not near-uniform."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)
    return model.eval()
