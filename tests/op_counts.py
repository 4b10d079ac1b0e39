"""Reading ATen op counts for the "flat in B" contract.

The one data-dependent op: a pack with no position to zero (no padding, no missing target) skips its
``index_fill_``. It is checked as "at most once per pack"; every other op is compared exactly.
"""

SKIPPABLE_FILL = "aten.index_fill_"


def ops_without_fills(ops: dict[str, int], packs: int) -> dict[str, int]:
    """``ops`` without ``index_fill_``, after checking it ran at most once per pack (``packs`` of them)."""
    assert ops.get(SKIPPABLE_FILL, 0) <= packs, (ops.get(SKIPPABLE_FILL), packs)
    return {op: count for op, count in ops.items() if op != SKIPPABLE_FILL}
