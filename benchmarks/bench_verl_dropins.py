"""Benchmark: verl_cppack's drop-ins against verl 0.9.1's own util functions, in the same run.

CP=2 runs as two real gloo processes on this machine (both implementations pay the same all-gather);
rank 0 reports. For each batch size (S=2048 rollout batches: left-padded prompts, right-padded responses):

- ``preprocess_packed_seqs`` (input ids) and ``postprocess_packed_seqs`` (a ``[1, T/2]`` float output,
  e.g. per-token log-probs), and the nested engine pair ``preprocess_thd_engine`` / ``postprocess_thd_engine``;
- one whole micro-batch as verl's ``model_forward`` does it: pack input ids, labels and the label mask,
  gather back log-probs and entropy (``step``: 3 preprocess + 2 postprocess calls);
- wall time (median of ``--repeats``; our plan cache is cleared before every timed preprocess and step,
  so each pays its plan), ATen op count, and device->host syncs (``verl_cppack.bench.counters``:
  ``Tensor.tolist`` calls plus ops that sync on a GPU: ``.item()``/``bool(t)``, ``nonzero``, ...), plus
  indexing with a boolean mask, whose output size needs a hidden ``nonzero`` on a GPU.

Usage: ``python benchmarks/bench_verl_dropins.py [--batch-sizes 64 256 1024] [--seq-len 2048] [--repeats 3]``.
Prints a table; it asserts nothing (this is not a test).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from verl_cppack.bench.batches import rollout_batch as rollout_batch_padded
from verl_cppack.bench.counters import HostReadCounter, OpCounter
from verl_cppack.runtime.gloo_world import run_world


def rollout_batch(batch_size: int, seq_len: int, seed: int = 0):
    ids, mask = rollout_batch_padded(batch_size, seq_len, seed=seed)
    offsets = torch.nn.functional.pad(mask.sum(1).cumsum(0), (1, 0))
    return mask, ids, torch.nested.nested_tensor_from_jagged(ids[mask], offsets=offsets)


def measure(call, repeats: int, before=None):
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        dist.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    if before is not None:
        before()
    with HostReadCounter() as tolist, OpCounter() as counter:
        call()
    return statistics.median(times), counter.total_ops, counter.syncs() + tolist.calls


def worker(rank: int, world_size: int, batch_sizes, seq_len: int, repeats: int) -> list:
    """One rank of the CP group ``gloo_world.run_world`` made; returns the measured rows."""
    import verl.models.mcore.util as verl_util
    from megatron.core import parallel_state as mpu

    from verl_cppack.integrations import verl as ours

    mpu.initialize_model_parallel(context_parallel_size=world_size)
    rows = []
    try:
        for batch_size in batch_sizes:
            mask, ids, nested = rollout_batch(batch_size, seq_len)
            labels, label_mask = torch.roll(ids, -1, 1), mask.clone()
            for impl_name, impl, clear in (("verl", verl_util, None), ("ours", ours, ours.clear_plan_caches)):
                packed, params = impl.preprocess_packed_seqs(ids, mask)
                local = torch.randn(1, packed.shape[1])
                thd, thd_params, _ = impl.preprocess_thd_engine(nested)
                thd_local = torch.randn(1, thd.shape[1])

                def step(impl=impl, packed=packed, local=local):
                    impl.preprocess_packed_seqs(ids, mask)
                    impl.preprocess_packed_seqs(labels, mask)
                    _, step_params = impl.preprocess_packed_seqs(label_mask, mask)
                    for _ in range(2):
                        impl.postprocess_packed_seqs(local, step_params, mask, batch_size, seq_len)

                cases = {
                    "step (3 pre + 2 post)": (step, clear),
                    "preprocess_packed_seqs": (lambda: impl.preprocess_packed_seqs(ids, mask), clear),
                    "postprocess_packed_seqs": (
                        lambda: impl.postprocess_packed_seqs(local, params, mask, batch_size, seq_len),
                        None,
                    ),
                    "preprocess_thd_engine": (lambda: impl.preprocess_thd_engine(nested), clear),
                    "postprocess_thd_engine": (
                        lambda: impl.postprocess_thd_engine(thd_local, thd_params, nested, batch_size),
                        None,
                    ),
                }
                for case, (call, before) in cases.items():
                    seconds, ops, syncs = measure(call, repeats, before)
                    rows.append((batch_size, case, impl_name, seconds, ops, syncs))
    finally:
        mpu.destroy_model_parallel()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = run_world(worker, 2, args.batch_sizes, args.seq_len, args.repeats, torch_threads=1)[0]
    table = {(b, case, impl): (s, ops, syncs) for b, case, impl, s, ops, syncs in rows}
    print(f"CP=2 (2 gloo processes), S={args.seq_len}, median of {args.repeats}; rank 0")
    print(
        f"{'B':>5} {'function':24} {'verl ms':>9} {'ours ms':>9} {'speedup':>8} "
        f"{'verl ops':>9} {'ours ops':>9} {'verl syncs':>10} {'ours syncs':>10}"
    )
    for batch_size in args.batch_sizes:
        for case in (
            "preprocess_packed_seqs",
            "postprocess_packed_seqs",
            "step (3 pre + 2 post)",
            "preprocess_thd_engine",
            "postprocess_thd_engine",
        ):
            verl_s, verl_ops, verl_syncs = table[(batch_size, case, "verl")]
            ours_s, ours_ops, ours_syncs = table[(batch_size, case, "ours")]
            print(
                f"{batch_size:>5} {case:24} {verl_s * 1e3:9.1f} {ours_s * 1e3:9.1f} {verl_s / ours_s:7.1f}x "
                f"{verl_ops:>9} {ours_ops:>9} {verl_syncs:>10} {ours_syncs:>10}"
            )


if __name__ == "__main__":
    main()
