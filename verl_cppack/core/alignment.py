"""How much padding each slot of the THD stream gets, and the stream total."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from verl_cppack.core.checks import require_int, require_stream_int

# Transformer Engine's FP8 GEMMs need token counts that are multiples of 16 per slot; verl also
# extends the last slot so the stream total is a multiple of (base alignment * 128).
FP8_SLOT_MULTIPLE = 16
FP8_STREAM_FACTOR = 128


@dataclass(frozen=True)
class Alignment:
    """Padding policy of a packed stream.

    Every slot (one sequence's storage) is padded up to a multiple of ``slot_multiple``, and to at least
    ``min_slot_length`` (an empty sequence then still owns a slot of padding); then the last
    slot is extended so the stream total is a multiple of ``stream_multiple`` and at least
    ``min_stream_length``. The extension always belongs to a slot (never floats outside every slot),
    and ``stream_multiple`` is a multiple of ``slot_multiple`` so the extended slot stays aligned.
    """

    slot_multiple: int = 1
    stream_multiple: int = 1
    min_stream_length: int = 0
    min_slot_length: int = 0
    # the hash of the fields, computed once: plans are cached under alignments, looked up on every call
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Bounded before any arithmetic: with lengths and multiples below 2**31, padding never overflows int64.
        require_stream_int("slot_multiple", self.slot_multiple, minimum=1)
        require_stream_int("stream_multiple", self.stream_multiple, minimum=1)
        require_stream_int("min_stream_length", self.min_stream_length, minimum=0)
        require_stream_int("min_slot_length", self.min_slot_length, minimum=0)
        if self.min_slot_length % self.slot_multiple:
            raise ValueError(
                f"min_slot_length ({self.min_slot_length}) must be a multiple of slot_multiple ({self.slot_multiple})"
            )
        if self.stream_multiple % self.slot_multiple:
            raise ValueError(
                f"stream_multiple ({self.stream_multiple}) must be a multiple of slot_multiple "
                f"({self.slot_multiple}) so the extended last slot stays aligned"
            )
        fields = (self.slot_multiple, self.stream_multiple, self.min_stream_length, self.min_slot_length)
        object.__setattr__(self, "_hash", hash(fields))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    @functools.lru_cache(maxsize=64, typed=True)  # frozen, so shared: the drop-ins ask for one per call
    def per_slot(cls, multiple: int) -> Alignment:
        """Pad every slot to ``multiple`` (no extra stream-level padding)."""
        return cls(slot_multiple=multiple, stream_multiple=multiple)

    @classmethod
    def rows(cls, length: int) -> Alignment:
        """Every slot exactly ``length`` long, an empty sequence's too (BSHD rows; a longer sequence gets a longer
        slot, which callers that need rows refuse)."""
        return cls(slot_multiple=length, stream_multiple=length, min_slot_length=length)

    @classmethod
    def per_stream(cls, multiple: int) -> Alignment:
        """Pad only the stream total to ``multiple`` (contiguous layout / CP=1 only)."""
        return cls(slot_multiple=1, stream_multiple=multiple)

    @classmethod
    def fp8(cls, base_multiple: int, block: int = FP8_SLOT_MULTIPLE) -> Alignment:
        """verl's FP8 policy: slots to ``lcm(block, base)``, stream total to ``base * 128``. ``block``: tokens per
        quantisation block, 16 (FP8 GEMMs) or 32 (MXFP8)."""
        require_int("base_multiple", base_multiple, minimum=1)
        require_int("block", block, minimum=1)
        if FP8_STREAM_FACTOR % block:
            raise ValueError(f"block must divide {FP8_STREAM_FACTOR} (16 for FP8, 32 for MXFP8), got {block}")
        return cls(
            slot_multiple=math.lcm(block, base_multiple),
            stream_multiple=base_multiple * FP8_STREAM_FACTOR,
        )

    def pad(self, seqlens: np.ndarray) -> np.ndarray:
        """``seqlens`` [n] (host, integer, their total below ``2**31``) -> padded slot lengths [n] int64; the
        stream extension goes to the last slot."""
        policy = self.slot_multiple, self.stream_multiple, self.min_slot_length, self.min_stream_length
        return pad_lengths(np.asarray(seqlens, dtype=np.int64), *policy)


def pad_lengths(
    seqlens: np.ndarray, slot_multiple: int, stream_multiple: int, min_slot_length: int, min_stream_length: int
) -> np.ndarray:
    """``Alignment.pad``'s formula, the one there is: plain numpy that ``packing.compiled`` also compiles (numba) into
    its plan call. ``seqlens`` [n] int64 >= 0 -> a new [n] int64 array."""
    slot_lengths = np.maximum(seqlens + (-seqlens) % slot_multiple, min_slot_length)
    total = slot_lengths.sum()
    stream = max(-(-total // stream_multiple), -(-min_stream_length // stream_multiple)) * stream_multiple
    slot_lengths[-1] += stream - total  # >= 0, a multiple of slot_multiple: the last slot stays aligned
    return slot_lengths
