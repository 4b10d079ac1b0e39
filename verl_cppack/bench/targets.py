"""The performance targets ``verl-cppack bench --strict`` checks, as functions over the bench's rows (one (B, S, CP)
point each, ``measure.py``; times are medians); docs/performance.md tabulates them and says why. Every speed target
is met within the noise of the run: a ratio ``r`` meets ``t`` when ``r * (1 + noise) >= t``, the noise being the
relative interquartile range of verl's own timed calls at that point (``ratios.spread``, the median over runs).

- B=1 (and every VLM mask builder call): never slower than verl (``t = 1``);
- from B=16: preprocess ``t = 2`` and postprocess ``t = 1.5``, or the floor's own ratio where it is lower (``floors.py``);
- B=256: the preprocess per sequence (its time less B=1's at that S and CP, the floor's likewise) at least 50% of the
  copies-only floor's speed (the whole time where the run has no B=1 point); at every point ≤ 1 host sync, the same
  ATen op count for every B, peak extra memory ≤ 1.5× verl's (``counters.OpCounter``); VLM builders ≤ 1 host sync.

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


def _short_of(speed: float, target: float, spread: float) -> bool:
    """Whether ``speed`` (verl's time over ours) falls short of ``target`` by more than the run's noise ``spread``."""
    return speed * (1 + spread) < target


def _beyond_noise(speed: float, spread: float) -> str | None:
    """The miss of "never slower than verl beyond the noise" at ``speed``, else None."""
    why = f"slower than verl by more than its own spread in this run ({spread:.0%}; target: within the noise)"
    return f"{speed:.2f}× verl's speed, {why}" if _short_of(speed, 1.0, spread) else None


def postprocess_target(row: dict[str, Any]) -> float:
    """The postprocess speed asked for from B=16: 1.5× verl's, or the floor's own ratio where it is lower."""
    return min(POSTPROCESS_FROM_B, ratios(row)["postprocess_floor"])


def per_sequence_share(row: dict[str, Any], one: dict[str, Any] | None) -> float:
    """The copies-only floor's preprocess time over ours, each less its time at B=1 of the same S and CP (``one``;
    the whole times without it): what the copies cost per sequence against what we do per sequence."""
    ours, floor = row["verl_cppack"]["preprocess_ms"], row["floor"]["preprocess_ms"]
    if one is not None:
        ours, floor = ours - one["verl_cppack"]["preprocess_ms"], floor - one["floor"]["preprocess_ms"]
    return floor / ours if ours > 0 else float("inf")


def _speed_targets(row: dict[str, Any], one: dict[str, Any] | None) -> list[str]:
    r, point, batch_size = ratios(row), _point(row), row["batch_size"]
    missed = []
    if batch_size == 1:
        missed += [
            f"{point}: {stage} {slower}" for stage in STAGES if (slower := _beyond_noise(r[stage], noise(row, stage)))
        ]
    if batch_size >= FROM_B:
        for stage, target in (("preprocess", PREPROCESS_FROM_B), ("postprocess", postprocess_target(row))):
            if _short_of(r[stage], target, noise(row, stage)):
                floor = "" if target == POSTPROCESS_FROM_B or stage == "preprocess" else ": the floor's ratio"
                missed.append(
                    f"{point}: {stage} {r[stage]:.2f}× verl's speed (target ≥ {target:.3g}×{floor} within verl's "
                    f"spread {noise(row, stage):.0%})"
                )
    if batch_size == LARGE_B and (share := per_sequence_share(row, one)) < SHARE_OF_COPIES_ONLY:
        missed.append(
            f"{point}: preprocess per sequence at {share:.0%} of the copies-only floor's speed (whole: "
            f"{r['preprocess_of_floor']:.0%}; target ≥ {SHARE_OF_COPIES_ONLY:.0%})"
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
    at_b1 = {(row["seq_len"], row["cp_size"]): row for row in rows if row["batch_size"] == 1}
    missed = []
    for row in rows:
        missed += _speed_targets(row, at_b1.get((row["seq_len"], row["cp_size"]))) + _cost_targets(row)
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
