"""Measuring for ``verl-cppack bench`` (reporting: ``report.py``): the per-micro-batch packing work of a verl step, verl's functions vs verl_cppack's.

The step is what verl's Megatron forward does around the model: pack ``input_ids``, labels and the label
mask (three ``preprocess_packed_seqs`` calls), then gather back log-probs and entropy (two
``postprocess_packed_seqs`` calls, all-gather included). Both implementations run in the same processes,
on the same rollout-shaped batches, inside real gloo CP groups (one process per CP rank). Times are medians
over repeats, then over runs (fresh process groups); ratios are verl / verl_cppack. verl_cppack's plan cache is cleared before every repeat, so
each repeat pays for one plan, as a new micro-batch would.

Also measured: ATen op count, device->host syncs, peak extra memory (bytes allocated inside the step),
padding overhead (padded / real tokens) per alignment policy, CP load balance (max / mean causal-attention
work per rank) per layout, ``pack`` against one ``index_select`` of the same bytes, and at CP=1 verl's VLM mask
builders against the drop-ins (``bench.vlm_masks``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl_cppack.bench.batches import rollout_batch
from verl_cppack.bench.counters import HostReadCounter, OpCounter
from verl_cppack.bench.host_allocator import keep_freed_memory
from verl_cppack.bench.vlm_masks import measure_vlm_masks
from verl_cppack.bench.vlm_masks import median_over_runs as vlm_median_over_runs
from verl_cppack.context import ParallelContext
from verl_cppack.core.alignment import Alignment
from verl_cppack.core.checks import require_int
from verl_cppack.packing.builders import plan_from_mask
from verl_cppack.runtime.gloo_world import run_world


@dataclass(frozen=True)
class BenchSettings:
    batch_sizes: tuple[int, ...] = (16, 64, 256, 1024)
    seq_lens: tuple[int, ...] = (1024, 4096)
    cp_sizes: tuple[int, ...] = (1, 2, 4)
    repeats: int = 7
    runs: int = 5  # fresh process groups per CP size; times are medians over runs (a run's times drift together)
    warmup: int = 10  # untimed micro-batches per implementation and point before the timed ones
    threads: int = 1
    device: str = "cpu"  # "cuda": one GPU per CP rank, nccl, CUDA-synchronised timings
    keep_freed_host_memory: bool = True  # CPU: glibc keeps freed buffers (see bench.host_allocator)

    def check(self) -> None:
        """Refuse settings this machine cannot run, before any process starts."""
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        require_int("repeats", self.repeats, minimum=1)
        require_int("runs", self.runs, minimum=1)
        require_int("warmup", self.warmup, minimum=0)
        for name in ("batch_sizes", "seq_lens", "cp_sizes"):
            values = getattr(self, name)
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be a non-empty tuple of positive ints, got {values!r}")
        if self.device == "cuda":
            available = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if available < max(self.cp_sizes):
                raise ValueError(
                    f"device='cuda' needs one GPU per CP rank ({max(self.cp_sizes)}); this machine has {available}"
                )

    @classmethod
    def quick(cls) -> BenchSettings:
        return cls(batch_sizes=(16, 64), seq_lens=(256,), cp_sizes=(1, 2), repeats=1, runs=1, warmup=1)


# ---------------------------------------------------------------- the measured step
def _preprocess(impl: Any, input_ids: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor, mask: torch.Tensor):
    packed_ids, params = impl.preprocess_packed_seqs(input_ids, mask, pre_process=True)
    impl.preprocess_packed_seqs(labels, mask, pre_process=True)
    impl.preprocess_packed_seqs(label_mask, mask, pre_process=True)
    return packed_ids, params


def _postprocess(impl: Any, packed_ids: torch.Tensor, params: Any, mask: torch.Tensor) -> None:
    batch_size, seq_len = mask.shape
    log_probs = packed_ids.float()  # [1, T_local] stands for the model's per-token output
    impl.postprocess_packed_seqs(log_probs, params, mask, batch_size, seq_len)
    impl.postprocess_packed_seqs(log_probs * 0.5, params, mask, batch_size, seq_len)


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(fn) -> tuple[float, Any]:
    """(seconds, result) of ``fn`` started together on every rank of the group."""
    dist.barrier()
    _synchronize()
    begin = time.perf_counter()
    result = fn()
    _synchronize()
    return time.perf_counter() - begin, result


def _measure_impl(impl: Any, reset: Any, batch: tuple, settings: BenchSettings) -> dict[str, float]:
    """Medians over ``settings.repeats`` micro-batches, each a fresh plan: the preprocess, then the postprocess
    that reuses what the preprocess built (work deferred to the postprocess is counted there). ``settings.warmup``
    untimed micro-batches run first, for both: a training run is thousands of micro-batches, and here the first
    ~8 of a new batch shape are up to 1.5x slower for verl_cppack (the allocator grows its heap, pages are touched
    for the first time: hundreds of page faults in those, none after)."""
    input_ids, labels, label_mask, mask = batch

    def step() -> tuple[float, float]:
        reset()
        pre_s, (packed_ids, params) = _timed(lambda: _preprocess(impl, input_ids, labels, label_mask, mask))
        post_s, _ = _timed(lambda: _postprocess(impl, packed_ids, params, mask))
        return pre_s, post_s

    for _ in range(settings.warmup):
        step()
    samples = [step() for _ in range(settings.repeats)]
    dist.barrier()
    reset()
    with OpCounter() as counter, HostReadCounter() as tolist:
        packed_ids, params = _preprocess(impl, input_ids, labels, label_mask, mask)
        _postprocess(impl, packed_ids, params, mask)
    return {
        "preprocess_ms": statistics.median(pre for pre, _ in samples) * 1e3,
        "postprocess_ms": statistics.median(post for _, post in samples) * 1e3,
        "step_ms": statistics.median(pre + post for pre, post in samples) * 1e3,
        "aten_ops": counter.total_ops,
        "host_syncs": counter.syncs() + tolist.calls,
        "peak_extra_mb": counter.peak_bytes / 2**20,
    }


# ------------------------------------------------------------ layout statistics (no comm)
def _padding_overhead(mask: torch.Tensor, cp_size: int) -> dict[str, float]:
    ctx = ParallelContext(cp_size=cp_size)
    base = 2 * cp_size if cp_size > 1 else 1
    policies = {
        "default": dict(layout="zigzag"),
        "fp8": dict(layout="zigzag", fp8=True),
        "per_stream": dict(layout="contiguous", alignment=Alignment.per_stream(base)),
    }
    real = int(mask.sum())
    return {name: plan_from_mask(mask, ctx, **kw).total_length / real for name, kw in policies.items()}


def _load_balance(mask: torch.Tensor, cp_size: int) -> dict[str, float]:
    """max / mean over ranks of causal-attention work: sum over real local tokens of (position + 1)."""
    out = {}
    for layout in ("zigzag", "contiguous"):
        work = []
        for rank in range(cp_size):
            plan = plan_from_mask(mask, ParallelContext(cp_size=cp_size, cp_rank=rank), layout=layout)
            work.append(float(((plan.local_position_ids + 1) * plan.local_valid_mask).sum()))
        out[layout] = max(work) / statistics.mean(work)
    return out


def _pack_vs_index_select(input_ids: torch.Tensor, mask: torch.Tensor, cp_size: int, repeats: int) -> float:
    plan = plan_from_mask(mask, ParallelContext(cp_size=cp_size))
    flat = input_ids.view(-1)

    def best(fn):
        fn()
        return min(_wall(fn) for _ in range(max(repeats, 3)))

    return best(lambda: plan.pack(input_ids)) / best(lambda: flat.index_select(0, plan.local_source))


def _copies_only(batch: tuple, cp_size: int, rank: int, repeats: int) -> float:
    """Median seconds of the copies no packer can skip, run back to back: gather the three packed tensors with an
    index computed beforehand (one ``index_select`` each). verl's time over this is the speed-up a packer would
    reach if planning, reading the mask and cold caches cost nothing (the "copies-only" column)."""
    input_ids, labels, label_mask, mask = batch
    index = plan_from_mask(mask, ParallelContext(cp_size=cp_size, cp_rank=rank)).local_source

    def copies():
        return [x.reshape(-1).index_select(0, index) for x in (input_ids, labels, label_mask)]

    copies()
    return statistics.median(_timed(copies)[0] for _ in range(repeats))


def _wall(fn) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


# ------------------------------------------------------------------ one CP group
def _rank(rank: int, cp_size: int, settings: BenchSettings) -> list[dict[str, Any]]:
    """One rank of a CP group (``runtime.gloo_world`` made the process group); rank 0 returns the rows."""
    if settings.device == "cpu" and settings.keep_freed_host_memory:
        keep_freed_memory()
    if settings.device == "cuda":
        torch.cuda.set_device(rank)
    from megatron.core import parallel_state
    from verl.models.mcore import util as verl_util

    from verl_cppack.integrations import verl as ours

    parallel_state.initialize_model_parallel(context_parallel_size=cp_size)
    rows = []
    try:
        for seq_len in settings.seq_lens:
            for batch_size in settings.batch_sizes:
                input_ids, mask = rollout_batch(batch_size, seq_len, seed=batch_size + seq_len)
                input_ids, mask = input_ids.to(settings.device), mask.to(settings.device)
                labels = torch.roll(input_ids, -1, dims=1)
                label_mask = mask & torch.roll(mask, -1, dims=1)
                batch = (input_ids, labels, label_mask, mask)
                verl = _measure_impl(verl_util, lambda: None, batch, settings)
                cppack = _measure_impl(ours, ours.clear_plan_caches, batch, settings)
                copies_ms = _copies_only(batch, cp_size, rank, settings.repeats) * 1e3
                if rank == 0:
                    rows.append(
                        {
                            "batch_size": batch_size,
                            "seq_len": seq_len,
                            "cp_size": cp_size,
                            "real_tokens": int(mask.sum()),
                            "verl": verl,
                            "verl_cppack": cppack,
                            "preprocess_copies_ms": copies_ms,
                            "padding_overhead": _padding_overhead(mask, cp_size),
                            "load_balance": _load_balance(mask, cp_size),
                            "pack_over_index_select": _pack_vs_index_select(input_ids, mask, cp_size, settings.repeats),
                        }
                    )
                    if cp_size == 1:  # the builders communicate nothing: CP only rounds their rows
                        rows[-1]["vlm_masks"] = measure_vlm_masks(
                            verl_util, ours, input_ids, mask, settings.repeats, settings.warmup
                        )
        return rows
    finally:
        parallel_state.destroy_model_parallel()


def run_benchmark(settings: BenchSettings) -> list[dict[str, Any]]:
    settings.check()
    backend = "nccl" if settings.device == "cuda" else "gloo"
    rows: list[dict[str, Any]] = []
    for cp_size in settings.cp_sizes:
        runs = []
        for _ in range(settings.runs):
            world = run_world(_rank, cp_size, settings, backend=backend, torch_threads=settings.threads)
            runs.append(world[0])
        rows.extend(_median_over_runs(point_runs) for point_runs in zip(*runs))
    return rows


TIMINGS = ("preprocess_ms", "postprocess_ms", "step_ms")


def ratios(row: dict[str, Any]) -> dict[str, float]:
    verl, ours = row["verl"], row["verl_cppack"]
    return {
        "preprocess": verl["preprocess_ms"] / ours["preprocess_ms"],
        "postprocess": verl["postprocess_ms"] / ours["postprocess_ms"],
        "step": verl["step_ms"] / ours["step_ms"],
        "copies_only": verl["preprocess_ms"] / row["preprocess_copies_ms"],
    }


def _median_over_runs(point_runs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """One point measured in several runs -> the first run's row with every time the median over the runs (the
    times of one process drift together by up to ±20% on a shared VM; counts and sizes do not change), plus each
    run's own preprocess ratio (``preprocess_ratio_by_run``)."""
    row = {**point_runs[0], "runs": len(point_runs)}
    row["preprocess_ratio_by_run"] = [ratios(run)["preprocess"] for run in point_runs]
    for impl in ("verl", "verl_cppack"):
        row[impl] = {**row[impl], **{t: statistics.median(run[impl][t] for run in point_runs) for t in TIMINGS}}
    for key in ("preprocess_copies_ms", "pack_over_index_select"):
        row[key] = statistics.median(run[key] for run in point_runs)
    if "vlm_masks" in row:
        row["vlm_masks"] = vlm_median_over_runs([run["vlm_masks"] for run in point_runs])
    return row


# ---------------------------------------------------------------------- reporting
