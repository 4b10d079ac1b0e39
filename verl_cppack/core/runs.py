"""Run-length expansion: per-run tables on the host -> per-position tensors on the device.

Every per-token index of a plan is piecewise constant or piecewise ``+1`` over *runs* of consecutive
positions (a slot, a CP chunk of a slot, its real tokens, its padding). The per-run arithmetic is numpy on
the host (``k`` entries); the device does one scatter of ``k`` values at the run starts and one cumulative
sum over the positions, with no loop over runs and no device->host sync.
"""

from __future__ import annotations

import numpy as np
import torch

from verl_cppack.core.host import to_device


def run_offsets(lengths: np.ndarray) -> np.ndarray:
    """``lengths`` [k] -> [k+1] where each run begins, then the total (``cu_seqlens`` of the lengths)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    lengths.cumsum(out=offsets[1:])
    return offsets


def run_starts(lengths: np.ndarray) -> np.ndarray:
    """``lengths`` [k] -> [k] position where each run begins."""
    return run_offsets(lengths)[:-1]


def repeat_runs(
    values: np.ndarray, lengths: np.ndarray, total: int, device: torch.device, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """``values[k]`` repeated ``lengths[k]`` times -> [total] ``dtype`` on ``device``.

    Equal to ``torch.repeat_interleave(values, lengths, output_size=total)`` (``total`` must be
    ``lengths.sum()``; zero-length runs allowed): the steps between runs are added at the run starts and
    summed up. Values must fit ``dtype`` (int8 for 0/1 flags).
    """
    steps = np.array(values, dtype=np.int64)
    steps[1:] -= values[:-1]
    return _sum_at_run_starts(lengths, steps, torch.zeros(total + 1, dtype=dtype, device=device), total)


def linear_runs(
    first_values: np.ndarray, lengths: np.ndarray, total: int, device: torch.device, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """Run ``k`` counts up by one from ``first_values[k]`` -> [total] ``dtype`` on ``device``.

    ``out[q] = first_values[k] + (q - start[k])`` for ``q`` in run ``k``. ``total`` must be ``lengths.sum()``;
    zero-length runs are allowed. With ``dtype=torch.int32`` (half the memory traffic) every value must fit.

    The increments ``out[q] - out[q-1]`` are 1, plus at each run start the jump from where counting would go
    on (the previous run's end + 1; 0 before the first position) to where this run begins; one cumulative
    sum adds them up. An empty run ends where it begins, so jumps across empty runs telescope.
    """
    jumps = np.array(first_values, dtype=np.int64)
    jumps[1:] -= first_values[:-1] + lengths[:-1]
    jumps[0] -= 1
    return _sum_at_run_starts(lengths, jumps, torch.ones(total + 1, dtype=dtype, device=device), total)


def linear_runs_host(first_values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``linear_runs`` on the host, int64 numpy, for short tables (one ``repeat``, one ``arange``)."""
    offsets = run_offsets(lengths)
    return (first_values - offsets[:-1]).repeat(lengths) + np.arange(offsets[-1])


def _sum_at_run_starts(lengths: np.ndarray, steps: np.ndarray, increments: torch.Tensor, total: int) -> torch.Tensor:
    """Add ``steps[k]`` at run ``k``'s start into ``increments`` [total + 1] and sum up -> [total] (the spare last
    slot takes runs that start at ``total``). The host table travels in one copy."""
    starts, steps_on_device = to_device(np.stack([run_starts(lengths), steps]), increments.device)
    return increments.index_add_(0, starts, steps_on_device.to(increments.dtype)).cumsum_(0)[:total]
