"""The release matrix's side-by-side comparison: the library's own (``verl_cppack.integrations.verl.release_check``
on ``compare``), the one that behaviour verification and ``verl-cppack doctor --verify`` use too."""

from verl_cppack.integrations.verl.compare import Finding, difference_key, intended_keys
from verl_cppack.integrations.verl.release_check import (
    PAIRS,
    H,
    SideBySide,
    compare_release,
    random_batch,
    to_nested,
)

__all__ = [
    "H",
    "PAIRS",
    "Finding",
    "SideBySide",
    "compare_release",
    "difference_key",
    "intended_keys",
    "random_batch",
    "to_nested",
]
