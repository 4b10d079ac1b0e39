"""Slow, obviously-correct pure-Python references for the packing core (no torch index math)."""

from __future__ import annotations

import math


def padded_lengths(
    lengths: list[int], slot_multiple: int, stream_multiple: int, min_stream_length: int = 0
) -> list[int]:
    """Every slot up to a multiple of slot_multiple, then the last slot extended to the stream target."""
    padded = [math.ceil(n / slot_multiple) * slot_multiple for n in lengths]
    total = sum(padded)
    target = max(math.ceil(total / stream_multiple), math.ceil(min_stream_length / stream_multiple)) * stream_multiple
    padded[-1] += target - total
    return padded


def offsets(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def te_partitioned_indices(cu_seqlens_padded: list[int], total_tokens: int, world_size: int, rank: int) -> list[int]:
    """Per-token port of Transformer Engine's ``thd_partition_indices_kernel`` (binary search included)."""
    batch = len(cu_seqlens_padded) - 1
    cu_local = []
    for value in cu_seqlens_padded:
        assert value % (world_size * 2) == 0
        cu_local.append(value // world_size)

    def binary_search(target: int, array: list[int], length: int) -> int:
        left, right = 1, length - 1
        while left < right:
            mid = (left + right) // 2
            if array[mid] <= target:
                left = mid + 1
            else:
                right = mid
        return left - 1

    output = []
    for token_id in range(total_tokens // world_size):
        seq_id = binary_search(token_id, cu_local, batch + 1)
        seq_len = cu_local[seq_id + 1] - cu_local[seq_id]
        index = token_id - cu_local[seq_id]
        offset = rank if index < seq_len // 2 else (world_size - 1) * 2 - rank
        index += cu_local[seq_id] * world_size + seq_len // 2 * offset
        output.append(index)
    return output


def local_indices(layout: str, cu_seqlens_padded: list[int], cp_size: int, rank: int) -> list[int]:
    total = cu_seqlens_padded[-1]
    if cp_size == 1:
        return list(range(total))
    if layout == "zigzag":
        return te_partitioned_indices(cu_seqlens_padded, total, cp_size, rank)
    local = total // cp_size
    return list(range(rank * local, (rank + 1) * local))


def stream_of_rows(mask: list[list[int]], padded: list[int]) -> list[tuple[int, int] | None]:
    """The padded stream as (row, column) of the source token, or None for padding."""
    stream: list[tuple[int, int] | None] = []
    for row, slot_length in zip(range(len(mask)), padded):
        tokens = [(row, column) for column, value in enumerate(mask[row]) if value]
        stream.extend(tokens + [None] * (slot_length - len(tokens)))
    return stream
