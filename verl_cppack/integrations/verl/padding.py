"""verl's padding rules as core ``Alignment`` objects, and the checks of the arguments that choose them: legacy THD
(``TP*CP*2`` per slot with CP>1, else ``TP``), engine THD (contiguous layout: ``TP*CP``; ``min_local_rows``,
``pad_to_length_bucket``), the engine BSHD row length; FP8: slots to ``lcm(block, base)``, stream to ``base*128``."""

from __future__ import annotations

import math

from verl_cppack.context import ParallelContext
from verl_cppack.core.alignment import FP8_STREAM_FACTOR, Alignment
from verl_cppack.core.checks import kept_per_arguments, require_int

LAYOUTS = ("zigzag", "contiguous")
# megatron-core's FP8 recipes (``megatron.core.enums.Fp8Recipe``) when it is not importable
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise", "custom")
MXFP8_BLOCK = 32  # MXFP8 scales blocks of 32 elements: every slot a multiple of 32 tokens
FP8_BLOCK = 16  # every other recipe: 16 (megatron.core.fp8_utils.get_fp8_align_size)


def fp8_block(fp8_recipe: object) -> int:
    """Tokens per FP8 quantisation block of ``fp8_recipe`` (None: verl's default recipe, 16), as megatron's
    ``get_fp8_align_size`` maps them; ``TypeError`` / ``ValueError`` naming ``fp8_recipe`` for anything else."""
    if fp8_recipe is None:
        return FP8_BLOCK
    if not isinstance(fp8_recipe, str):  # megatron's Fp8Recipe is a str enum
        raise TypeError(
            f"fp8_recipe must be None or a recipe name (str or megatron.core.enums.Fp8Recipe), got "
            f"{type(fp8_recipe).__name__} ({fp8_recipe!r})"
        )
    try:  # the recipe names this megatron-core knows
        from megatron.core.enums import Fp8Recipe

        names = tuple(recipe.value for recipe in Fp8Recipe)
    except ImportError:
        names = FP8_RECIPES
    if fp8_recipe not in names:  # (an Fp8Recipe equals its value)
        raise ValueError(f"fp8_recipe must be one of {', '.join(names)} (or None), got {fp8_recipe!r}")
    return MXFP8_BLOCK if fp8_recipe == "mxfp8" else FP8_BLOCK


def fp8_alignment(base: int, fp8_recipe: object) -> Alignment:
    """verl's FP8 padding over a base multiple: slots to ``lcm(block, base)``, the stream to ``base * 128``."""
    return Alignment.fp8(base, block=fp8_block(fp8_recipe))


def check_include_total_tokens(include_total_tokens: object) -> None:
    if not isinstance(include_total_tokens, bool):
        raise TypeError(
            f"include_total_tokens must be True or False, got {type(include_total_tokens).__name__} "
            f"({include_total_tokens!r})"
        )


def check_layout(cp_layout: object) -> str:
    """verl's check, with verl's exception and message (callers match on them)."""
    if cp_layout not in LAYOUTS:
        raise ValueError(f"Unsupported context parallel layout: {cp_layout}")
    return cp_layout  # type: ignore[return-value]


@kept_per_arguments  # every engine call asks
def engine_thd_alignment(
    ctx: ParallelContext,
    cp_layout: str,
    use_fp8_padding: bool,
    min_local_rows: int | None,
    pad_to_length_bucket: int | None,
    fp8_recipe: object = None,
) -> Alignment:
    """``preprocess_thd_engine``'s padding (verl 0.9.1; ``fp8_recipe`` as verl adds it) as one ``Alignment``."""
    base = ctx.default_slot_multiple if cp_layout == "zigzag" else ctx.tp_size * ctx.cp_size
    fp8 = fp8_alignment(base, fp8_recipe)  # the recipe is checked with or without FP8 padding
    slot_multiple, stream_multiple = (fp8.slot_multiple, fp8.stream_multiple) if use_fp8_padding else (base, base)
    min_stream_length = 0 if min_local_rows is None else ctx.cp_size * require_int("min_local_rows", min_local_rows)
    if pad_to_length_bucket is not None:
        if type(pad_to_length_bucket) is not int or pad_to_length_bucket <= 0:  # (a bool is not a length)
            raise ValueError(f"pad_to_length_bucket must be a positive integer, got {pad_to_length_bucket!r}")
        stream_multiple = math.lcm(stream_multiple, pad_to_length_bucket, ctx.cp_size)
    stream_multiple = math.lcm(stream_multiple, slot_multiple, ctx.tp_size * ctx.cp_size)
    return Alignment(slot_multiple=slot_multiple, stream_multiple=stream_multiple, min_stream_length=min_stream_length)


def engine_bshd_row_length(ctx: ParallelContext, batch_size: int, max_seqlen: int, use_fp8_padding: bool) -> int:
    """``preprocess_bshd_engine``'s padded row length ``M`` (global, before the CP cut), verl 0.9.1."""
    multiple = ctx.default_slot_multiple
    if use_fp8_padding:  # FP8 block quantisation: batch_size * M must be a multiple of 128 * TP * CP
        fp8_total = FP8_STREAM_FACTOR * ctx.tp_size * ctx.cp_size
        multiple = math.lcm(fp8_total // math.gcd(batch_size, fp8_total), multiple)
    return -(-max(max_seqlen, 1) // multiple) * multiple
