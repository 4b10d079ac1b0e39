"""verl's padding policies, expressed as core ``Alignment`` objects, and the parallel context verl reads.

Each verl util function pads differently; these helpers name the policy so the drop-ins stay one-liners:

- legacy THD (``preprocess_packed_seqs``): the core default (``TP*CP*2`` per slot when CP>1, else ``TP``;
  FP8: ``lcm(16, base)`` per slot and the stream to ``base*128``).
- engine THD (``preprocess_thd_engine``): base ``TP*CP*2`` for zigzag with CP>1, ``TP*CP`` otherwise (the
  contiguous layout), the FP8 variant of it, plus ``min_local_rows`` and ``pad_to_length_bucket`` as stream
  constraints.
- engine BSHD (``preprocess_bshd_engine``): every row padded to one length ``M`` (a THD plan whose slots
  all have length ``M``; its local stream reshaped ``[B, M/CP]`` is verl's zigzag-per-row BSHD layout).

Where verl would pad the stream to a length that breaks its own slot alignment (``min_local_rows`` or
``pad_to_length_bucket`` not a multiple of the slot multiple), we pad to the next length that keeps every
constraint; whenever verl's length is valid, ours is the same (it is the smallest valid length >= both).
"""

from __future__ import annotations

import math

from verl_cppack.context import ParallelContext
from verl_cppack.core.alignment import FP8_SLOT_MULTIPLE, FP8_STREAM_FACTOR, Alignment
from verl_cppack.core.checks import require_int
from verl_cppack.integrations.megatron import parallel_context_from_megatron

LAYOUTS = ("zigzag", "contiguous")


def megatron_context(local_cp_size: int | None = None) -> ParallelContext:
    """TP/CP sizes, CP rank and group as verl reads them from ``megatron.core.parallel_state``.

    ``local_cp_size`` selects verl's dynamic-CP group (``get_dynamic_data_context_parallel_groups``).
    """
    if local_cp_size is None:
        return parallel_context_from_megatron()
    require_int("local_cp_size", local_cp_size, minimum=1)
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    get_groups = getattr(mpu, "get_dynamic_data_context_parallel_groups", None)
    if get_groups is None:
        raise ValueError(
            "local_cp_size (dynamic context parallelism) needs megatron.core.parallel_state."
            "get_dynamic_data_context_parallel_groups, which this megatron-core lacks; pass local_cp_size=None "
            "or upgrade megatron-core"
        )
    group = get_groups(group_size=local_cp_size)
    return ParallelContext(
        tp_size=mpu.get_tensor_model_parallel_world_size(),
        cp_size=local_cp_size,
        cp_rank=dist.get_rank(group=group),
        cp_group=group,
    )


def check_layout(cp_layout: object) -> str:
    """verl's check, with verl's exception and message (callers match on them)."""
    if cp_layout not in LAYOUTS:
        raise ValueError(f"Unsupported context parallel layout: {cp_layout}")
    return cp_layout  # type: ignore[return-value]


def engine_thd_alignment(
    ctx: ParallelContext,
    cp_layout: str,
    use_fp8_padding: bool,
    min_local_rows: int | None,
    pad_to_length_bucket: int | None,
) -> Alignment:
    """``preprocess_thd_engine``'s padding (verl 0.9.1) as one ``Alignment``."""
    base = ctx.tp_size * ctx.cp_size * (2 if cp_layout == "zigzag" and ctx.cp_size > 1 else 1)
    slot_multiple, stream_multiple = base, base
    if use_fp8_padding:
        slot_multiple, stream_multiple = math.lcm(FP8_SLOT_MULTIPLE, base), base * FP8_STREAM_FACTOR
    min_stream_length = 0
    if min_local_rows is not None:
        min_stream_length = ctx.cp_size * require_int("min_local_rows", min_local_rows, minimum=0)
    if pad_to_length_bucket is not None:
        if isinstance(pad_to_length_bucket, bool) or not isinstance(pad_to_length_bucket, int) or pad_to_length_bucket <= 0:
            raise ValueError(f"pad_to_length_bucket must be a positive integer, got {pad_to_length_bucket!r}")
        stream_multiple = math.lcm(stream_multiple, pad_to_length_bucket, ctx.cp_size)
    stream_multiple = math.lcm(stream_multiple, slot_multiple, ctx.tp_size * ctx.cp_size)
    return Alignment(slot_multiple=slot_multiple, stream_multiple=stream_multiple, min_stream_length=min_stream_length)


def engine_bshd_row_length(
    ctx: ParallelContext, batch_size: int, max_seqlen: int, use_fp8_padding: bool
) -> int:
    """``preprocess_bshd_engine``'s padded row length ``M`` (global, before the CP cut), verl 0.9.1."""
    align = ctx.tp_size * ctx.cp_size * 2 if ctx.cp_size > 1 else ctx.tp_size
    multiple = align
    if use_fp8_padding:
        # FP8 block quantisation: batch_size * M must be a multiple of 128 * TP * CP.
        fp8_total = FP8_STREAM_FACTOR * ctx.tp_size * ctx.cp_size
        multiple = math.lcm(fp8_total // math.gcd(batch_size, fp8_total), align)
    return -(-max(max_seqlen, 1) // multiple) * multiple
