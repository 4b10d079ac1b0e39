"""The derived figures of one bench row (speed-ups against verl, distance to the floor) and their formatting."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any


def ratios(row: dict[str, Any]) -> dict[str, float]:
    """``preprocess`` / ``postprocess`` / ``step``: verl's time over verl_cppack's (above 1: faster than verl);
    ``preprocess_floor`` / ``postprocess_floor``: verl's time over the floor's; ``preprocess_of_floor``: the floor's
    over verl_cppack's (1: at the floor); ``postprocess_above_floor_ms``: our postprocess minus the floor's."""
    verl, ours, floor = row["verl"], row["verl_cppack"], row["floor"]
    return {
        "preprocess": verl["preprocess_ms"] / ours["preprocess_ms"],
        "postprocess": verl["postprocess_ms"] / ours["postprocess_ms"],
        "step": verl["step_ms"] / ours["step_ms"],
        "preprocess_floor": verl["preprocess_ms"] / floor["preprocess_ms"],
        "postprocess_floor": verl["postprocess_ms"] / floor["postprocess_ms"],
        "preprocess_of_floor": floor["preprocess_ms"] / ours["preprocess_ms"],
        "postprocess_above_floor_ms": ours["postprocess_ms"] - floor["postprocess_ms"],
    }


def spread(times: list[float]) -> float:
    """The relative interquartile range of one contender's timed calls at a point, ``(P75 - P25) / P50``
    (``statistics.quantiles``, exclusive method; 0 with fewer than two): how much its own times scatter in a run."""
    if len(times) < 2:
        return 0.0
    low, middle, high = statistics.quantiles(times, n=4)
    return (high - low) / middle


def span(values: list[float], digits: int = 1) -> str:
    """``low–high`` of ``values`` at ``digits`` decimals (one figure where they round alike)."""
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}–{high}"


def table(header: str, lines: Iterable[str]) -> str:
    """A markdown table: ``header`` (``| a | b |``), its rule, then ``lines``."""
    return "\n".join([header, "|" + "---|" * (header.count("|") - 1), *lines])
