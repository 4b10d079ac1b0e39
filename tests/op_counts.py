"""Reading ATen op counts for the "flat in B" contract, leniently.

A plan's copies dispatch the same ops for every batch of one padding policy (a copy zeroes its padding wherever the
policy can pad, with nothing to zero or not: ``tests/test_core_cost.py`` and ``tests/test_verl_cost.py`` compare
every op exactly). This reader is for callers whose plans are of several policies: fills are checked as "at most
once per copy"; host tables are not compared (each is one per plan table, never per sequence); every other op is
compared exactly. Check in the test process, not inside a gloo rank (a rank that fails early would leave the others
waiting in a collective).
"""

FILL, HOST_TABLE = "aten.index_fill_", "aten.lift_fresh"


def ops_without_fills(ops: dict[str, int], copies: int) -> dict[str, int]:
    """``ops`` without the zeroing of a copy and the host tables, after checking the fills ran at most once per
    copy (``copies`` of them) and the tables are at most the copies' indices plus five: the padded offsets, the
    real ones (a jagged output's), a copy's positions to zero, the valid-token flags and the position ids."""
    assert ops.get(FILL, 0) <= copies, (ops.get(FILL), copies)
    assert ops.get(HOST_TABLE, 0) <= copies + 5, (ops.get(HOST_TABLE), copies)
    return {op: count for op, count in ops.items() if op not in (FILL, HOST_TABLE)}
