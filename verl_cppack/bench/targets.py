"""The performance targets ``verl-cppack bench --strict`` checks, as functions over the bench's rows (one (B, S, CP)
point each, ``measure.py``; times are medians); docs/performance.md tabulates them. Per micro-batch:

- B=1 (and every VLM mask builder call): ours ≤ verl × (1 + noise), the noise being the relative interquartile range
  of verl's own timed calls at that point (``ratios.spread``), the median over the runs;
- from B=16: preprocess ≥ 2× and postprocess ≥ 1.5× verl's speed, the latter re-based where the floor (``floors.py``)
  leaves less room: the floor's own ratio over 1 + the noise (``postprocess_target``);
- B=256: preprocess ≥ 50% of the copies-only ratio; at every point ≤ 1 host sync, the same ATen op count for every B,
  peak extra memory ≤ 1.5× verl's (``counters.OpCounter``); VLM builders ≤ 1 host sync per call.

Stretch target (``stretch_missed``; printed, never fails ``--strict``; not met today): B=1 preprocess ≥ 2× verl's.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from verl_cppack.bench.ratios import ratios

FROM_B = 16
PREPROCESS_FROM_B = 2.0
POSTPROCESS_FROM_B = 1.5
LARGE_B = 256
SHARE_OF_COPIES_ONLY = 0.5
MAX_HOST_SYNCS = 1
MEMORY_OF_VERLS = 1.5
STRETCH_B1_PREPROCESS = 2.0
STAGES = ("preprocess", "postprocess")


def _point(row: dict[str, Any]) -> str:
    return f"B={row['batch_size']} S={row['seq_len']} CP={row['cp_size']}"


def noise(row: dict[str, Any], stage: str) -> float:
    """The relative spread of verl's own ``stage`` times at this point in this run (0 where none was recorded)."""
    return row["verl"].get(f"{stage}_spread", 0.0)


def _beyond_noise(speed: float, spread: float) -> str | None:
    """The miss of "never slower than verl beyond the noise" at ``speed`` (verl's time over ours), else None."""
    why = f"slower than verl by more than its own spread in this run ({spread:.0%}; target: within the noise)"
    return None if speed * (1 + spread) >= 1 else f"{speed:.2f}× verl's speed, {why}"  # ours / verl time > 1 + noise


def postprocess_target(row: dict[str, Any]) -> float:
    """The postprocess speed asked for from B=16: 1.5× verl's, or, where the floor leaves less room, the floor's own
    ratio divided by 1 + the noise of verl's postprocess at this point in this run."""
    return min(POSTPROCESS_FROM_B, ratios(row)["postprocess_floor"] / (1 + noise(row, "postprocess")))


def _speed_targets(row: dict[str, Any]) -> list[str]:
    r, point, batch_size = ratios(row), _point(row), row["batch_size"]
    missed = []
    if batch_size == 1:
        missed += [
            f"{point}: {stage} {slower}" for stage in STAGES if (slower := _beyond_noise(r[stage], noise(row, stage)))
        ]
    if batch_size >= FROM_B:
        if r["preprocess"] < PREPROCESS_FROM_B:
            missed.append(f"{point}: preprocess {r['preprocess']:.2f}× verl's speed (target ≥ {PREPROCESS_FROM_B}×)")
        target = postprocess_target(row)
        if r["postprocess"] < target:
            why = (
                f"{POSTPROCESS_FROM_B}×"
                if target == POSTPROCESS_FROM_B
                else f"{target:.2f}×: the floor's {r['postprocess_floor']:.2f}× over 1 + the noise "
                f"{noise(row, 'postprocess'):.0%}"
            )
            missed.append(f"{point}: postprocess {r['postprocess']:.2f}× verl's speed (target ≥ {why})")
    if batch_size == LARGE_B and r["preprocess_of_floor"] < SHARE_OF_COPIES_ONLY:
        missed.append(
            f"{point}: preprocess {r['preprocess']:.1f}× verl's speed is {r['preprocess_of_floor']:.0%} of the "
            f"copies-only {r['preprocess_floor']:.1f}× (target ≥ {SHARE_OF_COPIES_ONLY:.0%})"
        )
    return missed


def _cost_targets(row: dict[str, Any]) -> list[str]:
    ours, verl, point = row["verl_cppack"], row["verl"], _point(row)
    missed = []
    if ours["host_syncs"] > MAX_HOST_SYNCS:
        missed.append(f"{point}: {ours['host_syncs']} host syncs per micro-batch (target ≤ {MAX_HOST_SYNCS})")
    if ours["peak_extra_mb"] > MEMORY_OF_VERLS * verl["peak_extra_mb"]:
        missed.append(
            f"{point}: peak extra memory {ours['peak_extra_mb']:.3g} MB, "
            f"{ours['peak_extra_mb'] / verl['peak_extra_mb']:.2f}× verl's (target ≤ {MEMORY_OF_VERLS}×)"
        )
    return missed


def _flat_in_batch_size(rows: list[dict[str, Any]]) -> list[str]:
    by_series: dict[tuple[int, int], dict[int, int]] = defaultdict(dict)
    for row in rows:
        by_series[row["seq_len"], row["cp_size"]][row["batch_size"]] = row["verl_cppack"]["aten_ops"]
    missed = []
    for (seq_len, cp_size), ops in sorted(by_series.items()):
        if len(set(ops.values())) > 1:
            seen = ", ".join(f"B={b}: {n}" for b, n in sorted(ops.items()))
            missed.append(
                f"S={seq_len} CP={cp_size}: ATen ops per micro-batch differ across B ({seen}; target: the same for every B)"
            )
    return missed


def _vlm_targets(row: dict[str, Any]) -> list[str]:
    missed = []
    for builder, measured in row.get("vlm_masks", {}).items():
        ours, verl = measured["verl_cppack"], measured["verl"]
        point = f"VLM {builder} B={row['batch_size']} S={row['seq_len']}"
        if ours["host_syncs"] > MAX_HOST_SYNCS:
            missed.append(f"{point}: {ours['host_syncs']} host syncs per call (target ≤ {MAX_HOST_SYNCS})")
        slower = _beyond_noise(verl["ms"] / ours["ms"], verl.get("ms_spread", 0.0))  # as at B=1 of the unit
        if slower:
            missed.append(f"{point}: {slower}")
    return missed


def missed_targets(rows: list[dict[str, Any]]) -> list[str]:
    """One line per target a point missed, naming the point, the figure and the target (empty: every target met)."""
    missed = []
    for row in rows:
        missed += _speed_targets(row) + _cost_targets(row)
    missed += _flat_in_batch_size(rows)
    for row in rows:
        missed += _vlm_targets(row)
    return missed


def stretch_missed(rows: list[dict[str, Any]]) -> list[str]:
    """The stretch target's misses, one line per point (see the module docstring)."""
    return [
        f"{_point(row)}: preprocess {ratios(row)['preprocess']:.2f}× verl's speed (stretch target ≥ "
        f"{STRETCH_B1_PREPROCESS}×)"
        for row in rows
        if row["batch_size"] == 1 and ratios(row)["preprocess"] < STRETCH_B1_PREPROCESS
    ]
