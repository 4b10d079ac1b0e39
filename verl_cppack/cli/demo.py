"""``verl-cppack demo``: the worked example of docs/design.md, packed and cut for every CP rank."""

from __future__ import annotations

import argparse

from verl_cppack.cli import add_command, error
from verl_cppack.context import ParallelContext
from verl_cppack.packing.builders import plan_from_lengths

# Documents of the worked example: row0 = [a b c E d e E _] -> "abcE", "deE"; row1 = [f g h i j E _ _] -> "fghijE".
WORKED_EXAMPLE_DOCUMENTS = (("a", "b", "c", "E"), ("d", "e", "E"), ("f", "g", "h", "i", "j", "E"))


def describe(cp_size: int, layout: str, tp_size: int = 1) -> list[str]:
    lengths = [len(doc) for doc in WORKED_EXAMPLE_DOCUMENTS]
    tokens = [token for doc in WORKED_EXAMPLE_DOCUMENTS for token in doc]
    lines = []
    for rank in range(cp_size):
        plan = plan_from_lengths(
            lengths, ParallelContext(tp_size=tp_size, cp_size=cp_size, cp_rank=rank), layout=layout
        )
        stream = [tokens[source] if source < plan.source_rows else "P" for source in plan.stream_source.tolist()]
        if rank == 0:
            lines += [
                f"layout={layout} cp={cp_size} tp={tp_size}",
                f"  cu_seqlens        = {plan.cu_seqlens.tolist()}",
                f"  cu_seqlens_padded = {plan.cu_seqlens_padded.tolist()}  "
                f"max_seqlen_padded = {plan.max_seqlen_padded}",
                f"  packed stream     = {' '.join(stream)}",
            ]
        local_tokens = [stream[position] for position in plan.local_index.tolist()]
        lines.append(
            f"  rank {rank}: index {plan.local_index.tolist()} -> {' '.join(local_tokens)} "
            f"({int(plan.local_valid_mask.sum())} valid)"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--cp", args.cp), ("--tp", args.tp)):
        if value < 1:
            return error(f"{flag} must be >= 1, got {value}")
    for cp_size, layout in ((1, "zigzag"), (args.cp, "zigzag"), (args.cp, "contiguous")):
        print("\n".join(describe(cp_size, layout, args.tp)))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "demo", "print the worked example's packed layout per CP rank", __doc__, run)
    parser.add_argument("--cp", type=int, default=2, help="context-parallel size (default 2)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
