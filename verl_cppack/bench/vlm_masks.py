"""The VLM mask builders in ``verl-cppack bench``: verl's ``build_vlm_attn_mask_thd`` / ``_bshd`` against the drop-ins.

Measured at CP=1 (the builders communicate nothing), every call on a new jagged batch, so verl_cppack pays the host
read of the longest sequence that verl's forward has already paid: time per call, ATen ops and host syncs."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from verl_cppack.bench.batches import EngineMicroBatch, batch_seed, micro_batch
from verl_cppack.bench.counters import HostReadCounter, OpCounter
from verl_cppack.bench.ratios import span, spread, table

BUILDERS = ("thd", "bshd")
PAD_TOKEN_ID = 0
VLM_SEED_OFFSET = 500  # the builders' batches differ from the packing bench's of the same point


def jagged_batch(batch_size: int, seq_len: int, index: int, device: str) -> torch.Tensor:
    """The real tokens of a new rollout batch as a jagged nested tensor ``[B, j]`` int64."""
    seed = batch_seed(batch_size, seq_len, VLM_SEED_OFFSET + index)
    return EngineMicroBatch.of(micro_batch(batch_size, seq_len, seed=seed, device=device)).input_ids


def _call(impl: Any, builder: str, nested: torch.Tensor) -> Any:
    if builder == "thd":
        return impl.build_vlm_attn_mask_thd(nested, PAD_TOKEN_ID)
    return impl.build_vlm_attn_mask_bshd(nested, nested.size(0), PAD_TOKEN_ID)


def _copy(nested: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(nested.values().clone(), offsets=nested.offsets().clone())


def _counted(impl: Any, builder: str, nested: torch.Tensor) -> dict[str, int]:
    with OpCounter() as counter, HostReadCounter() as reads:
        _call(impl, builder, nested)
    return {"aten_ops": counter.total_ops, "host_syncs": counter.syncs() + reads.calls}


def measure_vlm_masks(
    verl_util: Any, ours: Any, batch_size: int, seq_len: int, repeats: int, warmup: int, device: str = "cpu"
) -> dict[str, dict[str, dict[str, float]]]:
    """``{builder: {"verl": ..., "verl_cppack": ...}}``: median ms per call, their spread (``ms_spread``), the counts.
    The calls alternate on copies of the same new batch: both see the same machine and allocator state."""
    impls = {"verl": verl_util, "verl_cppack": ours}
    names = list(impls)
    measured = {}
    for builder in BUILDERS:
        times: dict[str, list[float]] = {name: [] for name in impls}
        for index in range(warmup + repeats):
            base = jagged_batch(batch_size, seq_len, index, device)
            for name in names if index % 2 == 0 else names[::-1]:  # who goes first alternates too
                nested = _copy(base)
                begin = time.perf_counter()
                _call(impls[name], builder, nested)
                if index >= warmup:
                    times[name].append(time.perf_counter() - begin)
        counted = jagged_batch(batch_size, seq_len, warmup + repeats, device)
        measured[builder] = {
            name: {"ms": statistics.median(times[name]) * 1e3, "ms_spread": spread(times[name])}
            | _counted(impl, builder, _copy(counted))
            for name, impl in impls.items()
        }
    return measured


def ratio(row: dict[str, Any], builder: str) -> float:
    vlm = row["vlm_masks"][builder]
    return vlm["verl"]["ms"] / vlm["verl_cppack"]["ms"]


def vlm_table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for row in rows:
        if "vlm_masks" not in row:
            continue
        thd, bshd = row["vlm_masks"]["thd"], row["vlm_masks"]["bshd"]
        lines.append(
            f"| {row['seq_len']} | {row['batch_size']} | {thd['verl']['ms']:.2f} | {thd['verl_cppack']['ms']:.2f} "
            f"| **{ratio(row, 'thd'):.1f}** | {bshd['verl']['ms']:.2f} | {bshd['verl_cppack']['ms']:.2f} "
            f"| **{ratio(row, 'bshd'):.1f}** | {thd['verl']['aten_ops']} / {thd['verl_cppack']['aten_ops']} "
            f"| {thd['verl']['host_syncs']} / {thd['verl_cppack']['host_syncs']} |"
        )
    header = (
        "| S | B | verl thd ms | ours thd ms | thd × | verl bshd ms | ours bshd ms | bshd × | ops verl / ours (thd) "
    )
    return table(header + "| syncs verl / ours (thd) |", lines)


def vlm_summary(rows: list[dict[str, Any]]) -> list[str]:
    measured = [row for row in rows if "vlm_masks" in row]
    if not measured:
        return []
    lines = []
    for batch_size in sorted({row["batch_size"] for row in measured}):
        at_b = [row for row in measured if row["batch_size"] == batch_size]
        thd = [ratio(row, "thd") for row in at_b]
        bshd = [ratio(row, "bshd") for row in at_b]
        lines.append(
            f"- VLM mask builders, B={batch_size} (CP=1): `build_vlm_attn_mask_thd` {span(thd)}× and "
            f"`build_vlm_attn_mask_bshd` {span(bshd)}× verl's speed."
        )
    ours_ops = {row["vlm_masks"][b]["verl_cppack"]["aten_ops"] for row in measured for b in BUILDERS}
    ours_syncs = max(row["vlm_masks"][b]["verl_cppack"]["host_syncs"] for row in measured for b in BUILDERS)
    verl_syncs = [row["vlm_masks"][b]["verl"]["host_syncs"] for row in measured for b in BUILDERS]
    lines.append(
        f"- VLM mask builders: verl_cppack {min(ours_ops)}–{max(ours_ops)} ATen ops per call (every B, both builders) "
        f"and ≤ {ours_syncs} host sync; verl {min(verl_syncs)}–{max(verl_syncs)} syncs."
    )
    return lines
