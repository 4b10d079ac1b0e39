"""Run-length expansion: the one primitive behind per-token quantities that are constant per sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def repeat_runs(values: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """``values`` [..., k], each repeated ``lengths[k]`` times along the last dim -> [..., total].

    Equal to ``torch.repeat_interleave(values, lengths, dim=-1, output_size=total)`` (``total`` must be
    ``lengths.sum()``; zero-length runs allowed) for integer ``values``, computed as a cumulative sum of the
    steps between runs: one ``index_add`` at the run starts and one ``cumsum``, no host sync.
    """
    starts = F.pad(torch.cumsum(lengths, 0), (1, 0))[:-1]  # [k] where each run begins
    steps = torch.diff(values, dim=-1, prepend=torch.zeros_like(values[..., :1]))  # [..., k]
    expanded = torch.zeros((*values.shape[:-1], total + 1), dtype=values.dtype, device=values.device)
    expanded.index_add_(-1, starts, steps)  # empty runs add at the same start; runs past the end land on the spare slot
    return expanded[..., :total].cumsum_(-1)
