"""Run outputs: a fresh output directory (never clobber earlier results), metrics.jsonl, reward curve, summary."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO


def fresh_output_dir(requested: str | Path) -> Path:
    """``requested`` if it is missing or empty, else a new ``requested/run-YYYYmmdd-HHMMSS[-k]`` inside it."""
    requested = Path(requested)
    if requested.exists() and not requested.is_dir():
        raise ValueError(f"output path {requested} exists and is not a directory; pass --output DIR")
    try:
        if not requested.exists() or not any(requested.iterdir()):
            requested.mkdir(parents=True, exist_ok=True)
            return requested
    except OSError as error:
        raise ValueError(
            f"cannot create or read the output directory {requested}: {error}; pass --output DIR"
        ) from error
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in range(1000):
        candidate = requested / (f"run-{stamp}" if attempt == 0 else f"run-{stamp}-{attempt}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        except OSError as error:
            raise ValueError(f"cannot create {candidate}: {error}; pass --output DIR") from error
        return candidate
    raise RuntimeError(f"could not create a fresh run directory under {requested}")


class MetricsWriter:
    """Appends one JSON object per line and flushes it, so a crashed run keeps every finished step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        bad = [name for name, value in record.items() if isinstance(value, float) and not math.isfinite(value)]
        if bad:
            raise ValueError(f"metrics {bad} are not finite at step {record.get('step')}: {record}")
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def fifth_means(values: Sequence[float]) -> tuple[float, float]:
    """Mean of the first and of the last fifth (at least one value each) of ``values``."""
    if not values:
        raise ValueError("no values: the run has no finished step")
    width = max(1, len(values) // 5)
    return sum(values[:width]) / width, sum(values[-width:]) / width


@dataclass(frozen=True)
class Panel:
    """One metric of ``metrics.jsonl`` drawn against the step."""

    key: str
    label: str
    color: str
    ylim: tuple[float, float] | None = None
    log_scale: bool = False


def plot_panels(records: Sequence[dict[str, Any]], path: Path, title: str, panels: Sequence[Panel]) -> str | None:
    """Stacked per-step curves as a PNG; returns None on success or a note why it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed (pip install matplotlib); {path.name} skipped"
    steps = [record["step"] for record in records]
    figure, axes = plt.subplots(len(panels), 1, figsize=(6, 2.5 * len(panels)), sharex=True, squeeze=False)
    for axis, panel in zip(axes[:, 0], panels):
        axis.plot(steps, [record[panel.key] for record in records], color=panel.color)
        axis.set_ylabel(panel.label)
        if panel.log_scale:
            axis.set_yscale("log")
        if panel.ylim is not None:
            axis.set_ylim(*panel.ylim)
        axis.grid(alpha=0.3)
    axes[0, 0].set_title(f"{title} (CP={records[0].get('cp', '?')})")
    axes[-1, 0].set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return None
