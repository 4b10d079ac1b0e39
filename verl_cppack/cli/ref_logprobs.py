"""``verl-cppack ref-logprobs``: reference-model log-probs of prompt/response pairs on Ray CP workers."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from verl_cppack.rl.task import CountingTask
from verl_cppack.rl.worker import WorkerSettings


def run(args: argparse.Namespace) -> int:
    from verl_cppack.rl.cluster import WorkerError
    from verl_cppack.rl.ref_logprobs import (
        RefLogprobsConfig,
        compute_reference_log_probs,
        load_pairs,
        synthetic_pairs,
        write_reference_log_probs,
    )

    worker = dataclasses.replace(
        WorkerSettings(), seed=args.seed, vocab_size=args.vocab_size, attention=args.attention, forward=args.forward,
        device=args.device,
    )
    config = RefLogprobsConfig(cp=args.cp, micro_batch_size=args.micro_batch_size, address=args.address, worker=worker)
    if args.input:
        pairs = load_pairs(args.input)
    else:
        pairs = synthetic_pairs(CountingTask(vocab_size=args.vocab_size), args.synthetic, args.data_seed)
    longest = max(len(prompt) + len(response) for prompt, response in pairs)
    if longest > worker.max_sequence_length:
        worker = dataclasses.replace(worker, max_sequence_length=longest)
        config = dataclasses.replace(config, worker=worker)
    try:
        log_probs = compute_reference_log_probs(pairs, config)
    except WorkerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted: workers killed and Ray shut down", file=sys.stderr)
        return 130
    output_dir = write_reference_log_probs(args.output, pairs, log_probs, config)
    tokens = sum(len(values) for values in log_probs)
    print(f"ref-logprobs: {len(pairs)} rows, {tokens} response tokens at CP={args.cp} -> {output_dir / 'ref_logprobs.jsonl'}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ref-logprobs", help="reference log-probs on Ray CP workers", description=__doc__)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--input", help=".jsonl or .parquet with prompt_ids / response_ids columns")
    source.add_argument("--synthetic", type=int, default=64, help="score N synthetic counting-task pairs (default 64)")
    parser.add_argument("--cp", type=int, default=2, help="context-parallel size (default 2)")
    parser.add_argument("--output", default="runs/ref-logprobs", help="output directory (a non-empty one gets a run-* subdir)")
    parser.add_argument("--address", default=None, help="join this Ray cluster (default: RAY_ADDRESS, else local)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the reference model's weights")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the --synthetic pairs")
    parser.add_argument("--vocab-size", type=int, default=WorkerSettings().vocab_size)
    parser.add_argument("--attention", default="allgather", choices=("allgather", "ring"))
    parser.add_argument("--forward", default="verl", choices=("verl", "cppack"), help="log-prob path (see grpo --help)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu: gloo workers; cuda: nccl")
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.set_defaults(func=run)
