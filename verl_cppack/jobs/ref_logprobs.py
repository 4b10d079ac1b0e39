"""Reference log-probs through verl's Megatron engine at context parallelism N (``verl-cppack ref-logprobs``)."""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from verl_cppack.jobs.ref_logprobs_input import BadInput, RefLogprobsRequest, prepare
from verl_cppack.runtime import PLATFORM_ENV
from verl_cppack.runtime.gloo_world import RankFailed, run_world

RESULTS_FILE, SUMMARY_FILE = "ref_logprobs.jsonl", "summary.json"


class WorkerFailed(RuntimeError):
    """A worker raised or died; every worker has been stopped."""


def _score(rank: int, world_size: int, request: RefLogprobsRequest, started: float) -> None:
    """One rank: verl's reference engine on the request's pairs; rank 0 writes the results."""
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)  # TE/Apex absent on CPU; optional verl engines
    import verl_cppack.verl_plugin  # noqa: F401 - verl_cppack's drop-ins + the CPU fixes
    from verl_cppack.runtime.megatron_engine import (
        EngineSettings,
        build_megatron_engine,
        response_log_probs,
        rollout_tensors,
    )

    settings = EngineSettings(
        str(request.model),
        context_parallel_size=request.cp,
        micro_batch_size=request.micro_batch_size,
        forward_only=True,
        seed=request.seed,
    )
    built = build_megatron_engine(settings)
    log_probs = response_log_probs(built, rollout_tensors(request.pairs), request.micro_batch_size)  # [B, R] or None
    if rank == 0:
        if log_probs is None:
            raise RuntimeError("rank 0 received no outputs from verl's engine (is_mp_src_rank_with_outputs is False)")
        write_results(request, log_probs, time.time() - started)


def write_results(request: RefLogprobsRequest, log_probs: torch.Tensor, wall_s: float) -> dict[str, Any]:
    """``ref_logprobs.jsonl`` (prompt_ids, response_ids, ref_log_probs per row, input order) and
    ``summary.json``; returns the summary. ``log_probs`` [B, R], zero past each response."""
    rows = log_probs.shape[0]
    if rows != len(request.pairs):
        raise ValueError(f"{rows} rows of log-probs for {len(request.pairs)} pairs")
    with (request.output_dir / RESULTS_FILE).open("w", encoding="utf-8") as file:
        for (prompt, response), values in zip(request.pairs, log_probs.tolist(), strict=True):
            file.write(
                json.dumps({"prompt_ids": prompt, "response_ids": response, "ref_log_probs": values[: len(response)]})
                + "\n"
            )
    summary = {
        "rows": rows,
        "tokens": sum(len(response) for _, response in request.pairs),
        "cp": request.cp,
        "model": str(request.model),
        "micro_batch_size": request.micro_batch_size,
        "wall_s": round(wall_s, 3),
    }
    (request.output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


def run(request: RefLogprobsRequest) -> dict[str, Any]:
    """Run ``request.cp`` gloo ranks; rank 0's ``summary.json``, or :class:`WorkerFailed` (every worker stopped)."""
    try:
        run_world(
            _score,
            request.cp,
            request,
            time.time(),
            environment={PLATFORM_ENV: "cpu"},
            log_dir=request.output_dir,
            torch_threads=1,
        )
    except RankFailed as error:
        raise WorkerFailed(f"{error} (worker output: {request.output_dir}/worker-*.log)") from None
    return json.loads((request.output_dir / SUMMARY_FILE).read_text(encoding="utf-8"))


__all__ = ["BadInput", "RefLogprobsRequest", "WorkerFailed", "prepare", "run", "write_results"]
