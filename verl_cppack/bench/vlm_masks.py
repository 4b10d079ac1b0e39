"""The VLM mask builders in ``verl-cppack bench``: verl's ``build_vlm_attn_mask_thd`` / ``_bshd`` against the drop-ins.

verl calls them on every vision-language micro-batch (0.8+): a jagged batch of token ids becomes padded rows and a
bool mask, built with a Python loop over the rows and a host read per row. Measured at CP=1 (the builders
communicate nothing; CP only rounds the row length) on the bench's rollout batches: time per call (median of the
repeats, the two implementations' calls alternating; verl_cppack's plan cache is cleared before each, so every
call pays its one host read of the longest sequence, which in verl's forward the preceding
``preprocess_thd_engine`` has already paid), ATen ops and host syncs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from verl_cppack.bench.counters import HostReadCounter, OpCounter

BUILDERS = ("thd", "bshd")
PAD_TOKEN_ID = 0


def _calls(impl: Any, nested: torch.Tensor) -> dict[str, Any]:
    batch_size = nested.size(0)
    return {
        "thd": lambda: impl.build_vlm_attn_mask_thd(nested, PAD_TOKEN_ID),
        "bshd": lambda: impl.build_vlm_attn_mask_bshd(nested, batch_size, PAD_TOKEN_ID),
    }


def _counted(call: Any, reset: Any) -> dict[str, int]:
    reset()
    with OpCounter() as counter, HostReadCounter() as reads:
        call()
    return {"aten_ops": counter.total_ops, "host_syncs": counter.syncs() + reads.calls}


def _alternating_ms(calls: dict[str, Any], resets: dict[str, Any], repeats: int, warmup: int) -> dict[str, float]:
    """Median ms per call of each implementation, their calls alternating: both see the same state of the machine
    and of the allocator (timed one block after the other, the same call here moved by up to 2x between blocks)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for index in range(warmup + repeats):
        for name, call in calls.items():
            resets[name]()
            begin = time.perf_counter()
            call()
            if index >= warmup:
                times[name].append(time.perf_counter() - begin)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def measure_vlm_masks(
    verl_util: Any, ours: Any, input_ids: torch.Tensor, mask: torch.Tensor, repeats: int, warmup: int
) -> dict[str, dict[str, dict[str, float]]]:
    """``{builder: {"verl": ..., "verl_cppack": ...}}`` for one padded batch (its real tokens as the jagged ids)."""
    nested = torch.nested.nested_tensor_from_jagged(
        input_ids[mask], offsets=torch.nn.functional.pad(mask.sum(1).cumsum(0), (1, 0))
    )
    verl_calls, our_calls = _calls(verl_util, nested), _calls(ours, nested)
    resets = {"verl": lambda: None, "verl_cppack": ours.clear_plan_caches}
    measured = {}
    for builder in BUILDERS:
        calls = {"verl": verl_calls[builder], "verl_cppack": our_calls[builder]}
        ms = _alternating_ms(calls, resets, repeats, warmup)
        measured[builder] = {name: {"ms": ms[name], **_counted(calls[name], resets[name])} for name in calls}
    return measured


def median_over_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One point's VLM measurements of several runs -> the first with every time the median over the runs."""
    merged = {builder: {impl: dict(values) for impl, values in runs[0][builder].items()} for builder in BUILDERS}
    for builder in BUILDERS:
        for impl in ("verl", "verl_cppack"):
            merged[builder][impl]["ms"] = statistics.median(run[builder][impl]["ms"] for run in runs)
    return merged


def ratio(row: dict[str, Any], builder: str) -> float:
    vlm = row["vlm_masks"][builder]
    return vlm["verl"]["ms"] / vlm["verl_cppack"]["ms"]


def vlm_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| S | B | verl thd ms | ours thd ms | thd × | verl bshd ms | ours bshd ms | bshd × | ops verl / ours (thd) "
        "| syncs verl / ours (thd) |",
        "|" + "---|" * 10,
    ]
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
    return "\n".join(lines)


def vlm_summary(rows: list[dict[str, Any]]) -> list[str]:
    measured = [row for row in rows if "vlm_masks" in row]
    if not measured:
        return []
    lines = []
    at_256 = [row for row in measured if row["batch_size"] == 256]
    if at_256:
        thd = [ratio(row, "thd") for row in at_256]
        bshd = [ratio(row, "bshd") for row in at_256]
        lines.append(
            f"- VLM mask builders, B=256 (CP=1): `build_vlm_attn_mask_thd` {min(thd):.1f}–{max(thd):.1f}× and "
            f"`build_vlm_attn_mask_bshd` {min(bshd):.1f}–{max(bshd):.1f}× faster than verl's."
        )
    ours_ops = {row["vlm_masks"][b]["verl_cppack"]["aten_ops"] for row in measured for b in BUILDERS}
    ours_syncs = max(row["vlm_masks"][b]["verl_cppack"]["host_syncs"] for row in measured for b in BUILDERS)
    verl_syncs = [row["vlm_masks"][b]["verl"]["host_syncs"] for row in measured for b in BUILDERS]
    lines.append(
        f"- VLM mask builders: verl_cppack {min(ours_ops)}–{max(ours_ops)} ATen ops for every B and ≤ {ours_syncs} host "
        f"sync (none after `preprocess_thd_engine` on the same batch); verl {min(verl_syncs)}–{max(verl_syncs)} syncs."
    )
    return lines


def missed_targets(rows: list[dict[str, Any]]) -> list[str]:
    missed = []
    for row in rows:
        if "vlm_masks" not in row:
            continue
        for builder in BUILDERS:
            ours = row["vlm_masks"][builder]["verl_cppack"]
            if ours["host_syncs"] > 1:
                missed.append(f"VLM {builder} B={row['batch_size']} S={row['seq_len']}: {ours['host_syncs']} syncs")
            if row["batch_size"] == 256 and ratio(row, builder) <= 1:
                missed.append(f"VLM {builder} B=256 S={row['seq_len']}: only {ratio(row, builder):.2f}× verl's speed")
    return missed
