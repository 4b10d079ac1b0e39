"""The policy/reference model on a CP worker: build it, run it on a padded batch through the packed CP path.

The model is the tiny Megatron GPT of ``verl_cppack.integrations.megatron_model.build_tiny_gpt`` by default
(any ``"module:function"`` factory with the same keyword arguments and Megatron's
``forward(input_ids, position_ids, attention_mask, packed_seq_params) -> logits [1, T_local, V]`` works).

Two forward paths give log-probs ``[B, S]`` in verl's next-token alignment (position ``t`` scores token
``t+1``; 0 at padding and at each row's last token):

- ``"verl"``: verl's own ``gptmodel_forward_model_engine`` (what verl's Megatron actor and reference call),
  with its pre/post-processing patched by ``verl_cppack.integrations.verl.install()``;
- ``"cppack"``: ``verl_cppack.logprobs.compute_logprobs`` (plan -> CP slice -> model -> gather back).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Literal

import torch

from verl_cppack.context import ParallelContext
from verl_cppack.packing.plan import plan_from_mask

DEFAULT_MODEL_FACTORY = "verl_cppack.integrations.megatron_model:build_tiny_gpt"
ForwardPath = Literal["verl", "cppack"]
FORWARD_PATHS = ("verl", "cppack")


def resolve_factory(spec: str) -> Callable[..., torch.nn.Module]:
    """``"package.module:function"`` -> the function."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"model factory must look like 'package.module:function', got {spec!r}")
    return getattr(importlib.import_module(module_name), attribute)


def prepare_forward_path(forward: str) -> None:
    """Check the path exists; for ``"verl"`` patch verl's forward pre/post-processing with verl_cppack."""
    if forward not in FORWARD_PATHS:
        raise ValueError(f"forward must be one of {FORWARD_PATHS}, got {forward!r}")
    if forward == "verl":
        try:
            import verl.models.mcore.model_forward  # noqa: F401
        except ImportError as error:
            raise ImportError("forward='verl' needs verl installed (pip install verl); or use forward='cppack'") from error
        from verl_cppack.integrations.verl import install

        install()


def describe_forward_path(forward: str) -> str:
    """What computes the log-probs, for metrics and summaries."""
    if forward == "verl":
        from verl_cppack.integrations.verl import is_installed

        patched = "patched by verl_cppack" if is_installed() else "NOT patched"
        return f"verl.models.mcore.model_forward.gptmodel_forward_model_engine ({patched})"
    return "verl_cppack.logprobs.compute_logprobs"


def sequence_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    ctx: ParallelContext,
    *,
    with_entropy: bool,
    forward: ForwardPath = "cppack",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_probs [B, S]`` float32 and entropy ``[B, S]`` (or None) through the chosen forward path."""
    if forward == "verl":
        return verl_engine_log_probs(model, input_ids, attention_mask, with_entropy=with_entropy)
    from verl_cppack.logprobs import compute_logprobs

    return compute_logprobs(model, input_ids, attention_mask, ctx, with_entropy=with_entropy)


def verl_engine_log_probs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs through verl's ``gptmodel_forward_model_engine`` on a jagged batch, back to ``[B, S]``.

    Rows must hold one contiguous run of real tokens (left-padded prompt + right-padded response), as
    rollout batches do. verl rolls the labels inside each sequence (``need_roll``), so the last real token
    of a row is scored against its first; that position is zeroed, as in ``compute_logprobs``.
    """
    from verl.models.mcore.model_forward import gptmodel_forward_model_engine

    mask = attention_mask.bool()
    jagged = JaggedRows(mask)
    nested_ids = jagged.nested(input_ids)

    def logits_processor(logits: torch.Tensor, label: torch.Tensor) -> dict[str, torch.Tensor]:
        log_softmax = torch.log_softmax(logits.float(), dim=-1)  # [1, T_local, V]
        out = {"log_probs": log_softmax.gather(-1, label.long().unsqueeze(-1)).squeeze(-1)}  # [1, T_local]
        if with_entropy:
            out["entropy"] = -(log_softmax.exp() * log_softmax).sum(-1)
        return out

    output = gptmodel_forward_model_engine(
        model, nested_ids, {}, logits_processor=logits_processor, logits_processor_args={"label": nested_ids}
    )
    has_next = torch.zeros_like(mask)
    has_next[:, :-1] = mask[:, :-1] & mask[:, 1:]  # [B, S] positions whose next token is real
    log_probs = jagged.padded(output["log_probs"]) * has_next
    entropy = jagged.padded(output["entropy"]) if with_entropy else None
    return log_probs, entropy


class JaggedRows:
    """A padded ``[B, S]`` batch as verl's engine functions take it (a jagged nested tensor) and back.

    Builds the index once (one host sync: the token count); ``nested`` and ``padded`` are one
    ``index_select`` / ``index_copy`` each.
    """

    def __init__(self, mask: torch.Tensor) -> None:
        self.shape = tuple(mask.shape)  # (B, S)
        self.token_rows = mask.reshape(-1).nonzero().squeeze(1)  # [N] flat positions of real tokens
        self.offsets = torch.nn.functional.pad(mask.sum(1).cumsum(0), (1, 0))  # [B+1]

    @property
    def num_tokens(self) -> int:
        return self.token_rows.shape[0]

    def nested(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` -> jagged ``[B, j]`` of the real tokens."""
        return torch.nested.nested_tensor_from_jagged(x.reshape(-1).index_select(0, self.token_rows), offsets=self.offsets)

    def padded(self, nested: torch.Tensor) -> torch.Tensor:
        """Jagged ``[B, j]`` (or its ``[N]`` values) -> float32 ``[B, S]``, zeros at padding."""
        values = (nested.values() if nested.is_nested else nested.reshape(-1)).float()  # [N]
        flat = values.new_zeros(self.shape[0] * self.shape[1]).index_copy(0, self.token_rows, values)
        return flat.view(self.shape)


def next_token_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, ctx: ParallelContext
) -> torch.Tensor:
    """Logits of the token after the last column, ``[B, V]``, identical on every CP rank.

    The batch must end in a real token on every row (left-padded prompts plus generated tokens do).
    """
    from verl_cppack.logprobs import packed_forward

    plan = plan_from_mask(attention_mask, ctx)
    return plan.unpack(packed_forward(model, plan, input_ids))[:, -1]  # [B, V]


def model_kwargs(config: Any) -> dict[str, Any]:
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        max_sequence_length=config.max_sequence_length,
        attention=config.attention,
        seed=config.seed,
    )
