"""Where one micro-batch's packing time goes, op by op, on the device the user runs: ``torch.profiler`` over the
bench's unit, verl's functions and the drop-ins in turn.

The unit is the bench's (``bench.measure``): legacy — three ``preprocess_packed_seqs`` calls, two
``postprocess_packed_seqs`` calls —, or with ``--functions engine`` three ``preprocess_thd_engine`` and two
``postprocess_thd_engine`` calls. Every micro-batch is a new rollout batch; a few untimed ones first, then
``--repeats`` profiled ones per implementation, in one process (CP=1: nccl on a GPU, gloo on the CPU). For each
implementation it prints the profiler's table of ATen ops and the two regions (``preprocess``, ``postprocess``),
sorted by the device's time where there is one (``--sort``), else by the host's; ``--trace DIR`` also writes each
implementation's Chrome trace there. Written for the first thing a GPU session should look at: where a B=1 unit
spends its time above the floor (docs/performance.md, "On a GPU").

Usage: ``python benchmarks/profile_unit.py [--device cuda] [--functions legacy|engine] [--batch-size 1]
[--seq-len 8192] [--repeats 20] [--rows 25] [--trace DIR]``. It prints tables and asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from verl_cppack.bench.settings import refuse, require_sizes
from verl_cppack.runtime.gloo_world import run_world

WARMUP = 5


# the profiler table's sort keys (``key_averages().table(sort_by=...)``) offered here
SORT_KEYS = ("self_device_time_total", "device_time_total", "self_cpu_time_total", "cpu_time_total", "count")


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, str]:
    from megatron.core import parallel_state
    from torch.profiler import ProfilerActivity, profile, record_function
    from verl.models.mcore import util as verl_util

    from verl_cppack.bench.batches import EngineMicroBatch, micro_batch
    from verl_cppack.bench.measure import EngineFunctions, UtilFunctions, model_outputs
    from verl_cppack.integrations import verl as ours

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    functions = EngineFunctions if args.functions == "engine" else UtilFunctions

    def new_batch(index: int):
        batch = micro_batch(args.batch_size, args.seq_len, seed=index, device=args.device)
        return EngineMicroBatch.of(batch) if args.functions == "engine" else batch

    def unit(contender, batch) -> None:
        with record_function("preprocess"):
            packed, params = contender.preprocess(batch, contender.prepare(batch))
        outputs = model_outputs(packed)
        with record_function("postprocess"):
            contender.postprocess(batch, params, outputs)
        if cuda:
            torch.cuda.synchronize()

    parallel_state.initialize_model_parallel()
    tables = {}
    try:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        for name, module in (("verl", verl_util), ("verl_cppack", ours)):
            contender = functions(module)
            for index in range(WARMUP):
                unit(contender, new_batch(index))
            batches = [new_batch(WARMUP + index) for index in range(args.repeats)]  # made outside the profile
            with profile(activities=activities) as profiled:
                for batch in batches:
                    unit(contender, batch)
            sort = args.sort or ("self_device_time_total" if cuda else "self_cpu_time_total")
            tables[name] = profiled.key_averages().table(sort_by=sort, row_limit=args.rows)
            if args.trace:
                profiled.export_chrome_trace(str(Path(args.trace) / f"{name}_{args.functions}.json"))
    finally:
        parallel_state.destroy_model_parallel()
    return tables


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--functions", choices=("legacy", "engine"), default="legacy")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument(
        "--sort", choices=SORT_KEYS, default=None, help="the table's order (default: the device's self time)"
    )
    parser.add_argument("--trace", default=None, help="a directory for each implementation's Chrome trace")
    args = parser.parse_args()
    try:
        require_sizes(batch_size=args.batch_size, seq_len=args.seq_len, repeats=args.repeats, rows=args.rows)
    except ValueError as error:
        return refuse(str(error))
    if args.device == "cuda" and not torch.cuda.is_available():
        return refuse("--device cuda needs a CUDA GPU (torch.cuda.is_available() is False); use --device cpu")
    if args.sort and "device" in args.sort and args.device != "cuda":
        return refuse(f"--sort {args.sort} needs --device cuda (the CPU has no device time)")
    if args.trace and Path(args.trace).exists() and not Path(args.trace).is_dir():
        return refuse(f"--trace {args.trace} is a file; give a folder for the traces")
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
    backend = "nccl" if args.device == "cuda" else "gloo"
    [tables] = run_world(_rank, 1, args, backend=backend, torch_threads=1)
    for name, table in tables.items():
        print(f"== {name}, {args.functions} unit, B={args.batch_size} S={args.seq_len}, {args.repeats} micro-batches")
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
