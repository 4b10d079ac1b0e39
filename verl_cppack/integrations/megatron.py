"""Megatron-core adapters: the parallel context from ``parallel_state``, ``PackedSeqParams`` from a plan.

The packing side knows nothing of Megatron: a plan's ``PackedSeqParams`` is ``packed_seq_params(plan)`` here, and
the context of an initialised ``megatron.core.parallel_state`` is ``parallel_context_from_megatron()``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from verl_cppack.context import ParallelContext

if TYPE_CHECKING:
    from verl_cppack.packing.plan import PackPlan


@dataclass
class FallbackPackedSeqParams:
    """Field-for-field stand-in for ``megatron.core.packed_seq_params.PackedSeqParams`` when it is absent."""

    qkv_format: str | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_kv: torch.Tensor | None = None
    cu_seqlens_q_padded: torch.Tensor | None = None
    cu_seqlens_kv_padded: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None
    local_cp_size: int | None = None
    cp_group: Any = None


def packed_seq_params_class() -> type:
    """megatron-core's ``PackedSeqParams`` as the module holds it now (a stand-in put there is used too)."""
    try:
        from megatron.core.packed_seq_params import PackedSeqParams
    except ImportError:
        return FallbackPackedSeqParams
    return PackedSeqParams


@functools.lru_cache(maxsize=4)
def packed_seq_params_fields(cls: type) -> frozenset[str]:
    """The fields ``cls`` names (a class taking ``**kwargs`` accepts others too, see ``packed_seq_params_accepts``)."""
    if dataclasses.is_dataclass(cls):
        return frozenset(field.name for field in dataclasses.fields(cls))
    parameters = inspect.signature(cls.__init__).parameters.values()
    return frozenset(p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)) - {"self"}


@functools.lru_cache(maxsize=4)
def _takes_any_keyword(cls: type) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values())


def packed_seq_params_accepts(cls: type, name: str) -> bool:
    """Whether ``cls(name=...)`` is accepted, decided as verl 0.9.1 does: a named field, or ``**kwargs`` in
    ``__init__`` (duck-typed stand-ins)."""
    return name in packed_seq_params_fields(cls) or _takes_any_keyword(cls)


def packed_seq_params_arguments(
    plan: "PackPlan", *, real_seqlens_in_attention: bool = False
) -> tuple[type, dict[str, Any]]:
    """The class and keyword arguments of a THD ``PackedSeqParams`` with global (not CP-divided) offsets.

    By default ``cu_seqlens_q/kv`` are the padded offsets, as verl passes them (padding tokens attend
    inside their own slot and are discarded later). ``real_seqlens_in_attention=True`` passes the real
    ``cu_seqlens`` instead so attention kernels that support it skip the padding. Every field is passed that
    the class accepts (named, or through ``**kwargs`` as verl allows); ``cp_partition_mode`` whenever accepted,
    and a non-zigzag layout with CP>1 needs it, as in verl.
    """
    cls = packed_seq_params_class()
    cu_attention = plan.cu_seqlens if real_seqlens_in_attention else plan.cu_seqlens_padded
    max_attention = plan.max_seqlen if real_seqlens_in_attention else plan.max_seqlen_padded
    values: dict[str, Any] = dict(
        qkv_format="thd",
        cu_seqlens_q=cu_attention,
        cu_seqlens_kv=cu_attention,
        cu_seqlens_q_padded=plan.cu_seqlens_padded,
        cu_seqlens_kv_padded=plan.cu_seqlens_padded,
        max_seqlen_q=max_attention,
        max_seqlen_kv=max_attention,
    )
    if packed_seq_params_accepts(cls, "cp_partition_mode"):
        values["cp_partition_mode"] = plan.layout.name
    elif plan.layout.name != "zigzag" and plan.ctx.cp_size > 1 and cls is not FallbackPackedSeqParams:
        raise ValueError(
            f"the {plan.layout.name} layout needs PackedSeqParams.cp_partition_mode so attention knows the cut; "
            "this megatron-core has no such field (it assumes zigzag). Use layout='zigzag' or a newer megatron-core."
        )
    return cls, {name: value for name, value in values.items() if packed_seq_params_accepts(cls, name)}


# plan -> {(real_seqlens_in_attention, class): (class, kwargs)}: the keyword arguments are worked out once per plan
# (the drop-ins ask for every micro-batch's params); a plan that is dropped takes its entry with it.
_ARGUMENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def packed_seq_params(plan: "PackPlan", *, real_seqlens_in_attention: bool = False) -> Any:
    """A new Megatron ``PackedSeqParams`` (THD) for ``plan`` per call (see ``packed_seq_params_arguments``)."""
    key = (real_seqlens_in_attention, packed_seq_params_class())  # the class as megatron holds it now
    per_plan = _ARGUMENTS.setdefault(plan, {})
    arguments = per_plan.get(key)
    if arguments is None:
        arguments = packed_seq_params_arguments(plan, real_seqlens_in_attention=real_seqlens_in_attention)
        per_plan[key] = arguments
    cls, kwargs = arguments
    return cls(**kwargs)


# (CP group, TP group, TP-size override) -> context: a process group's size and this rank's place in it never
# change, so the context is built once per group; new groups (a re-initialised parallel state) are new keys.
_CONTEXTS: dict[tuple[Any, Any, Any], ParallelContext] = {}


@functools.lru_cache(maxsize=1)
def _parallel_state() -> Any:
    try:
        from megatron.core import parallel_state
    except ImportError as error:
        raise ImportError("parallel_context_from_megatron() needs megatron-core (pip install megatron-core)") from error
    return parallel_state


def parallel_context_from_megatron() -> ParallelContext:
    """The context of ``megatron.core.parallel_state``; called by every drop-in, so the common case (groups
    seen before) reads three module values and one dict."""
    mpu = _parallel_state()
    # Group identities and megatron's TP-size override: reading them asks no process group anything.
    key = (
        mpu.get_context_parallel_group(check_initialized=False),
        mpu.get_tensor_model_parallel_group(check_initialized=False),
        getattr(mpu, "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", None),
    )
    context = _CONTEXTS.get(key)
    if context is None:
        if not mpu.model_parallel_is_initialized() or key[0] is None:
            raise ValueError(
                "megatron.core.parallel_state is not initialised; call parallel_state.initialize_model_parallel(...) "
                "first or build ParallelContext(tp_size=..., cp_size=..., cp_rank=..., cp_group=...) yourself"
            )
        cp_size = mpu.get_context_parallel_world_size()
        context = ParallelContext(
            tp_size=mpu.get_tensor_model_parallel_world_size(),
            cp_size=cp_size,
            cp_rank=mpu.get_context_parallel_rank(),
            cp_group=key[0] if cp_size > 1 else None,
        )
        if len(_CONTEXTS) >= 16:  # groups of torn-down parallel states: let them go
            _CONTEXTS.clear()
        _CONTEXTS[key] = context
    return context
