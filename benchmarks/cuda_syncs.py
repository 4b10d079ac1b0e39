"""Host syncs counted by CUDA itself, verl's functions against the drop-ins, with every result checked equal.

The bench counts syncs from the ops dispatched (ops that sync on an accelerator, boolean-mask indexing, ``tolist``,
our host read). This script counts what the device reports: ``torch.cuda.set_sync_debug_mode("warn")`` warns on each
synchronizing CUDA operation PyTorch makes (``verify_gpu.count_host_syncs``). Per point, on new rollout batches (the
first of each point untimed and uncounted), in one process per CP rank joined by gloo — so CP=2 runs on one GPU too,
both ranks on ``cuda:0`` —, each contender runs the bench's unit (three ``preprocess_packed_seqs`` calls: ids,
labels, label mask; two ``postprocess_packed_seqs`` calls: log-probs and entropy) and its preprocess and postprocess
syncs are counted apart; ``--functions engine`` runs the engine path's unit instead (three ``preprocess_thd_engine``
calls: ids, labels verl rolls, temperatures; two ``postprocess_thd_engine`` calls back to jagged tensors). The
drop-ins' packed ids, ``PackedSeqParams`` offsets and gathered outputs must equal verl's exactly, on every rank, or the
script ends with an error. The all-gather's own waits inside gloo are not
PyTorch's and are not counted (over NCCL there are none on the host).

Usage: ``python benchmarks/cuda_syncs.py [--functions legacy|engine] [--cp-sizes 1,2] [--batch-sizes 1,4,16,64]
[--seq-lens 1024,8192] [--output cuda_syncs.json]``. Without CUDA it exits 2 with one ``error:`` line (``--device cpu`` runs the equality
checks alone, syncs uncounted: how the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from verl_cppack.bench.settings import check_grid, int_list, refuse
from verl_cppack.integrations.verl.comparison import PSP_FIELDS, Comparison
from verl_cppack.runtime.gloo_world import run_world

PARAMS_FIELDS = PSP_FIELDS  # the PackedSeqParams fields compared


def _differences(theirs: tuple, ours: tuple) -> list[str]:
    """Where the drop-ins' ``(packed, params, outputs)`` differ from verl's (``comparison.Comparison``: device, dtype,
    shape or any value)."""
    found = Comparison()
    found.tensors("packed input_ids", "", theirs[0], ours[0])
    found.params("PackedSeqParams", "", theirs[1], ours[1])
    for index, (verl_output, our_output) in enumerate(zip(theirs[2], ours[2], strict=True)):
        found.tensors(f"gathered output {index}", "", verl_output, our_output)
    names = (
        f.function + ("." + f.where.split(":")[0][7:] if f.where.startswith("params.") else "") for f in found.findings
    )
    return list(dict.fromkeys(names))


def _rank(rank: int, cp_size: int, device_type: str, batch_sizes, seq_lens, functions: str) -> list[dict]:
    from megatron.core import parallel_state
    from verl.models.mcore import util as verl_util

    from verl_cppack.bench.batches import EngineMicroBatch, batch_seed, micro_batch
    from verl_cppack.bench.measure import EngineFunctions, UtilFunctions, model_outputs
    from verl_cppack.cli.verify_gpu import count_host_syncs
    from verl_cppack.integrations import verl as ours

    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    def counted(step) -> int | None:
        syncs = count_host_syncs(step, device)
        if syncs is None:  # not countable here: run it all the same
            step()
        return syncs

    parallel_state.initialize_model_parallel(context_parallel_size=cp_size)
    rows = []
    try:
        for seq_len in seq_lens:
            for batch_size in batch_sizes:
                row: dict = {"functions": functions, "cp_size": cp_size, "seq_len": seq_len, "batch_size": batch_size}
                for index in range(2):  # the first batch of a point warms up; the second is counted
                    seed = batch_seed(batch_size, seq_len, 1000 + index)
                    batch = micro_batch(batch_size, seq_len, seed=seed, device=device.type)
                    batch = EngineMicroBatch.of(batch) if functions == "engine" else batch
                    results = {}
                    for name, module in (("verl", verl_util), ("verl_cppack", ours)):
                        unit = EngineFunctions(module) if functions == "engine" else UtilFunctions(module)
                        mine, made = batch.clone(), {}  # each its own tensors
                        pre = counted(lambda: made.update(pre=unit.preprocess(mine, None)))
                        packed, params = made["pre"]
                        outputs = model_outputs(packed)
                        post = counted(lambda: made.update(post=unit.postprocess(mine, params, outputs)))
                        results[name] = (packed, params, made["post"])
                        row[name] = {"preprocess_syncs": pre, "postprocess_syncs": post}
                    differences = _differences(results["verl"], results["verl_cppack"])
                    if differences:
                        raise AssertionError(
                            f"rank {rank}, B={batch_size} S={seq_len}: differ from verl's: {differences}"
                        )
                rows.append(row)
    finally:
        parallel_state.destroy_model_parallel()
    return rows if rank == 0 else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--functions", choices=("legacy", "engine"), default="legacy")
    parser.add_argument("--cp-sizes", default="1,2")
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--seq-lens", default="1024,8192")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--output", default="cuda_syncs.json")
    args = parser.parse_args()
    try:
        grid = {name: int_list(name, getattr(args, name)) for name in ("batch_sizes", "seq_lens", "cp_sizes")}
        check_grid(**grid)
    except ValueError as error:
        return refuse(str(error))
    output = Path(args.output)
    if output.is_dir() or not output.parent.is_dir():
        return refuse(f"--output {output} must name a file in an existing folder")
    if args.device == "cuda" and not torch.cuda.is_available():
        return refuse("cuda_syncs.py counts CUDA's own syncs and needs a CUDA GPU (--device cpu checks equality alone)")
    rows = []
    for cp_size in grid["cp_sizes"]:
        world = run_world(
            _rank, cp_size, args.device, grid["batch_sizes"], grid["seq_lens"], args.functions, backend="gloo"
        )
        rows.extend(world[0])
    print("| CP | S | B | verl syncs pre / post | verl_cppack syncs pre / post |\n|---|---|---|---|---|")
    for row in rows:
        v, o = row["verl"], row["verl_cppack"]
        print(
            f"| {row['cp_size']} | {row['seq_len']} | {row['batch_size']} | {v['preprocess_syncs']} / "
            f"{v['postprocess_syncs']} | {o['preprocess_syncs']} / {o['postprocess_syncs']} |"
        )
    with open(args.output, "w") as file:
        json.dump(
            {
                "functions": args.functions,
                "device": args.device,
                "torch": torch.__version__,
                "all_equal_to_verl": True,
                "rows": rows,
            },
            file,
            indent=1,
        )
    print(f"every result equal to verl's; wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
