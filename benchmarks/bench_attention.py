"""Tiny-GPT forward+backward on CPU: what packing saves, and ring vs all-gather CP attention.

1. Packed THD vs padded BSHD on the same rollout-like batch (CP=1): the padded run computes every
   padding position; the packed run only the valid tokens (plus slot alignment).
2. Ring vs all-gather K/V attention at CP=2 (two gloo processes), same batch, same weights.

Prints medians and ratios; asserts nothing (timings depend on the machine). Usage:
    python benchmarks/bench_attention.py [--batch-size 8] [--seq-len 256] [--repeats 5] [--threads 1]

The attention here is verl_cppack's CPU reference (torch SDPA per slot for all-gather / CP=1, an einsum
kernel with log-sum-exp for the ring blocks), not TE's fused kernels: the ratios show what the schedule
and the packing cost on CPU, not GPU speed.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from verl_cppack.bench.batches import rollout_batch
from verl_cppack.runtime.gloo_world import run_world

VOCAB = 512


def timed_interleaved(steps: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each step, the steps run in turn so that machine load hits them alike."""
    for step in steps.values():
        step()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _packed_step(model, plan, input_ids):
    from verl_cppack.integrations.megatron import packed_seq_params

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(
            input_ids=plan.pack(input_ids),
            position_ids=None,
            attention_mask=None,
            packed_seq_params=packed_seq_params(plan),
        )  # [1, T_local, V]
        plan.unpack(logits).float().square().mean().backward()

    return step


def _padded_step(model, input_ids, mask):
    positions = torch.arange(input_ids.shape[1]).expand(input_ids.shape[0], -1)

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=input_ids, position_ids=positions, attention_mask=None)  # [B, S, V]
        (logits.float().square() * mask.unsqueeze(-1)).mean().backward()

    return step


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    from verl_cppack.packing.builders import plan_from_mask
    from verl_cppack.runtime.tiny_gpt import build_tiny_gpt, init_megatron_parallel

    ctx = init_megatron_parallel(cp_size=world_size)
    input_ids, mask = rollout_batch(args.batch_size, args.seq_len, vocab_size=VOCAB)
    plan = plan_from_mask(mask, ctx)

    def model(attention):
        return build_tiny_gpt(
            vocab_size=VOCAB,
            hidden_size=128,
            num_layers=2,
            num_attention_heads=4,
            num_query_groups=2,
            max_sequence_length=args.seq_len,
            attention=attention,
        )

    if world_size == 1:
        gpt = model("allgather")
        steps = {"padded": _padded_step(gpt, input_ids, mask), "packed": _packed_step(gpt, plan, input_ids)}
    else:
        steps = {name: _packed_step(model(name), plan, input_ids) for name in ("allgather", "ring")}
    report = timed_interleaved(steps, args.repeats)
    report["packed_positions"] = plan.total_length
    return report


def run_at(world_size: int, args: argparse.Namespace) -> dict:
    """Rank 0's report (all ranks wait for each other per step)."""
    return run_world(_rank, world_size, args, torch_threads=args.threads)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per process (1 is steadiest on a busy box)"
    )
    args = parser.parse_args()
    _, mask = rollout_batch(args.batch_size, args.seq_len, vocab_size=VOCAB)
    print(f"batch {args.batch_size} x {args.seq_len}: {int(mask.sum())} valid tokens of {mask.numel()}")

    single = run_at(1, args)
    print(f"CP=1 padded BSHD fwd+bwd : {single['padded'] * 1e3:8.1f} ms  ({mask.numel()} positions)")
    print(f"CP=1 packed THD  fwd+bwd : {single['packed'] * 1e3:8.1f} ms  ({single['packed_positions']} positions)")
    print(f"  padded / packed        : {single['padded'] / single['packed']:8.2f}x")

    double = run_at(2, args)
    print(f"CP=2 all-gather K/V      : {double['allgather'] * 1e3:8.1f} ms  (rank 0)")
    print(f"CP=2 zigzag ring         : {double['ring'] * 1e3:8.1f} ms  (rank 0)")
    print(f"  ring / all-gather      : {double['ring'] / double['allgather']:8.2f}x")


if __name__ == "__main__":
    main()
