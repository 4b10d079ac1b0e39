"""What behaviour verification costs: one verl-like micro-batch through the patched verl, verified or not.

Each run is a fresh interpreter (1-rank gloo world, megatron parallel state at TP=CP=1) that imports the plugin with
``VERL_CPPACK_VERIFY=1`` or ``0``, then times micro-batches of ``B`` sequences of up to ``S`` tokens through
``verl.models.mcore.model_forward``'s names: ``preprocess_thd_engine`` (ids, then labels with ``need_roll``),
``postprocess_thd_engine`` of a ``[1, T, H]`` output, ``preprocess_packed_seqs`` / ``postprocess_packed_seqs``.
The first micro-batch of a verified process runs verl's functions beside ours and compares; the later ones run
ours alone. Prints one JSON line: per setting, the median over ``--runs`` processes of the first and of the later
micro-batches' seconds.

    python scripts/verification_cost.py --batch 64 --seq-len 1024 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

RUN = r"""
import json, os, sys, time, torch, torch.distributed as dist
import verl_cppack.verl_plugin
from verl.models.mcore import model_forward as mf
from verl_cppack.integrations.verl import patching
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from megatron.core import parallel_state as mpu
mpu.initialize_model_parallel()
torch.set_num_threads(1)
batch, seq_len, hidden, steps = (int(v) for v in sys.argv[2:6])

def micro_batch(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq_len + 1, (batch,), generator=g)
    mask = torch.arange(seq_len)[None, :] < lengths[:, None]
    ids = torch.randint(1, 1000, (batch, seq_len), generator=g)
    nested = torch.nested.nested_tensor([row[m] for row, m in zip(ids, mask)], layout=torch.jagged)
    labels = torch.nested.nested_tensor([row[m].roll(-1) for row, m in zip(ids, mask)], layout=torch.jagged)
    start = time.perf_counter()
    packed, params, _ = mf.preprocess_thd_engine(nested)
    mf.preprocess_thd_engine(labels, need_roll=True)
    output = torch.randn(1, packed.shape[1], hidden, requires_grad=True)
    mf.postprocess_thd_engine(output, params, nested, batch).values().sum().backward()
    packed, params = mf.preprocess_packed_seqs(ids, mask)
    output = torch.randn(1, packed.shape[1], hidden, requires_grad=True)
    mf.postprocess_packed_seqs(output, params, mask, batch, seq_len).sum().backward()
    return time.perf_counter() - start

times = [micro_batch(seed) for seed in range(steps)]
status = patching.status()
mpu.destroy_model_parallel()
dist.destroy_process_group()
print(json.dumps({"first": times[0], "later": statistics.median(times[1:]) if len(times) > 1 else None,
                  "verifying": status["verifying"], "put_back": status["put_back"]}))
""".replace("statistics.median", "__import__('statistics').median")


def run_once(verify: str, batch: int, seq_len: int, hidden: int, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_CPPACK_DISABLE")}
    env["VERL_CPPACK_VERIFY"] = verify
    with tempfile.TemporaryDirectory() as folder:
        args = [os.path.join(folder, "store"), str(batch), str(seq_len), str(hidden), str(steps)]
        result = subprocess.run(
            [sys.executable, "-c", RUN, *args], env=env, capture_output=True, text=True, timeout=900
        )
    if result.returncode != 0:
        raise SystemExit(f"error: a timing run failed: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6, help="micro-batches per process (default 6)")
    parser.add_argument("--runs", type=int, default=3, help="processes per setting (default 3)")
    args = parser.parse_args(argv)
    for name in ("batch", "seq_len", "hidden", "runs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first micro-batch and a later one)")
    report: dict = {"batch": args.batch, "seq_len": args.seq_len, "hidden": args.hidden}
    for verify in ("0", "1"):
        runs = [run_once(verify, args.batch, args.seq_len, args.hidden, args.steps) for _ in range(args.runs)]
        if any(run["put_back"] for run in runs):
            raise SystemExit(f"error: verification put functions back on this verl: {runs[0]['put_back']}")
        report["verified" if verify == "1" else "plain"] = {
            "first_s": statistics.median(run["first"] for run in runs),
            "later_s": statistics.median(run["later"] for run in runs),
        }
    report["extra_first_s"] = report["verified"]["first_s"] - report["plain"]["first_s"]
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
