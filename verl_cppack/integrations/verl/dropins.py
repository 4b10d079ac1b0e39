"""Drop-ins for ``verl.models.mcore.util``'s packing functions (and its names before 0.8): verl's signatures and
results but for ``comparison.INTENDED_DIFFERENCES``. One ``PackPlan`` per micro-batch (TP/CP read as verl does), made
with one device->host sync when a mask or nested offsets are first seen; each gather-back is one all-gather, gradient
only into this rank's chunk; no Python loop over sequences."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from verl_cppack.context import ParallelContext
from verl_cppack.core import host
from verl_cppack.core.alignment import Alignment
from verl_cppack.core.checks import require_jagged, require_mask, require_tensor
from verl_cppack.integrations import megatron
from verl_cppack.integrations.megatron import dynamic_cp_context, megatron_context
from verl_cppack.integrations.verl.padding import (
    check_include_total_tokens,
    check_layout,
    engine_bshd_row_length,
    engine_thd_alignment,
    fp8_alignment,
    fp8_block,
)
from verl_cppack.integrations.verl.plan_cache import SourceSnapshot, TensorKeyedCache, attach_plan, attached_plan
from verl_cppack.packing.builders import plan_from_checked_mask, plan_from_lengths, plan_from_nested
from verl_cppack.packing.plan import PackPlan

_MASK_PLANS = TensorKeyedCache()  # attention mask -> plan
_NESTED_PLANS = TensorKeyedCache()  # nested offsets -> plan
_BSHD_MASKS = TensorKeyedCache()  # mask returned by a bshd preprocess -> how to undo it
_VLM_MASKS = TensorKeyedCache()  # mask returned by build_vlm_attn_mask_thd -> the plan of its ids' PackedSeqParams


def _mask_entry(
    attention_mask: torch.Tensor, ctx: ParallelContext, alignment: Alignment, layout: str = "zigzag"
) -> tuple[PackPlan, SourceSnapshot]:
    build = functools.partial(plan_from_checked_mask, attention_mask, ctx, layout=layout, alignment=alignment)
    return _MASK_PLANS.entry(attention_mask, (ctx, alignment, layout), build)


def mask_plan(
    attention_mask: torch.Tensor, ctx: ParallelContext, alignment: Alignment, layout: str = "zigzag"
) -> PackPlan:
    """The plan of a checked ``[B, S]`` mask under this policy, built once per mask tensor (see ``plan_cache``)."""
    return _mask_entry(attention_mask, ctx, alignment, layout)[0]


# Why a mask's plan cannot be known: kept for masks build_vlm_attn_mask_thd made when no plan of its ids existed.
UNKNOWN_PARAMS = (
    "attention_mask came from build_vlm_attn_mask_thd, but the PackedSeqParams verl built for the same ids were not "
    "made by verl_cppack's preprocess_thd_engine (it was left to verl), so their padding and layout cannot be known "
    "here; packing this micro-batch another way would misalign it with them. Run `verl-cppack doctor` to see why "
    "preprocess_thd_engine is verl's, or set VERL_CPPACK_DISABLE=1 to leave every packing function to verl and the "
    "bridge"
)


def remember_vlm_mask(attention_mask: torch.Tensor, nested: torch.Tensor) -> None:
    """Record on ``attention_mask`` the plan of verl's ``PackedSeqParams`` for the ``nested`` ids (or that none is)."""
    planned = _NESTED_PLANS.find(nested.offsets(), lambda value: isinstance(value, PackPlan))
    _VLM_MASKS.store(attention_mask, "verl", UNKNOWN_PARAMS if planned is None else planned)


def vlm_mask_plan(attention_mask: torch.Tensor, ctx: ParallelContext) -> PackPlan | None:
    """For a mask ``remember_vlm_mask`` saw: the plan packing its ``[B, S]`` rows into the stream of verl's
    ``PackedSeqParams`` for the same ids, checked against them; else ``None``. ``ctx`` must have verl's TP size."""
    verl_plan = _VLM_MASKS.lookup(attention_mask, "verl")
    if verl_plan is None:
        return None
    if isinstance(verl_plan, str):
        raise ValueError(verl_plan)
    if ctx.tp_size != verl_plan.ctx.tp_size:
        raise ValueError(
            f"the caller's tensor parallel size {ctx.tp_size} differs from the {verl_plan.ctx.tp_size} verl's "
            "PackedSeqParams were made with; pass the pg_collection of the model verl runs"
        )
    plan = mask_plan(attention_mask, verl_plan.ctx, verl_plan.alignment, verl_plan.layout.name)
    if not np.array_equal(plan.tables.cu_seqlens_padded, verl_plan.tables.cu_seqlens_padded):
        raise ValueError(
            "attention_mask no longer holds the sequences verl's PackedSeqParams were made for (its rows' lengths "
            "differ); pass the mask build_vlm_attn_mask_thd returned, unchanged"
        )
    return plan


def _nested_entry(
    nested: torch.Tensor, ctx: ParallelContext, layout: str, alignment: Alignment
) -> tuple[PackPlan, SourceSnapshot]:
    build = functools.partial(plan_from_nested, nested, ctx, layout=layout, alignment=alignment)
    return _NESTED_PLANS.entry(nested.offsets(), (ctx, layout, alignment), build)


def _nested_plan(nested: torch.Tensor, ctx: ParallelContext, layout: str, alignment: Alignment) -> PackPlan:
    return _nested_entry(nested, ctx, layout, alignment)[0]


def longest_sequence(nested: torch.Tensor) -> int:
    """The longest sequence of a jagged batch: a cached plan's (no sync), else one uncached read of its offsets."""
    planned = _NESTED_PLANS.find(nested.offsets(), lambda value: isinstance(value, PackPlan))
    if planned is not None:
        return planned.max_seqlen
    (offsets_host,) = host.read_to_host(nested.offsets())  # [B+1]
    return int((offsets_host[1:] - offsets_host[:-1]).max(initial=0))


def check_batch_size(batch_size: object, nested: torch.Tensor) -> None:
    """verl's ``batch_size`` argument must be the number of sequences in the jagged ``nested`` ids."""
    count = nested.offsets().shape[0] - 1
    if batch_size != count:
        raise ValueError(f"batch_size ({batch_size}) must equal the number of sequences in input_ids ({count})")


def _rows_of_mask(name: str, rows: object, mask: torch.Tensor) -> torch.Tensor:
    """``rows`` checked: a tensor whose leading ``[B, L]`` are the ``[B, L]`` mask's."""
    rows = require_tensor(name, rows)
    if tuple(rows.shape[:2]) != tuple(mask.shape):
        raise ValueError(
            f"{name}.shape[:2] {tuple(rows.shape[:2])} must equal attention_mask.shape {tuple(mask.shape)}"
        )
    return rows


def _packed_seq_params(plan: PackPlan, snapshot: SourceSnapshot, include_total_tokens: bool = False) -> Any:
    params = megatron.packed_seq_params(plan, include_total_tokens=include_total_tokens)
    return attach_plan(params, plan, snapshot)


def given_offsets(packed_seq_params: Any) -> torch.Tensor:
    """The padded offsets ``packed_seq_params`` carries (``cu_seqlens_q_padded``, else ``cu_seqlens_q``); ``TypeError``
    for anything that carries none (``None``, a dict, another object), before any plan is built."""
    given = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    if given is None:
        given = getattr(packed_seq_params, "cu_seqlens_q", None)
    if not isinstance(given, torch.Tensor):
        raise TypeError(
            "packed_seq_params must be the PackedSeqParams the matching preprocess call returned (THD offsets in "
            f"cu_seqlens_q_padded or cu_seqlens_q), got {type(packed_seq_params).__name__}"
        )
    return given


def _replan(packed_seq_params: Any, alignments: list[Alignment], build) -> PackPlan:
    """``build(alignment)`` for the first of ``alignments`` giving ``packed_seq_params``' offsets (a sync each)."""
    given = given_offsets(packed_seq_params)
    for alignment in alignments:
        try:
            plan = build(alignment)
        except ValueError as error:  # this padding cannot cut the batch: try the next
            message = str(error)
            continue
        expected = plan.cu_seqlens_padded
        if given.shape == expected.shape and torch.equal(given.to(expected.device, expected.dtype), expected):
            return plan
        message = (
            "packed_seq_params does not describe this batch (its cu_seqlens_q_padded differ from the batch's "
            "padded offsets); pass the packed_seq_params the matching preprocess call returned"
        )
    raise ValueError(message)


# ============================================================ padded (legacy) API
def preprocess_packed_seqs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pre_process: bool = True,
    use_fp8_padding: bool = False,
    fp8_recipe: str | None = None,
    include_total_tokens: bool = False,
) -> tuple[torch.Tensor, Any]:
    """``[B, S, *]`` + mask ``[B, S]`` -> (``[1, T/CP, *]`` this rank's packed rows, ``PackedSeqParams``; FP8 padding:
    ``padding``; ``include_total_tokens``: its ``total_tokens`` / ``seq_idx`` set)."""
    mask = require_mask("attention_mask", attention_mask)
    fp8_block(fp8_recipe)
    check_include_total_tokens(include_total_tokens)
    ctx = megatron_context()
    base = ctx.default_slot_multiple
    alignment = fp8_alignment(base, fp8_recipe) if use_fp8_padding else Alignment.per_slot(base)
    plan, snapshot = _mask_entry(mask, ctx, alignment)
    packed_seq_params = _packed_seq_params(plan, snapshot, include_total_tokens)
    if not pre_process:
        return input_ids, packed_seq_params
    return plan.pack(input_ids, name="input_ids"), packed_seq_params


def _plan_for_mask(packed_seq_params: Any, attention_mask: torch.Tensor) -> PackPlan:
    plan, same_source = attached_plan(packed_seq_params, attention_mask)
    if same_source:
        return plan
    ctx = plan.ctx if plan is not None else megatron_context()
    base = ctx.default_slot_multiple  # the paddings preprocess_packed_seqs can have made: plain, FP8, MXFP8
    alignments = [Alignment.per_slot(base), fp8_alignment(base, None), fp8_alignment(base, "mxfp8")]
    alignments = alignments if plan is None else [plan.alignment, *alignments]
    return _replan(packed_seq_params, alignments, lambda alignment: mask_plan(attention_mask, ctx, alignment))


def postprocess_packed_seqs(
    output: torch.Tensor,
    packed_seq_params: Any,
    attention_mask: torch.Tensor,
    batch_size: int,
    seq_len: int,
    post_process: bool = True,
) -> torch.Tensor:
    """This rank's ``[1, T/CP, *]`` output -> ``[B, S, *]`` on every CP rank (zeros at padding, dtype kept)."""
    if not post_process:
        return output
    mask = require_mask("attention_mask", attention_mask)
    if (batch_size, seq_len) != tuple(mask.shape):
        raise ValueError(f"batch_size, seq_len = {(batch_size, seq_len)} must match attention_mask {tuple(mask.shape)}")
    return _plan_for_mask(packed_seq_params, mask).unpack(output, name="output")


def postprocess_packed_seqs_for_dict_output(
    labels_mask: torch.Tensor,
    output: Any,
    packed_seq_params: Any,
    attention_mask: torch.Tensor,
    batch_size: int,
    seq_len: int,
    post_process: bool = True,
) -> dict[str, torch.Tensor]:
    """Fused-kernel outputs (``entropy``, ``log_probs`` [1, T/CP]) -> ``{"entropy", "log_probs"}`` ``[B, S]``; like
    verl it rewrites them on ``output`` as ``[1, T/CP]`` views, log-probs zeroed where ``labels_mask`` is False."""
    output.entropy = output.entropy.view(1, -1)
    output.log_probs = output.log_probs.view(1, -1).masked_fill(~labels_mask, 0.0)
    return {
        name: postprocess_packed_seqs(
            getattr(output, name), packed_seq_params, attention_mask, batch_size, seq_len, post_process=post_process
        )
        for name in ("entropy", "log_probs")
    }


# ----------------------------------------------------------------- padded BSHD
def _compaction(attention_mask: torch.Tensor, row_multiple: int) -> tuple[tuple, SourceSnapshot]:
    """``preprocess_bshd``'s left-alignment of a mask's real tokens: (CP=1 unaligned plan, ``L``, ``[B*L]`` rows)."""

    def build() -> tuple[PackPlan, int, torch.Tensor]:
        plan = plan_from_checked_mask(attention_mask, ParallelContext(), alignment=1)
        row_length = -(-plan.max_seqlen // row_multiple) * row_multiple
        return plan, row_length, plan.local_slot * row_length + plan.local_position_ids  # [N]

    return _MASK_PLANS.entry(attention_mask, ("compaction", row_multiple), build)


def _to_rows(compaction: tuple, x: torch.Tensor, name: str) -> torch.Tensor:
    """``[B, S, *]`` -> ``[B, L, *]``: real tokens left-aligned, zeros after."""
    plan, row_length, compact_index = compaction
    tokens = plan.pack(x, name=name)[0]  # [N, *]
    rows = tokens.new_zeros((plan.batch_size * row_length, *tokens.shape[1:]))
    return rows.index_copy(0, compact_index, tokens).view(plan.batch_size, row_length, *tokens.shape[1:])


def preprocess_bshd(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    sequence_parallel: bool = False,
    pre_process: bool = True,
):
    """Remove the padding of each row: ``(input_ids [B, L, *], attention_mask [B, L], position_ids [B, L])``, ``L``
    the longest row (rounded up to TP with sequence parallelism). CP must be 1, as in verl."""
    mask = require_mask("attention_mask", attention_mask)
    position_ids = require_tensor("position_ids", position_ids)
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be 2-D [B, S], got shape {tuple(position_ids.shape)}")
    ctx = megatron_context()
    if ctx.cp_size != 1:
        raise ValueError(f"preprocess_bshd needs context parallel size 1 (got {ctx.cp_size}); use the THD path")
    compaction, mask_snapshot = _compaction(mask, ctx.tp_size if sequence_parallel else 1)
    # [B, L], 1 at real tokens (verl: the mask's own values)
    new_mask = _to_rows(compaction, mask != 0, "attention_mask").to(mask.dtype)
    _BSHD_MASKS.store(new_mask, "compaction", (mask_snapshot, compaction))
    new_position_ids = _to_rows(compaction, position_ids, "position_ids")
    return (_to_rows(compaction, input_ids, "input_ids") if pre_process else input_ids), new_mask, new_position_ids


def postprocess_bshd(
    result: torch.Tensor,
    attention_mask: torch.Tensor,
    original_attention_mask: torch.Tensor,
    origin_seqlen: int,
    post_process: bool = True,
):
    """Undo ``preprocess_bshd``: ``[B, L, *]`` -> ``[B, origin_seqlen, *]``, zeros at the original padding."""
    if not post_process:
        return result
    mask = require_mask("attention_mask", attention_mask)
    original = require_mask("original_attention_mask", original_attention_mask)
    if original.shape[1] != origin_seqlen:
        raise ValueError(
            f"origin_seqlen ({origin_seqlen}) must equal original_attention_mask.shape[1] ({original.shape[1]})"
        )
    result = _rows_of_mask("result", result, mask)
    record = _BSHD_MASKS.lookup(mask, "compaction")
    if record is not None and record[0].matches(original):  # the inverse of _to_rows on the real tokens
        plan, _, compact_index = record[1]
        return plan.restore([result.flatten(0, 1).index_select(0, compact_index).unsqueeze(0)])
    # A mask we did not make: both masks must hold the same number of real tokens per row (one sync).
    source = plan_from_checked_mask(mask, ParallelContext(), alignment=1)
    target = plan_from_checked_mask(original, ParallelContext(), alignment=1)
    if source.batch_size != target.batch_size or not torch.equal(source.seqlens, target.seqlens):
        raise ValueError("attention_mask and original_attention_mask must have the same number of real tokens per row")
    return target.restore([source.pack(result, name="result")])


# ============================================================ nested (engine) API
def preprocess_thd_engine(
    input_ids: torch.Tensor,
    pre_process: bool = True,
    need_roll: bool = False,
    use_fp8_padding: bool = False,
    local_cp_size: int | None = None,
    min_local_rows: int | None = None,
    pad_to_length_bucket: int | None = None,
    cp_layout: str = "zigzag",
    fp8_recipe: str | None = None,
    include_total_tokens: bool = False,
) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
    """Jagged ``[B, j, *]`` -> (``[1, T/CP, *]`` local rows, ``PackedSeqParams``, ``[1, T/CP]`` position ids);
    ``need_roll``: each token's successor in its sequence (labels), wrapping; ``pre_process=False``: ``input_ids``."""
    layout = check_layout(cp_layout)
    nested = require_jagged("input_ids", input_ids)
    check_include_total_tokens(include_total_tokens)
    ctx = megatron_context(local_cp_size)
    alignment = engine_thd_alignment(
        ctx, layout, bool(use_fp8_padding), min_local_rows, pad_to_length_bucket, fp8_recipe=fp8_recipe
    )
    plan, snapshot = _nested_entry(nested, ctx, layout, alignment)
    packed_seq_params = _packed_seq_params(plan, snapshot, include_total_tokens)
    if local_cp_size is not None:
        packed_seq_params.local_cp_size = local_cp_size
        packed_seq_params.cp_group = ctx.cp_group
    if not pre_process:
        return input_ids, packed_seq_params, None
    packed = plan.pack(nested, shift=1 if need_roll else 0, wrap=bool(need_roll), name="input_ids")  # [1, T/CP, *]
    return packed, packed_seq_params, plan.local_token_positions.clone()  # [1, T/CP]


def _plan_for_nested(packed_seq_params: Any, nested: torch.Tensor, local_cp_size: int | None, layout: str) -> PackPlan:
    plan, same_source = attached_plan(packed_seq_params, nested.offsets())
    if plan is not None and plan.layout.name != layout:
        raise ValueError(f"cp_layout={layout!r} but packed_seq_params were made with the {plan.layout.name!r} layout")
    if same_source:
        return plan
    if plan is not None:
        ctx, alignments = plan.ctx, [plan.alignment]
    elif local_cp_size is not None:  # verl: the dynamic-CP group travels on packed_seq_params
        given_offsets(packed_seq_params)  # a PackedSeqParams, before its group is read
        ctx = dynamic_cp_context(local_cp_size, packed_seq_params.cp_group)
    else:
        ctx = megatron_context()
    if plan is None:  # the paddings preprocess_thd_engine can have made without length options: plain, FP8, MXFP8
        alignments = [
            engine_thd_alignment(ctx, layout, fp8, None, None, fp8_recipe=recipe)
            for fp8, recipe in ((False, None), (True, None), (True, "mxfp8"))
        ]
    return _replan(packed_seq_params, alignments, lambda alignment: _nested_plan(nested, ctx, layout, alignment))


def postprocess_thd_engine(
    output: torch.Tensor,
    packed_seq_params: Any,
    input_ids: torch.Tensor,
    batch_size: int,
    post_process: bool = True,
    local_cp_size: int | None = None,
    cp_layout: str = "zigzag",
) -> torch.Tensor:
    """This rank's ``[1, T/CP, *]`` output -> jagged ``[B, j, *]`` of the real tokens on every CP rank."""
    layout = check_layout(cp_layout)
    if not post_process:
        return output
    nested = require_jagged("input_ids", input_ids)
    check_batch_size(batch_size, nested)
    return _plan_for_nested(packed_seq_params, nested, local_cp_size, layout).unpack_nested(output, name="output")


def preprocess_bshd_engine(
    input_ids: torch.Tensor,
    pre_process: bool = True,
    need_roll: bool = False,
    use_fp8_padding: bool = False,
    forced_max_seqlen: int | None = None,
):
    """Jagged ``[B, j, *]`` -> (``[B, M/CP, *]``, bool mask ``[B, M/CP]``, position ids ``[B, M/CP]``), ``M`` the
    longest sequence or ``forced_max_seqlen`` aligned as verl does, rows cut zigzag; ``pre_process`` is ignored."""
    nested = require_jagged("input_ids", input_ids)
    ctx = megatron_context()
    batch_size = nested.size(0)
    longest = longest_sequence(nested) if forced_max_seqlen is None else forced_max_seqlen
    row_length = engine_bshd_row_length(ctx, batch_size, longest, bool(use_fp8_padding))
    plan = _nested_plan(nested, ctx, "zigzag", Alignment.rows(row_length))
    if plan.total_length != batch_size * row_length:
        raise ValueError(
            f"every sequence must hold at most {row_length} tokens for the BSHD layout (forced_max_seqlen="
            f"{forced_max_seqlen}, longest sequence {plan.max_seqlen}); raise forced_max_seqlen"
        )
    local_rows = row_length // ctx.cp_size
    packed = plan.pack(nested, shift=1 if need_roll else 0, wrap=bool(need_roll), name="input_ids")[0]  # [B*M/CP, *]
    attention_mask = plan.local_valid_mask.view(batch_size, local_rows)
    _BSHD_MASKS.store(attention_mask, "engine", plan)
    position_ids = plan.local_position_ids.view(batch_size, local_rows)
    return packed.view(batch_size, local_rows, *packed.shape[1:]), attention_mask, position_ids


def _plan_for_bshd_mask(attention_mask: torch.Tensor) -> PackPlan:
    """The plan ``preprocess_bshd_engine`` made the mask with, else one rebuilt from its real-token counts. The counts
    are all-reduced over CP on every call, cached or not, so all CP ranks run the same collectives in order."""
    ctx = megatron_context()
    batch_size, local_rows = attention_mask.shape
    seqlens = (attention_mask != 0).sum(dim=1)
    if ctx.cp_size > 1:
        torch.distributed.all_reduce(seqlens, group=ctx.cp_group)
    plan = _BSHD_MASKS.lookup(attention_mask, "engine")
    if plan is not None:
        return plan
    row_length = local_rows * ctx.cp_size
    plan = plan_from_lengths(seqlens, ctx, alignment=Alignment.rows(row_length))
    if plan.total_length != batch_size * row_length or not torch.equal(
        plan.local_valid_mask.view(batch_size, local_rows), attention_mask != 0
    ):
        raise ValueError(
            "attention_mask is not a BSHD mask preprocess_bshd_engine could have made (each row's real tokens must "
            "open the row before the zigzag cut); pass the mask preprocess_bshd_engine returned"
        )
    return plan


def postprocess_bshd_engine(
    output: torch.Tensor, attention_mask: torch.Tensor, post_process: bool = True
) -> torch.Tensor:
    """This rank's ``[B, M/CP, *]`` output -> jagged ``[B, j, *]`` of the real tokens on every CP rank."""
    if not post_process:
        return output
    mask = require_mask("attention_mask", attention_mask)
    output = _rows_of_mask("output", output, mask)
    batch_size, local_rows = mask.shape
    local = output.reshape(1, batch_size * local_rows, *output.shape[2:])
    return _plan_for_bshd_mask(mask).unpack_nested(local, name="output")


def clear_plan_caches() -> None:
    """Forget every cached plan (tests, or to release memory between steps)."""
    for cache in (_MASK_PLANS, _NESTED_PLANS, _BSHD_MASKS, _VLM_MASKS):
        cache.clear()


# ============================================================ verl's names before 0.8
# verl's renames: 0.6 ``*_packed_seqs_no_padding`` / ``remove/recover_left_padding`` -> 0.7 ``*_thd/bshd_no_padding``
# -> 0.8 ``*_engine`` / ``*_bshd``; the THD preprocess returns a pair until 0.7.0, a triple from 0.7.1. An old name
# the 0.8 drop-in serves is that drop-in; ``patching`` picks the variant by signature.
remove_left_padding, recover_left_padding = preprocess_bshd, postprocess_bshd  # 0.6
postprocess_thd_no_padding = postprocess_packed_seqs_no_padding = postprocess_thd_engine  # 0.7 (0.6)
preprocess_bshd_no_padding, postprocess_bshd_no_padding = preprocess_bshd_engine, postprocess_bshd_engine  # 0.7


def preprocess_thd_no_padding_pair(
    input_ids: torch.Tensor, pre_process: bool = True, need_roll: bool = False
) -> tuple[torch.Tensor, Any]:
    """verl 0.7.0's ``preprocess_thd_no_padding`` (and 0.6's ``preprocess_packed_seqs_no_padding``): the pair
    ``(packed [1, T/CP, *], PackedSeqParams)``, zigzag layout."""
    return preprocess_thd_engine(input_ids, pre_process=pre_process, need_roll=need_roll)[:2]


preprocess_packed_seqs_no_padding = preprocess_thd_no_padding_pair


# the engine's signature (0.7.1's parameters first, the rest defaulted), this function's name and docstring
@functools.wraps(preprocess_thd_engine, assigned=())
def preprocess_thd_no_padding(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
    """verl 0.7.1's: the triple, its position ids shaped like the packed rows (``[1, T/CP, *]``: 0.7.1 repeats them
    over the trailing dimensions of ``input_ids``)."""
    packed, packed_seq_params, position_ids = preprocess_thd_engine(*args, **kwargs)
    if position_ids is not None and packed.dim() > 2:
        position_ids = position_ids.view(*position_ids.shape, *(1,) * (packed.dim() - 2)).expand(packed.shape)
    return packed, packed_seq_params, position_ids
