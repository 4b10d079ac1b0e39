"""Megatron-core adapters: the ``ParallelContext`` of ``megatron.core.parallel_state``, a plan's ``PackedSeqParams``."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from verl_cppack.context import ParallelContext
from verl_cppack.core.checks import require_int
from verl_cppack.core.host import to_device

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
    imported = getattr(sys.modules.get("megatron.core.packed_seq_params"), "PackedSeqParams", None)
    if imported is not None:  # every preprocess asks: found without the import machinery
        return imported
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


@functools.lru_cache(maxsize=64)
def packed_seq_params_accepts(cls: type, name: str) -> bool:
    """Whether ``cls(name=...)`` works, as verl 0.9.1 decides: a named field, or ``**kwargs`` in ``__init__``."""
    if name in packed_seq_params_fields(cls):
        return True
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values())


def packed_seq_params(
    plan: PackPlan, *, real_seqlens_in_attention: bool = False, include_total_tokens: bool = False
) -> Any:
    """A new Megatron ``PackedSeqParams`` (THD) for ``plan`` per call, with global (not CP-divided) offsets; its
    arguments are worked out once per plan and class (``plan.derived``). ``cu_seqlens_q/kv``: the padded offsets, as
    verl passes them, or the real ones with ``real_seqlens_in_attention``. A non-zigzag layout with CP>1 needs
    ``cp_partition_mode``. Fields added after megatron-core 0.16 (``total_tokens`` / ``seq_idx`` only with
    ``include_total_tokens``; ``tokens_per_sample``, ``pad_between_seqs``) are set on the made object, never passed:
    the class's ``__post_init__`` would derive ``seq_idx`` by a ``repeat_interleave`` that syncs."""
    cls = packed_seq_params_class()  # the class as megatron holds it now
    key = (real_seqlens_in_attention, include_total_tokens, cls)
    made_of = plan.derived.get(key)
    if made_of is None:
        made_of = plan.derived[key] = _made_of(plan, cls, real_seqlens_in_attention, include_total_tokens)
    kwargs, later = made_of
    params = cls(**kwargs)
    for name, value in later.items():
        setattr(params, name, value)
    return params


def _made_of(
    plan: PackPlan, cls: type, real_seqlens_in_attention: bool, include_total_tokens: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``packed_seq_params``' keyword arguments of ``cls``, and the later fields it sets on the made object."""
    tables = plan.tables
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
    fields, later = packed_seq_params_fields(cls), {}
    if "pad_between_seqs" in fields:  # what TE would compute per layer with a torch.equal
        later["pad_between_seqs"] = bool(
            real_seqlens_in_attention and (tables.cu_seqlens[:-1] != tables.cu_seqlens_padded[:-1]).any()
        )
    if "tokens_per_sample" in fields:
        later["tokens_per_sample"] = plan.local_length  # this rank's row length T / CP
    if include_total_tokens:
        missing = [name for name in ("total_tokens", "seq_idx") if not packed_seq_params_accepts(cls, name)]
        if missing:
            raise ValueError(
                f"include_total_tokens=True needs PackedSeqParams fields {', '.join(missing)}, which "
                f"{cls.__module__}.{cls.__qualname__} lacks (megatron-core 0.17 added them); pass "
                "include_total_tokens=False or upgrade megatron-core"
            )
        later["total_tokens"] = plan.total_length  # T
        slots = np.repeat(np.arange(plan.batch_size), tables.seqlens_padded)  # [T] the sequence of each position
        later["seq_idx"] = to_device(slots, plan.device, torch.int32)[None]  # [1, T]
    return {name: value for name, value in values.items() if packed_seq_params_accepts(cls, name)}, later


# (TP size, CP size, CP rank or None for dynamic CP, id of the CP group) -> (the group, its context)
_CONTEXTS: dict[tuple[int, int, int | None, int], tuple[Any, ParallelContext]] = {}

PARALLEL_STATE = "megatron.core.parallel_state"


def parallel_state_module() -> Any:
    """``megatron.core.parallel_state`` as this process holds it now (a stand-in put in ``sys.modules`` too)."""
    module = sys.modules.get(PARALLEL_STATE)
    if module is not None:
        return module
    try:
        from megatron.core import parallel_state
    except ImportError as error:
        raise ImportError("parallel_context_from_megatron() needs megatron-core (pip install megatron-core)") from error
    return parallel_state


_NOT_INITIALISED = (
    "megatron.core.parallel_state is not initialised{detail}; call parallel_state.initialize_model_parallel(...) "
    "first or build ParallelContext(tp_size=..., cp_size=..., cp_rank=..., cp_group=...) yourself"
)


def parallel_context_from_megatron() -> ParallelContext:
    """TP size, CP size, CP rank and (CP > 1) the CP group, asked on every call of ``megatron.core.parallel_state``
    through the four getters verl calls (so stubbed getters are read too); one context per distinct answer."""
    mpu = parallel_state_module()
    try:
        tp_size = mpu.get_tensor_model_parallel_world_size()
        cp_size = mpu.get_context_parallel_world_size()
        cp_rank = mpu.get_context_parallel_rank()
        cp_group = mpu.get_context_parallel_group() if isinstance(cp_size, int) and cp_size > 1 else None
    except (AssertionError, AttributeError, RuntimeError, ValueError) as error:  # megatron asserts when uninitialised
        raise ValueError(_NOT_INITIALISED.format(detail=f" ({type(error).__name__}: {error})")) from error
    if cp_size == 0:  # megatron's answer while torch.distributed is not initialised
        raise ValueError(_NOT_INITIALISED.format(detail=" (context parallel world size 0)"))
    return _context_once(tp_size, cp_size, cp_rank, cp_group)


def _context_once(tp_size: int, cp_size: int, cp_rank: int | None, cp_group: Any) -> ParallelContext:
    """The context of these answers, made once (``cp_rank`` None: asked of ``torch.distributed``, dynamic CP)."""
    key = (tp_size, cp_size, cp_rank, id(cp_group))
    found = _CONTEXTS.get(key)
    if found is not None and found[0] is cp_group:
        return found[1]
    if cp_rank is None:
        try:
            cp_rank = torch.distributed.get_rank(group=cp_group)
        except Exception as error:  # noqa: BLE001 - whatever torch.distributed raises: not a group it knows
            raise ValueError(
                f"local_cp_size={cp_size}: torch.distributed cannot tell this process's rank in the dynamic-CP "
                f"group {cp_group!r} ({type(error).__name__}: {error}); initialise torch.distributed and megatron's "
                "dynamic context-parallel groups first"
            ) from error
    context = ParallelContext(tp_size, cp_size, cp_rank, cp_group, group_from_megatron=True)
    if len(_CONTEXTS) >= 16:  # groups of torn-down parallel states: let them go
        _CONTEXTS.clear()
    _CONTEXTS[key] = (cp_group, context)
    return context


# parallel_state's getter of the dynamic-CP group of a size: verl (0.8+) tries the dev-branch name, then the released
DYNAMIC_CP_GROUP_GETTERS = ("get_dynamic_data_context_parallel_groups", "get_hybrid_data_context_parallel_groups")


def megatron_context(local_cp_size: int | None = None) -> ParallelContext:
    """TP/CP as verl reads them from ``parallel_state``; ``local_cp_size``: verl's dynamic-CP group of that size."""
    if local_cp_size is None:
        return parallel_context_from_megatron()
    require_int("local_cp_size", local_cp_size, minimum=1)
    mpu = parallel_state_module()
    get_groups = next(filter(None, (getattr(mpu, name, None) for name in DYNAMIC_CP_GROUP_GETTERS)), None)
    if get_groups is None:
        raise ValueError(
            "local_cp_size (dynamic context parallelism) needs megatron.core.parallel_state."
            f"{' or '.join(DYNAMIC_CP_GROUP_GETTERS)}, which this megatron-core lacks; pass local_cp_size=None or "
            "upgrade megatron-core"
        )
    return dynamic_cp_context(local_cp_size, get_groups(group_size=local_cp_size))


def dynamic_cp_context(local_cp_size: int, group: Any) -> ParallelContext:
    """The context of verl's dynamic-CP ``group`` of ``local_cp_size`` ranks (made once per group)."""
    tp_size = parallel_state_module().get_tensor_model_parallel_world_size()
    return _context_once(tp_size, local_cp_size, None, group)
