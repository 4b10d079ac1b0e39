"""verl_cppack: exact, loop-free sequence packing (THD) and context-parallel slicing for verl on Megatron."""

from verl_cppack.collectives.gather import all_gather_rank_major
from verl_cppack.context import ParallelContext
from verl_cppack.core.alignment import Alignment
from verl_cppack.core.layouts import Layout, get_layout, zigzag_indices
from verl_cppack.packing.plan import PackPlan, plan_from_lengths, plan_from_mask, plan_from_nested

__version__ = "0.1.0"

__all__ = [
    "Alignment",
    "Layout",
    "PackPlan",
    "ParallelContext",
    "all_gather_rank_major",
    "get_layout",
    "plan_from_lengths",
    "plan_from_mask",
    "plan_from_nested",
    "zigzag_indices",
]
