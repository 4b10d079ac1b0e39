"""Megatron ``core_attention`` module: packed (THD) causal attention with context parallelism on any device.

THD: q ``[t, heads, dim]``, k/v ``[t, groups, dim]`` for this CP rank's rows, ``cu_seqlens_*_padded`` global, output
``[t, heads*dim]``; without ``packed_seq_params`` (BSHD, CP=1): q ``[s, b, heads, dim]``, output ``[s, b, heads*dim]``.
The CP group is ``pg_collection.cp``; with CUDA and TE every call goes to TE unless ``use_te=False``."""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from verl_cppack.attention import IMPLEMENTATIONS, context_parallel_attention
from verl_cppack.attention.blocks import expand_groups, masked_sdpa
from verl_cppack.context import ParallelContext


def build_te_core_attention(**megatron_kwargs: Any) -> torch.nn.Module | None:
    """Megatron's ``TEDotProductAttention`` with our module's arguments on CUDA with TE installed (nothing imports TE
    otherwise), else ``None``: one layer spec runs TE on a GPU node and the CPU reference elsewhere."""
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return None
    try:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
    except ImportError:  # TE present but broken / too old for this megatron-core: keep the reference path
        return None
    return TEDotProductAttention(**megatron_kwargs)


class ContextParallelCoreAttention(MegatronModule):
    """Drop-in for ``SelfAttentionSubmodules.core_attention`` (see the module docstring)."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        *,
        implementation: str = "allgather",
        use_te: bool = True,
    ) -> None:
        super().__init__(config=config)
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.implementation = implementation
        self.softmax_scale = softmax_scale
        self.cp_group = pg_collection.cp if pg_collection is not None else parallel_state.get_context_parallel_group()
        self.te_attention = None
        if use_te:
            self.te_attention = build_te_core_attention(
                config=config,
                layer_number=layer_number,
                attn_mask_type=attn_mask_type,
                attention_type=attention_type,
                attention_dropout=attention_dropout,
                softmax_scale=softmax_scale,
                cp_comm_type=cp_comm_type,
                pg_collection=pg_collection,
            )
        if self.te_attention is None:
            if dropout:
                raise ValueError(
                    f"the reference core attention has no dropout; set config.attention_dropout=0 (got {dropout})"
                )
            if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
                raise ValueError(f"the reference core attention is causal only, got attn_mask_type={attn_mask_type}")

    def parallel_context(self) -> ParallelContext:
        size = self.cp_group.size() if self.cp_group is not None else 1
        if size == 1:
            return ParallelContext()
        return ParallelContext(cp_size=size, cp_rank=self.cp_group.rank(), cp_group=self.cp_group)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if self.te_attention is not None and query.is_cuda:
            return self.te_attention(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
            )
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the reference core attention")
        ctx = self.parallel_context()
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return self._forward_bshd(query, key, value, attention_mask, ctx)
        cu_seqlens = packed_seq_params.cu_seqlens_q  # attention lengths (verl: the padded ones)
        cu_seqlens_padded = packed_seq_params.cu_seqlens_q_padded  # storage offsets
        if cu_seqlens_padded is None:
            cu_seqlens_padded = cu_seqlens
        out = context_parallel_attention(
            query,
            key,
            value,
            cu_seqlens_padded,
            ctx,
            implementation=self.implementation,
            cu_seqlens=cu_seqlens,
            layout=getattr(packed_seq_params, "cp_partition_mode", None) or "zigzag",
            softmax_scale=self.softmax_scale,
            max_seqlen=packed_seq_params.max_seqlen_q,
        )  # [t, heads, dim]
        return out.reshape(out.shape[0], -1)  # [t, heads*dim]

    def _forward_bshd(self, query, key, value, attention_mask, ctx: ParallelContext) -> torch.Tensor:
        """q ``[s, b, heads, dim]``, k/v ``[s, b, groups, dim]`` -> ``[s, b, heads*dim]``; causal, CP=1."""
        if ctx.cp_size > 1:
            raise ValueError(
                "the reference core attention supports CP > 1 only for packed THD input (packed_seq_params)"
            )
        seq_len, batch, num_heads, head_dim = query.shape
        key, value = expand_groups_bshd(key, num_heads), expand_groups_bshd(value, num_heads)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
        allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=query.device).tril()  # [s, s]
        if attention_mask is not None:  # Megatron convention: True = masked out, [b, 1, s, s]
            allowed = allowed & ~attention_mask.bool()
        out = masked_sdpa(q, k, v, allowed, self.softmax_scale)  # [b, h, s, d]; padding rows 0
        return out.permute(2, 0, 1, 3).reshape(seq_len, batch, num_heads * head_dim)


def expand_groups_bshd(kv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[s, b, groups, d]`` -> ``[s, b, heads, d]`` (GQA)."""
    seq_len, batch = kv.shape[:2]
    return expand_groups(kv.reshape(seq_len * batch, *kv.shape[2:]), num_heads).view(seq_len, batch, num_heads, -1)


def core_attention_class(
    implementation: str = "allgather", *, use_te: bool = True
) -> type[ContextParallelCoreAttention]:
    """A subclass fixing ``implementation`` / ``use_te``, for ``SelfAttentionSubmodules.core_attention``."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    return _core_attention_class(implementation, use_te)


@functools.cache
def _core_attention_class(implementation: str, use_te: bool) -> type[ContextParallelCoreAttention]:
    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - the class body's __init__
        ContextParallelCoreAttention.__init__(self, *args, implementation=implementation, use_te=use_te, **kwargs)

    name = f"{implementation.capitalize()}CoreAttention{'' if use_te else 'NoTE'}"
    return type(name, (ContextParallelCoreAttention,), {"__init__": __init__, "__module__": __name__})
