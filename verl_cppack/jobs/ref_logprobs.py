"""Reference log-probs through verl's Megatron engine at context parallelism N (``verl-cppack ref-logprobs``).

Input rows hold ``prompt_ids`` and ``response_ids`` (lists of token ids) in a ``.jsonl`` or ``.parquet`` file
(:func:`load_pairs`), or are made up (:func:`synthetic_pairs`). Everything is checked in the calling process
(:func:`prepare`) before any worker starts. :func:`run` then spawns ``cp`` gloo processes on 127.0.0.1; each
sets ``VERL_PLATFORM=cpu`` before importing verl, imports ``verl_cppack.verl_plugin``, builds verl's
forward-only (reference) Megatron engine on the checkpoint and computes the response log-probs the way verl's
reference worker does (``verl_cppack.runtime.megatron_engine.response_log_probs``). Rank 0 writes
``ref_logprobs.jsonl`` (one line per input row) and ``summary.json``.

Failures: :class:`BadInput` (``ValueError``) before anything starts; :class:`WorkerFailed` when a worker
raised or died (the others are stopped); ``KeyboardInterrupt`` stops every worker before it propagates.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verl_cppack.jobs.output import fresh_output_dir
from verl_cppack.runtime.megatron_engine import Pair, check_pairs

RESULTS_FILE, SUMMARY_FILE = "ref_logprobs.jsonl", "summary.json"
SYNTHETIC_MAX_PROMPT, SYNTHETIC_MAX_RESPONSE = 6, 6  # the counting task's prompt and response lengths
GLOO_TIMEOUT_S = 600.0  # a collective that waits longer than this raises instead of hanging
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this long


class BadInput(ValueError):
    """The request cannot run (input, model, flags); raised before any worker starts."""


class WorkerFailed(RuntimeError):
    """A worker raised or died; every worker has been stopped."""


@dataclass(frozen=True)
class RefLogprobsRequest:
    """A checked request: the pairs, the model and how to run it."""

    pairs: tuple[Pair, ...]
    model: Path
    vocab_size: int
    cp: int
    micro_batch_size: int
    output_dir: Path
    seed: int = 0


# ------------------------------------------------------------------------------------------------ inputs
def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInput(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise BadInput(f"{name} must be >= 1, got {value}")
    return value


def load_pairs(path: str | Path) -> list[Pair]:
    """Rows of ``{"prompt_ids": [...], "response_ids": [...]}`` from ``.jsonl`` or ``.parquet`` (other columns
    are ignored). Raises :class:`BadInput` naming the file, row and column of the first problem."""
    path = Path(path)
    if path.suffix not in (".jsonl", ".parquet"):
        raise BadInput(f"input {path} must end in .jsonl or .parquet")
    if not path.is_file():
        raise BadInput(f"input {path} does not exist or is not a file")
    rows = _read_parquet(path) if path.suffix == ".parquet" else _read_jsonl(path)
    if not rows:
        raise BadInput(f"input {path} has no rows")
    pairs = []
    for index, row in enumerate(rows):
        missing = [column for column in ("prompt_ids", "response_ids") if column not in row]
        if missing:
            raise BadInput(
                f"{path} row {index} needs 'prompt_ids' and 'response_ids', lacks {missing} (has {sorted(row)})"
            )
        pairs.append(
            (
                _token_ids(row["prompt_ids"], path, index, "prompt_ids"),
                _token_ids(row["response_ids"], path, index, "response_ids"),
            )
        )
    return pairs


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise BadInput(f"cannot read {path}: {error}") from error
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise BadInput(f"{path} line {number} is not JSON: {error}") from error
        if not isinstance(row, dict):
            raise BadInput(f"{path} line {number} must be a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pandas
    except ImportError as error:
        raise BadInput(
            f"reading {path} needs pandas and pyarrow (pip install pandas pyarrow), or pass a .jsonl"
        ) from error
    try:
        return pandas.read_parquet(path).to_dict("records")
    except Exception as error:  # pyarrow raises its own error types for a file that is not parquet
        raise BadInput(f"cannot read {path} as parquet: {type(error).__name__}: {error}") from error


def _token_ids(value: Any, path: Path, index: int, column: str) -> list[int]:
    """A list of Python ints from a JSON list or a parquet array; floats, bools and strings are refused."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):  # numpy array from parquet
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise BadInput(f"{path} row {index} {column} must be a list of integer token ids, got {value!r}")
    ids = []
    for token in value:
        if hasattr(token, "item") and not isinstance(token, (bool, int, float, str)):
            token = token.item()  # numpy scalar
        if isinstance(token, bool) or not isinstance(token, int):
            raise BadInput(f"{path} row {index} {column} holds {token!r}; token ids must be integers")
        ids.append(token)
    return ids


def synthetic_pairs(count: int, vocab_size: int, seed: int) -> list[Pair]:
    """``count`` pairs of uniform random token ids in ``[0, vocab_size)``, prompts of 1..6 and responses of
    1..6 tokens (ragged on both sides), reproducible from ``seed``."""
    _positive("--synthetic", count)
    _positive("vocab_size", vocab_size)
    generator = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(1, SYNTHETIC_MAX_PROMPT + 1, (count,), generator=generator).tolist()
    response_lengths = torch.randint(1, SYNTHETIC_MAX_RESPONSE + 1, (count,), generator=generator).tolist()
    ids = torch.randint(0, vocab_size, (count, SYNTHETIC_MAX_PROMPT + SYNTHETIC_MAX_RESPONSE), generator=generator)
    return [
        (ids[row, :prompt].tolist(), ids[row, SYNTHETIC_MAX_PROMPT : SYNTHETIC_MAX_PROMPT + response].tolist())
        for row, (prompt, response) in enumerate(zip(prompt_lengths, response_lengths, strict=True))
    ]


def model_vocab_size(model: str | Path) -> int:
    """``vocab_size`` from ``model/config.json`` (a Hugging Face checkpoint directory)."""
    config_path = Path(model) / "config.json"
    if not Path(model).is_dir():
        raise BadInput(f"--model {model} is not a directory (a Hugging Face checkpoint with config.json)")
    if not config_path.is_file():
        raise BadInput(f"--model {model} has no config.json; pass a Hugging Face checkpoint directory")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadInput(f"cannot read {config_path}: {error}") from error
    vocab_size = config.get("vocab_size") if isinstance(config, dict) else None
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise BadInput(f"{config_path} has no positive integer vocab_size (got {vocab_size!r})")
    return vocab_size


def prepare(
    model: str | Path | None = None,
    input_path: str | Path | None = None,
    synthetic: int | None = None,
    cp: int = 2,
    micro_batch_size: int = 8,
    output: str | Path = "runs/ref-logprobs",
    seed: int = 0,
) -> RefLogprobsRequest:
    """Check everything that can be checked without a worker and make the output directory.

    ``model`` None is the tiny counting model (made and cached on first use). Exactly one of ``input_path``
    and ``synthetic`` is used (``input_path`` wins when both are given). Raises :class:`BadInput`.
    """
    _positive("--cp", cp)
    _positive("--micro-batch-size", micro_batch_size)
    if input_path is None:
        _positive("--synthetic", synthetic)
    if model is None:
        from verl_cppack.jobs.counting_task import ensure_counting_assets

        try:
            model = ensure_counting_assets().model
        except OSError as error:
            raise BadInput(f"cannot make the tiny counting model in the cache: {error}; pass --model DIR") from error
    vocab_size = model_vocab_size(model)
    pairs = load_pairs(input_path) if input_path is not None else synthetic_pairs(synthetic, vocab_size, seed)
    where = f"{input_path}: " if input_path is not None else ""
    try:
        check_pairs(pairs)
    except (TypeError, ValueError) as error:
        raise BadInput(f"{where}{error}") from error
    try:
        check_pairs(pairs, vocab_size)
    except ValueError as error:  # a token id >= vocab_size
        raise BadInput(f"{where}{error} of --model {model} (config.json vocab_size)") from error
    try:
        output_dir = fresh_output_dir(output)
    except ValueError as error:
        raise BadInput(str(error)) from error
    return RefLogprobsRequest(tuple(pairs), Path(model).resolve(), vocab_size, cp, micro_batch_size, output_dir, seed)


# ------------------------------------------------------------------------------------------------ workers
def worker_log(output_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its stdout and stderr (verl's and Megatron's own logging)."""
    return output_dir / f"worker-{rank}.log"


def _worker(
    rank: int, world_size: int, rendezvous: str, request: RefLogprobsRequest, started: float, results: Any
) -> None:
    """One gloo rank. Reports ``(rank, "ok", None)`` or ``(rank, "error", traceback)`` on ``results``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops every worker
    log = open(worker_log(request.output_dir, rank), "a", encoding="utf-8")  # noqa: SIM115  lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ["VERL_PLATFORM"] = "cpu"  # before verl is imported
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo talks over loopback only
    torch.set_num_threads(1)
    import datetime
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=UserWarning)  # TE/Apex absent on CPU; optional verl engines
    dist.init_process_group(
        "gloo",
        init_method=rendezvous,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S),
    )
    try:
        _score(rank, request, started)
        results.put((rank, "ok", None))
    except BaseException:  # reported to the parent, which stops the other workers
        report = traceback.format_exc()
        print(report, file=sys.stderr, flush=True)
        results.put((rank, "error", report))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _score(rank: int, request: RefLogprobsRequest, started: float) -> None:
    import verl_cppack.verl_plugin  # noqa: F401  verl_cppack's drop-ins + the CPU fixes
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


def run(request: RefLogprobsRequest, poll_s: float = 0.2) -> dict[str, Any]:
    """Spawn ``request.cp`` gloo ranks, wait for them, return rank 0's ``summary.json``.

    Raises :class:`WorkerFailed` when a rank reports an error or exits without reporting (the others are
    stopped; each rank's output is in ``worker-<rank>.log`` of the output directory). On
    ``KeyboardInterrupt`` every worker is stopped before it propagates.
    """
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="verl_cppack_ref_") as folder:
        rendezvous = f"file://{os.path.join(folder, 'rendezvous')}"  # no port to race for
        results = context.Queue()
        processes = [
            context.Process(
                target=_worker,
                args=(rank, request.cp, rendezvous, request, started, results),
                name=f"ref-logprobs-rank{rank}",
            )
            for rank in range(request.cp)
        ]
        try:
            for process in processes:
                process.start()
            failure = _wait(processes, results, poll_s)
            if failure is None:
                for process in processes:
                    process.join()
        finally:
            _stop(processes)
            results.close()
            results.join_thread()
    if failure is not None:
        raise WorkerFailed(f"{failure} (worker output: {request.output_dir}/worker-*.log)")
    return json.loads((request.output_dir / SUMMARY_FILE).read_text(encoding="utf-8"))


def _wait(processes: Sequence[Any], results: Any, poll_s: float) -> str | None:
    """None once every rank reported success, else a one-line description of the first failure."""
    done: set[int] = set()
    while len(done) < len(processes):
        try:
            rank, status, report = results.get(timeout=poll_s)
        except queue.Empty:
            exited = [
                rank for rank, process in enumerate(processes) if rank not in done and process.exitcode is not None
            ]
            if exited:  # one more look: its report may still be on its way
                try:
                    rank, status, report = results.get(timeout=1.0)
                except queue.Empty:
                    return f"rank {exited[0]} exited with code {processes[exited[0]].exitcode} without reporting"
            else:
                continue
        if status != "ok":
            return f"rank {rank} failed: {_last_line(report)}"
        done.add(rank)
    return None


def _last_line(report: str) -> str:
    """The exception line of a traceback (its last non-empty line)."""
    lines = [line.strip() for line in report.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "unknown error"


def _stop(processes: Sequence[Any]) -> None:
    """SIGTERM every live worker, SIGKILL what is left after ``STOP_GRACE_S``, reap them all."""
    for process in processes:
        if process.pid is not None and process.is_alive():
            process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for process in processes:
        if process.pid is not None:
            process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.pid is not None and process.is_alive():
            process.kill()
            process.join()
