"""Reading ATen op counts for the "flat in B" contract.

The one data-dependent op: a block copy (a pack, or an unpack's copy back) with no position to zero (no
padding, no missing target, no gap) skips its ``index_fill_``. It is checked as "at most once per copy"; every
other op is compared exactly. Check in the test process, not inside a gloo rank (a rank that fails early
would leave the others waiting in a collective).
"""

SKIPPABLE_FILL = "aten.index_fill_"


def ops_without_fills(ops: dict[str, int], copies: int) -> dict[str, int]:
    """``ops`` without ``index_fill_``, after checking it ran at most once per block copy (``copies`` of them)."""
    assert ops.get(SKIPPABLE_FILL, 0) <= copies, (ops.get(SKIPPABLE_FILL), copies)
    return {op: count for op, count in ops.items() if op != SKIPPABLE_FILL}
