"""Where one small micro-batch's packing time goes: the drop-ins' unit split into its parts, next to verl's calls.

The bench's unit (three ``preprocess_packed_seqs`` calls, two ``postprocess_packed_seqs`` calls) on a new rollout
batch every micro-batch (as in training), in one process per CP rank (``runtime.gloo_world``), glibc keeping freed
memory as the bench does. The first preprocess call is split into what it does: the argument checks and the
parallel context read from megatron, the plan (mask scan, per-sequence tables, the cache's copy of the mask), the
``PackedSeqParams``, and the first copy (its index built on the host, then ``index_select``); the first
postprocess call builds the copy back's index, the second reuses it. Times are rank 0's medians in microseconds.
Then each implementation's first preprocess call on a new mask is timed right after a barrier, back to back, and after
2 ms asleep with nothing else run; last, a fixed pure-Python loop the same three ways: what this machine does to
whatever runs first after a wait (every timed part here and in the bench starts after a barrier).

Usage: ``python benchmarks/profile_small_batch.py [--batch-size 1] [--seq-len 8192] [--cp 1] [--repeats 200]``.
It prints a table and asserts nothing (this is not a test).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from verl_cppack.bench.batches import micro_batch
from verl_cppack.bench.host_allocator import keep_freed_memory
from verl_cppack.bench.settings import parse_point
from verl_cppack.runtime.gloo_world import run_world

PARTS = (
    "checks + parallel context",
    "plan (scan, tables, cache copy)",
    "PackedSeqParams",
    "first copy (index + index_select)",
    "preprocess, 2nd and 3rd call",
    "postprocess, 1st call (builds its index)",
    "postprocess, 2nd call",
)


def _rank(rank: int, cp_size: int, settings: tuple[int, int, int]) -> dict[str, list[float]]:
    batch_size, seq_len, repeats = settings
    keep_freed_memory()
    from megatron.core import parallel_state
    from verl.models.mcore import util as verl_util

    from verl_cppack.core.alignment import Alignment
    from verl_cppack.core.checks import require_mask
    from verl_cppack.integrations.megatron import megatron_context
    from verl_cppack.integrations.verl import dropins

    parallel_state.initialize_model_parallel(context_parallel_size=cp_size)
    ours: list[list[float]] = []
    verl: list[list[float]] = []
    try:
        for index in range(repeats + 20):
            batch = micro_batch(batch_size, seq_len, seed=index)
            mask = batch.attention_mask
            dist.barrier()
            clock = [time.perf_counter_ns()]
            ctx = megatron_context()
            checked = require_mask("attention_mask", mask)
            clock.append(time.perf_counter_ns())
            plan, snapshot = dropins._mask_entry(checked, ctx, Alignment.per_slot(ctx.default_slot_multiple))
            clock.append(time.perf_counter_ns())
            params = dropins._packed_seq_params(plan, snapshot)
            clock.append(time.perf_counter_ns())
            packed = plan.pack(batch.input_ids)
            clock.append(time.perf_counter_ns())
            dropins.preprocess_packed_seqs(batch.labels, mask)
            dropins.preprocess_packed_seqs(batch.label_mask, mask)
            clock.append(time.perf_counter_ns())
            log_probs = packed.float()
            dist.barrier()
            clock.append(time.perf_counter_ns())
            dropins.postprocess_packed_seqs(log_probs, params, mask, batch_size, seq_len)
            clock.append(time.perf_counter_ns())
            dropins.postprocess_packed_seqs(log_probs, params, mask, batch_size, seq_len)
            clock.append(time.perf_counter_ns())
            parts = [clock[k + 1] - clock[k] for k in range(5)] + [clock[7] - clock[6], clock[8] - clock[7]]

            batch = micro_batch(batch_size, seq_len, seed=index)  # verl's calls on a batch of its own
            dist.barrier()
            begin = time.perf_counter_ns()
            packed, params = verl_util.preprocess_packed_seqs(batch.input_ids, batch.attention_mask)
            verl_util.preprocess_packed_seqs(batch.labels, batch.attention_mask)
            verl_util.preprocess_packed_seqs(batch.label_mask, batch.attention_mask)
            middle = time.perf_counter_ns()
            log_probs = packed.float()
            dist.barrier()
            start = time.perf_counter_ns()
            for _ in range(2):
                verl_util.postprocess_packed_seqs(log_probs, params, batch.attention_mask, batch_size, seq_len)
            end = time.perf_counter_ns()
            if index >= 20:
                ours.append([part / 1e3 for part in parts])
                verl.append([(middle - begin) / 1e3, (end - start) / 1e3])
        return {
            "ours": [statistics.median(p) for p in zip(*ours)],
            "verl": [statistics.median(p) for p in zip(*verl)],
            "probe": _idle_probe(),
            "first_calls": _first_calls_after_a_wait(
                {"verl": verl_util, "verl_cppack": dropins}, batch_size, seq_len, repeats
            ),
        }
    finally:
        parallel_state.destroy_model_parallel()


def _python_work() -> int:
    total = 0
    for value in range(3000):
        total += value
    return total


def _idle_probe(repeats: int = 200) -> list[float]:
    """The same pure-Python loop timed back to back, straight after a barrier, and after 2 ms asleep (medians, us):
    how much slower this machine runs whatever comes first after a wait."""
    timings: list[list[float]] = [[], [], []]
    for _ in range(repeats):
        for case, timing in enumerate(timings):
            if case == 0:
                _python_work()
            else:
                dist.barrier()
                if case == 2:
                    time.sleep(0.002)
            begin = time.perf_counter_ns()
            _python_work()
            timing.append((time.perf_counter_ns() - begin) / 1e3)
    return [statistics.median(timing) for timing in timings]


def _first_calls_after_a_wait(modules: dict, batch_size: int, seq_len: int, repeats: int) -> dict[str, list[float]]:
    """One first ``preprocess_packed_seqs`` call on a new mask, per implementation: right after a barrier, right after
    another such call (back to back), and after 2 ms asleep with nothing else run (medians, us). Sleeping alone
    separates what the machine does after a wait from what other work in between does to the caches."""
    timings: dict[str, list[list[float]]] = {name: [[], [], []] for name in modules}
    for index in range(repeats + 10):
        for name, module in modules.items():
            batches = [micro_batch(batch_size, seq_len, seed=10_000 * case + index) for case in (1, 2, 3)]
            for case, batch in enumerate(batches):
                if case == 0:
                    dist.barrier()
                elif case == 2:
                    time.sleep(0.002)
                begin = time.perf_counter_ns()
                module.preprocess_packed_seqs(batch.input_ids, batch.attention_mask)
                if index >= 10:
                    timings[name][case].append((time.perf_counter_ns() - begin) / 1e3)
    return {name: [statistics.median(timing) for timing in cases] for name, cases in timings.items()}


def main() -> None:
    args = parse_point(__doc__.splitlines()[0], cp=1, repeats=200)
    torch.set_num_threads(1)
    result = run_world(_rank, args.cp, (args.batch_size, args.seq_len, args.repeats), torch_threads=1)[0]
    ours, verl = result["ours"], result["verl"]
    print(f"B={args.batch_size} S={args.seq_len} CP={args.cp}: medians of {args.repeats} micro-batches, microseconds")
    for name, value in zip(PARTS, ours):
        print(f"  {name:42s} {value:8.1f}")
    print(f"  {'verl_cppack preprocess (3 calls)':42s} {sum(ours[:5]):8.1f}   verl {verl[0]:8.1f}")
    print(f"  {'verl_cppack postprocess (2 calls)':42s} {sum(ours[5:]):8.1f}   verl {verl[1]:8.1f}")
    for name, (after_barrier, back_to_back, after_sleep) in result["first_calls"].items():
        print(
            f"  {name}'s first preprocess call on a new mask: {after_barrier:.1f} right after a barrier, "
            f"{back_to_back:.1f} back to back, {after_sleep:.1f} after 2 ms asleep"
        )
    warm, after_barrier, after_sleep = result["probe"]
    print(
        f"  a fixed pure-Python loop: {warm:.1f} back to back, {after_barrier:.1f} right after a barrier, "
        f"{after_sleep:.1f} after 2 ms asleep"
    )


if __name__ == "__main__":
    main()
