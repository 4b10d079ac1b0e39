"""Per-token log-probs (and entropy) of a padded ``[B, S]`` batch: plan -> CP slice -> model -> gather back, the
path verl's actor and reference take on Megatron (the gradient reaches only this rank's rows)."""

from __future__ import annotations

from typing import Any

import torch

from verl_cppack.context import ParallelContext
from verl_cppack.core.checks import require_tensor
from verl_cppack.core.layouts import Layout, LayoutName
from verl_cppack.integrations.megatron import packed_seq_params
from verl_cppack.packing.builders import plan_from_mask
from verl_cppack.packing.plan import PackPlan


def compute_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    ctx: ParallelContext,
    *,
    layout: LayoutName | Layout = "zigzag",
    with_entropy: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``input_ids`` / ``attention_mask`` ``[B, S]`` -> (``log_probs``, ``entropy`` or None), ``[B, S]`` float32.

    ``log_probs[b, s]`` is log p(next valid token | prefix up to ``s``) at ``temperature`` (verl's convention), 0 at
    padding and at each row's last valid token; ``entropy`` of the next-token distribution, 0 at padding. ``model``: a
    Megatron ``GPTModel`` (or the same THD call returning ``[1, T_local, vocab]``) on ``ctx``'s CP group; TP must be 1."""
    require_tensor("input_ids", input_ids)
    require_tensor("attention_mask", attention_mask)
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [B, S] of the same shape, got {tuple(input_ids.shape)} "
            f"and {tuple(attention_mask.shape)}"
        )
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    if ctx.tp_size != 1:
        raise ValueError(f"compute_logprobs supports tp_size=1 (no vocab-parallel log-softmax yet), got {ctx.tp_size}")
    plan = plan_from_mask(attention_mask, ctx, layout=layout)
    logits = packed_forward(model, plan, input_ids)  # [1, T_local, V]
    per_token = token_statistics(logits, plan, input_ids, with_entropy=with_entropy, temperature=temperature)
    full = plan.unpack(per_token)  # [B, S, 1 or 2]: one all-gather for both
    return full[..., 0], (full[..., 1] if with_entropy else None)


def packed_forward(model: Any, plan: PackPlan, input_ids: torch.Tensor) -> torch.Tensor:
    """Run ``model`` on this rank's packed rows of ``input_ids`` ``[B, S]`` -> its output ``[1, T_local, *]``."""
    return model(
        input_ids=plan.pack(input_ids),  # [1, T_local]
        position_ids=plan.local_position_ids.unsqueeze(0),  # [1, T_local]
        attention_mask=None,
        packed_seq_params=packed_seq_params(plan),
    )


def token_statistics(
    logits: torch.Tensor, plan: PackPlan, input_ids: torch.Tensor, *, with_entropy: bool, temperature: float
) -> torch.Tensor:
    """Local logits ``[1, T_local, V]`` -> ``[1, T_local, 1 or 2]`` float32: next-token log-prob (, entropy)."""
    if logits.dim() != 3 or logits.shape[:2] != (1, plan.local_length):
        raise ValueError(
            f"the model must return logits [1, T_local={plan.local_length}, vocab], got {tuple(logits.shape)}"
        )
    log_softmax = torch.log_softmax(logits.float() / temperature, dim=-1)  # [1, T_local, V]
    labels = plan.pack(input_ids, shift=1)  # [1, T_local], 0 where there is no next token
    log_probs = log_softmax.gather(-1, labels.long().unsqueeze(-1))  # [1, T_local, 1]
    log_probs = log_probs.masked_fill(~plan.target_mask(1).unsqueeze(-1), 0.0)
    if not with_entropy:
        return log_probs
    entropy = -(log_softmax.exp() * log_softmax).sum(dim=-1, keepdim=True)  # [1, T_local, 1]
    entropy = entropy.masked_fill(~plan.local_valid_mask.view(1, -1, 1), 0.0)
    return torch.cat([log_probs, entropy], dim=-1)
