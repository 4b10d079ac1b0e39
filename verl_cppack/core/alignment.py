"""How much padding each slot of the THD stream gets, and the stream total."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from verl_cppack.core.checks import require_int

# Transformer Engine's FP8 GEMMs need token counts that are multiples of 16 per slot; verl also
# extends the last slot so the stream total is a multiple of (base alignment * 128).
FP8_SLOT_MULTIPLE = 16
FP8_STREAM_FACTOR = 128


@dataclass(frozen=True)
class Alignment:
    """Padding policy of a packed stream.

    Every slot (one sequence's storage) is padded up to a multiple of ``slot_multiple``; then the last
    slot is extended so the stream total is a multiple of ``stream_multiple`` and at least
    ``min_stream_length``. The extension always belongs to a slot (never floats outside every slot),
    and ``stream_multiple`` is a multiple of ``slot_multiple`` so the extended slot stays aligned.
    """

    slot_multiple: int = 1
    stream_multiple: int = 1
    min_stream_length: int = 0

    def __post_init__(self) -> None:
        require_int("slot_multiple", self.slot_multiple, minimum=1)
        require_int("stream_multiple", self.stream_multiple, minimum=1)
        require_int("min_stream_length", self.min_stream_length, minimum=0)
        if self.stream_multiple % self.slot_multiple:
            raise ValueError(
                f"stream_multiple ({self.stream_multiple}) must be a multiple of slot_multiple "
                f"({self.slot_multiple}) so the extended last slot stays aligned"
            )

    @classmethod
    def per_slot(cls, multiple: int) -> "Alignment":
        """Pad every slot to ``multiple`` (no extra stream-level padding)."""
        return cls(slot_multiple=multiple, stream_multiple=multiple)

    @classmethod
    def per_stream(cls, multiple: int) -> "Alignment":
        """Pad only the stream total to ``multiple`` (contiguous layout / CP=1 only)."""
        return cls(slot_multiple=1, stream_multiple=multiple)

    @classmethod
    def fp8(cls, base_multiple: int) -> "Alignment":
        """verl's FP8 policy: slots to ``lcm(16, base)``, stream total to ``base * 128``."""
        require_int("base_multiple", base_multiple, minimum=1)
        return cls(
            slot_multiple=math.lcm(FP8_SLOT_MULTIPLE, base_multiple),
            stream_multiple=base_multiple * FP8_STREAM_FACTOR,
        )

    def pad(self, seqlens: torch.Tensor, num_sequences: torch.Tensor | None = None) -> torch.Tensor:
        """``seqlens`` [n] (any integer dtype) -> padded slot lengths [n] int64, on the same device.

        ``num_sequences`` ([] tensor, no host read): ``seqlens`` is a capacity-sized buffer whose first
        ``num_sequences`` entries are the sequences and the rest zeros; the stream extension then goes to
        the last real slot and the zero entries stay zero.
        """
        seqlens = seqlens.long()
        slot_lengths = (seqlens + self.slot_multiple - 1) // self.slot_multiple * self.slot_multiple
        total = slot_lengths.sum()
        target = (total + self.stream_multiple - 1) // self.stream_multiple * self.stream_multiple
        minimum = -(-self.min_stream_length // self.stream_multiple) * self.stream_multiple
        extension = target.clamp(min=minimum) - total  # [] >= 0, a multiple of slot_multiple
        if num_sequences is None:
            last_slot = torch.zeros_like(slot_lengths)
            last_slot[-1:] = 1
        else:
            last_slot = (torch.arange(seqlens.numel(), device=seqlens.device) == num_sequences - 1).long()
        return slot_lengths + last_slot * extension
