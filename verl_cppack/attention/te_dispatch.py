"""Transformer Engine dispatch: on CUDA with TE installed, the real fused CP attention replaces ours.

``build_te_core_attention`` returns Megatron's ``TEDotProductAttention`` built with the arguments Megatron gave our
module (nothing imports TE unless it is present and CUDA is available), so one layer spec runs TE on a GPU node and
the CPU reference elsewhere."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch


def transformer_engine_usable() -> bool:
    """True when CUDA is available and ``transformer_engine`` is importable (no import is attempted otherwise)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def build_te_core_attention(**megatron_kwargs: Any) -> torch.nn.Module | None:
    """Megatron's ``TEDotProductAttention(**megatron_kwargs)``, or ``None`` when TE cannot be used here."""
    if not transformer_engine_usable():
        return None
    try:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
    except ImportError:  # TE present but broken / too old for this megatron-core: keep the reference path
        return None
    return TEDotProductAttention(**megatron_kwargs)
