"""``verl-cppack ref-logprobs``: reference log-probs of prompt/response pairs through verl's Megatron engine.

Spawns --cp gloo processes, each with verl's forward-only Megatron engine on --model (default: the tiny counting
model) and verl_cppack's drop-ins, scoring the responses as verl's reference worker does (packed THD, zigzag at CP>1).
Input: integer lists prompt_ids and response_ids (.jsonl or .parquet), or --synthetic N random pairs. Writes
DIR/ref_logprobs.jsonl, DIR/summary.json and DIR/worker-<rank>.log.

Exit codes: 0 done; 2 bad input (nothing started); 3 a worker failed (the others stopped); 130 interrupted."""

from __future__ import annotations

import argparse
import sys

from verl_cppack.cli import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, add_command, error


def run(args: argparse.Namespace) -> int:
    from verl_cppack.jobs.ref_logprobs import WorkerFailed
    from verl_cppack.jobs.ref_logprobs import run as run_request
    from verl_cppack.jobs.ref_logprobs_input import BadInput, prepare

    names = ("model", "input_path", "synthetic", "cp", "micro_batch_size", "output", "seed")
    started = False
    try:
        request = prepare(**{name: getattr(args, name) for name in names})
        print(
            f"ref-logprobs: {len(request.pairs)} rows at CP={request.cp} on {request.model}: starting {request.cp} "
            f"gloo process(es) -> {request.output_dir}",
            flush=True,
        )
        started = True
        summary = run_request(request)
    except (BadInput, WorkerFailed) as problem:
        return error(str(problem), EXIT_BAD_INPUT if isinstance(problem, BadInput) else EXIT_FAILED)
    except KeyboardInterrupt:
        print(f"interrupted: {'every worker was stopped' if started else 'nothing was started'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(
        f"ref-logprobs: {summary['rows']} rows, {summary['tokens']} response tokens at CP={summary['cp']} in "
        f"{summary['wall_s']:.1f} s -> {request.output_dir / 'ref_logprobs.jsonl'}"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers, "ref-logprobs", "reference log-probs through verl's Megatron engine at CP=N", __doc__, run
    )
    parser.add_argument("--model", help="Hugging Face checkpoint directory (default: the tiny counting model)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--input", dest="input_path", help=".jsonl or .parquet with integer-list columns prompt_ids and response_ids"
    )
    source.add_argument("--synthetic", type=int, default=64, help="score N random pairs instead (default 64)")
    parser.add_argument("--cp", type=int, default=2, help="context-parallel size = gloo processes (default 2)")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="rows per infer_batch call (default 8)")
    parser.add_argument("--output", default="runs/ref-logprobs", help="output directory (a non-empty one gets a run-*)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --synthetic pairs and of Megatron (default 0)")
