"""The critic: per-token values of a padded ``[B, S]`` batch through the packed CP path, and the clipped value loss.

The value model is the tiny Megatron GPT with a scalar head
(``build_tiny_gpt(..., value_head=True)``: ``[1, T_local, 1]`` per forward). Two forward paths, as for the
policy (``verl_cppack.rl.policy``):

- ``"verl"``: verl's own ``gptmodel_forward_model_engine(..., value_model=True)`` — what verl's Megatron
  critic (``MegatronEngineWithValueHead``) calls — with its THD pre/post-processing patched by
  ``verl_cppack.integrations.verl.install()``;
- ``"cppack"``: plan -> this rank's packed rows -> model -> ``plan.unpack``.

Either way every CP rank gets the full ``values [B, S]`` (gather-back contract, DESIGN §2): the gradient of
a loss on them reaches only this rank's chunk, so the sum of the ranks' parameter gradients over the CP group
is the full-sequence gradient. ``values[b, s]`` is the value of the state that ends at token ``s`` (the state
from which token ``s+1`` is generated), i.e. the same next-token alignment as the policy's log-probs; it is
0 at padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_cppack.context import ParallelContext
from verl_cppack.core.checks import require_tensor
from verl_cppack.packing.plan import plan_from_mask
from verl_cppack.rl.policy import FORWARD_PATHS, ForwardPath, JaggedRows


def critic_values(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    ctx: ParallelContext,
    *,
    forward: ForwardPath = "cppack",
) -> torch.Tensor:
    """``values [B, S]`` float32 of a value model on every CP rank; differentiable w.r.t. the model.

    input_ids / attention_mask ``[B, S]``; for ``forward="verl"`` each row's real tokens must be one
    contiguous run (left-padded prompt + right-padded response), as rollout batches are.
    """
    require_tensor("input_ids", input_ids)
    require_tensor("attention_mask", attention_mask)
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [B, S] of the same shape, got {tuple(input_ids.shape)} "
            f"and {tuple(attention_mask.shape)}"
        )
    if forward not in FORWARD_PATHS:
        raise ValueError(f"forward must be one of {FORWARD_PATHS}, got {forward!r}")
    if forward == "verl":
        return verl_engine_values(model, input_ids, attention_mask)
    from verl_cppack.logprobs import packed_forward

    plan = plan_from_mask(attention_mask, ctx)
    local_values = packed_forward(model, plan, input_ids)  # [1, T_local, 1]
    _check_value_output(local_values, plan.local_length)
    return plan.unpack(local_values.float())[..., 0]  # [B, S]


def verl_engine_values(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Values via verl's ``gptmodel_forward_model_engine(value_model=True)`` on a jagged batch, back to ``[B, S]``."""
    from verl.models.mcore.model_forward import gptmodel_forward_model_engine

    jagged = JaggedRows(attention_mask.bool())
    nested_values = gptmodel_forward_model_engine(model, jagged.nested(input_ids), {}, value_model=True)  # jagged [B, j]
    values = nested_values.values() if nested_values.is_nested else nested_values.reshape(-1)  # [N]
    if values.dim() != 1 or values.shape[0] != jagged.num_tokens:
        raise ValueError(
            "the value model must return one scalar per token ([1, T_local, 1]); verl's forward gave values of "
            f"shape {tuple(values.shape)} for {jagged.num_tokens} tokens (was the model built with value_head=True?)"
        )
    return jagged.padded(values)


def _check_value_output(local_values: torch.Tensor, local_length: int) -> None:
    if local_values.dim() != 3 or local_values.shape != (1, local_length, 1):
        raise ValueError(
            f"the value model must return [1, T_local={local_length}, 1], got {tuple(local_values.shape)} "
            "(build it with value_head=True)"
        )


@dataclass(frozen=True)
class ValueLossOutput:
    loss: torch.Tensor  # scalar, differentiable: 0.5 * token-mean of the clipped squared error
    clip_fraction: torch.Tensor  # scalar, fraction of tokens where the clipped branch is the larger one
    value_mean: torch.Tensor  # scalar, token-mean of the new values (detached)


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_range: float = 0.5,
) -> ValueLossOutput:
    """PPO's clipped value loss (verl's ``compute_value_loss``, token-mean).

    ``0.5 * mean(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2))`` over the tokens of ``response_mask``.
    All tensors are ``[B, S]``; ``values`` carries the gradient, ``old_values`` (the critic's values at rollout
    time) and ``returns`` are constants.
    """
    for name, tensor in (("old_values", old_values), ("returns", returns), ("response_mask", response_mask)):
        require_tensor(name, tensor)
        if tensor.shape != values.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, values has {tuple(values.shape)}")
    if not clip_range > 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    count = masked_token_count(response_mask)
    old_values, returns = old_values.detach(), returns.detach()
    clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)  # [B, S]
    unclipped_error = (values - returns).square()
    clipped_error = (clipped_values - returns).square()
    per_token = torch.stack(  # [3, B, S]: one masked sum for the loss and both statistics
        [torch.maximum(unclipped_error, clipped_error), (clipped_error > unclipped_error).to(values.dtype), values]
    )
    loss_sum, clipped_sum, value_sum = (per_token * response_mask.to(values.dtype)).flatten(1).sum(1)
    return ValueLossOutput(
        loss=0.5 * loss_sum / count,
        clip_fraction=(clipped_sum / count).detach(),
        value_mean=(value_sum / count).detach(),
    )


def masked_token_count(response_mask: torch.Tensor) -> torch.Tensor:
    """Number of masked tokens as a float scalar; zero tokens is a ValueError (one host sync), never a NaN mean."""
    count = response_mask.float().sum()
    if float(count) == 0.0:
        raise ValueError("the response mask selects zero tokens; there is nothing to average over")
    return count


def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> float:
    """``1 - Var(returns - values) / (Var(returns) + 1e-5)`` over the masked tokens (verl's ``vf_explained_var``)."""
    mask = response_mask.bool()
    if values.shape != returns.shape or values.shape != mask.shape:
        raise ValueError(
            f"values, returns and response_mask must share one shape, got {tuple(values.shape)}, "
            f"{tuple(returns.shape)}, {tuple(mask.shape)}"
        )
    if int(mask.sum()) < 2:
        raise ValueError("explained_variance needs at least 2 masked tokens")
    selected_returns, selected_values = returns[mask].double(), values[mask].double()
    return float(1.0 - (selected_returns - selected_values).var() / (selected_returns.var() + 1e-5))


__all__ = ["ValueLossOutput", "clipped_value_loss", "critic_values", "explained_variance", "verl_engine_values"]
