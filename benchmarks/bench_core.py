"""plan + pack + unpack vs a straightforward per-sequence loop, same inputs, same process; prints ratios.

Both sides skip the all-gather (the loop gets every rank's local tensor; ours uses ``PackPlan.restore``),
so the comparison is the index work alone. Usage: python benchmarks/bench_core.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from verl_cppack import ParallelContext, plan_from_mask


def rollout_mask(batch_size: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """Left-padded prompts (first half) and right-padded responses (second half) of random lengths."""
    generator = torch.Generator().manual_seed(seed)
    half = seq_len // 2
    prompt = torch.randint(1, half + 1, (batch_size, 1), generator=generator)
    response = torch.randint(1, half + 1, (batch_size, 1), generator=generator)
    columns = torch.arange(seq_len)
    return ((columns >= half - prompt) & (columns < half)) | ((columns >= half) & (columns < half + response))


def loop_pack(x: torch.Tensor, mask: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    align = 2 * cp_size if cp_size > 1 else 1
    seqlens = mask.sum(1).tolist()
    padded = [math.ceil(n / align) * align for n in seqlens]
    out = torch.zeros(sum(padded) // cp_size, *x.shape[2:], dtype=x.dtype)
    start = 0
    for i, (n, p) in enumerate(zip(seqlens, padded)):
        full = torch.zeros(p, *x.shape[2:], dtype=x.dtype)
        full[:n] = x[i][mask[i]]
        chunk = p // (2 * cp_size) if cp_size > 1 else p
        if cp_size == 1:
            out[start : start + p] = full
        else:
            out[start : start + chunk] = full[cp_rank * chunk : (cp_rank + 1) * chunk]
            back = (2 * cp_size - 1 - cp_rank) * chunk
            out[start + chunk : start + 2 * chunk] = full[back : back + chunk]
        start += p // cp_size
    return out.unsqueeze(0)


def loop_unpack(local_outputs: list[torch.Tensor], mask: torch.Tensor, cp_size: int) -> torch.Tensor:
    align = 2 * cp_size if cp_size > 1 else 1
    seqlens = mask.sum(1).tolist()
    out = torch.zeros(*mask.shape, *local_outputs[0].shape[2:], dtype=local_outputs[0].dtype)
    start = 0
    for i, n in enumerate(seqlens):
        p = math.ceil(n / align) * align
        local_len = p // cp_size
        if cp_size == 1:
            full = local_outputs[0][0, start : start + p]
        else:
            chunk = local_len // 2
            full = torch.empty(p, *out.shape[2:], dtype=out.dtype)
            for rank, local in enumerate(local_outputs):
                full[rank * chunk : (rank + 1) * chunk] = local[0, start : start + chunk]
                back = (2 * cp_size - 1 - rank) * chunk
                full[back : back + chunk] = local[0, start + chunk : start + 2 * chunk]
        out[i, mask[i]] = full[:n]
        start += local_len
    return out


def median_seconds(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat (CI smoke run)")
    args = parser.parse_args()
    batch_sizes = (16, 64) if args.quick else (16, 256, 1024)
    seq_len, repeats = (256, 1) if args.quick else (1024, 5)
    torch.set_num_threads(1)
    print(f"plan+pack+unpack, S={seq_len}, 1 thread, median of {repeats}; ratio = loop / verl_cppack")
    print(f"{'B':>6} {'CP':>3} {'loop ms':>10} {'ours ms':>10} {'ratio':>8}")
    for cp_size in (1, 2):
        for batch_size in batch_sizes:
            mask = rollout_mask(batch_size, seq_len)
            x = torch.randint(0, 50_000, mask.shape)
            plans = [plan_from_mask(mask, ParallelContext(cp_size=cp_size, cp_rank=r)) for r in range(cp_size)]
            local_outputs = [plan.pack(x).float() for plan in plans]

            def ours():
                plan = plan_from_mask(mask, ParallelContext(cp_size=cp_size, cp_rank=0))
                plan.pack(x)
                plan.restore(local_outputs)

            def loop():
                loop_pack(x, mask, cp_size, 0)
                loop_unpack(local_outputs, mask, cp_size)

            assert torch.equal(loop_pack(x, mask, cp_size, 0), plans[0].pack(x))
            assert torch.equal(loop_unpack(local_outputs, mask, cp_size), plans[0].restore(local_outputs))
            loop_s, ours_s = median_seconds(loop, repeats), median_seconds(ours, repeats)
            print(f"{batch_size:>6} {cp_size:>3} {loop_s * 1e3:>10.2f} {ours_s * 1e3:>10.2f} {loop_s / ours_s:>7.1f}x")


if __name__ == "__main__":
    main()
