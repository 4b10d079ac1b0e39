"""The performance targets ``verl-cppack bench --strict`` checks, as one function over the bench's rows.

Each row is one (B, S, CP) point (``measure.py``); times are medians. The targets, per micro-batch (the bench's
unit: one preprocess of ids, labels and label mask, one postprocess of log-probs and entropy):

- B=1: preprocess >= 2x verl's speed and postprocess >= 1.3x, at every S and CP (never slower than verl);
- B >= 4: preprocess >= 3x verl's speed; postprocess within 0.3 ms of its floor (all-gathers plus one copy);
- B=256: preprocess >= 70% of the copies-only ratio (the floor's time over ours >= 0.7);
- at most 24 ATen ops and at most 1 host sync, and the same op count for every B at each S and CP;
- peak extra memory no more than verl's;
- VLM mask builders (CP=1 rows): at most 1 host sync per call, never slower than verl's.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from verl_cppack.bench.ratios import ratios

SMALL_B_PREPROCESS = 2.0
SMALL_B_POSTPROCESS = 1.3
PREPROCESS_FROM_B4 = 3.0
POSTPROCESS_ABOVE_FLOOR_MS = 0.3
LARGE_B = 256
SHARE_OF_COPIES_ONLY = 0.7
MAX_ATEN_OPS = 24
MAX_HOST_SYNCS = 1


def _point(row: dict[str, Any]) -> str:
    return f"B={row['batch_size']} S={row['seq_len']} CP={row['cp_size']}"


def _speed_targets(row: dict[str, Any]) -> list[str]:
    r, point, batch_size = ratios(row), _point(row), row["batch_size"]
    missed = []
    if batch_size == 1:
        if r["preprocess"] < SMALL_B_PREPROCESS:
            missed.append(f"{point}: preprocess {r['preprocess']:.2f}× verl's speed (target ≥ {SMALL_B_PREPROCESS}×)")
        if r["postprocess"] < SMALL_B_POSTPROCESS:
            missed.append(
                f"{point}: postprocess {r['postprocess']:.2f}× verl's speed (target ≥ {SMALL_B_POSTPROCESS}×)"
            )
    if batch_size >= 4:
        if r["preprocess"] < PREPROCESS_FROM_B4:
            missed.append(f"{point}: preprocess {r['preprocess']:.2f}× verl's speed (target ≥ {PREPROCESS_FROM_B4}×)")
        if r["postprocess_above_floor_ms"] > POSTPROCESS_ABOVE_FLOOR_MS:
            missed.append(
                f"{point}: postprocess {r['postprocess_above_floor_ms']:.2f} ms above its floor "
                f"(all-gathers plus one copy: {row['floor']['postprocess_ms']:.2f} ms; target ≤ {POSTPROCESS_ABOVE_FLOOR_MS} ms)"
            )
    if batch_size == LARGE_B and r["preprocess_of_floor"] < SHARE_OF_COPIES_ONLY:
        missed.append(
            f"{point}: preprocess {r['preprocess']:.1f}× verl's speed is {r['preprocess_of_floor']:.0%} of the "
            f"copies-only {r['preprocess_floor']:.1f}× (target ≥ {SHARE_OF_COPIES_ONLY:.0%})"
        )
    return missed


def _cost_targets(row: dict[str, Any]) -> list[str]:
    ours, verl, point = row["verl_cppack"], row["verl"], _point(row)
    missed = []
    if ours["aten_ops"] > MAX_ATEN_OPS:
        missed.append(f"{point}: {ours['aten_ops']} ATen ops per micro-batch (target ≤ {MAX_ATEN_OPS})")
    if ours["host_syncs"] > MAX_HOST_SYNCS:
        missed.append(f"{point}: {ours['host_syncs']} host syncs per micro-batch (target ≤ {MAX_HOST_SYNCS})")
    if ours["peak_extra_mb"] > verl["peak_extra_mb"]:
        missed.append(
            f"{point}: peak extra memory {ours['peak_extra_mb']:.3g} MB, verl's {verl['peak_extra_mb']:.3g} MB "
            "(target: no more than verl's)"
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
        if ours["ms"] > verl["ms"]:
            missed.append(f"{point}: {verl['ms'] / ours['ms']:.2f}× verl's speed (target: never slower)")
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
