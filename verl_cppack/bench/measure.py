"""Measuring for ``verl-cppack bench`` (reporting: ``report.py``; the method: docs/performance.md): a micro-batch's
packing work, verl's functions against verl_cppack's drop-ins and against the floor (``floors.py``).

The unit: one preprocess (three ``preprocess_packed_seqs`` calls: ids, labels, label mask) and one postprocess (two
``postprocess_packed_seqs`` calls: log-probs, entropy, all-gather included), on a **new batch** every micro-batch
(each contender its own copy of the same values), the contenders in turn (the order rotating), in real gloo CP groups
(``runtime.gloo_world.run_world``). Times are rank 0's: medians over the timed micro-batches, then over runs. A
preprocess runs on one rank at a time while the others wait at a barrier (here CP ranks share two cores).

Also counted, once per point on one more new batch: ATen ops, host syncs (ops that sync on an accelerator, plus
``Tensor.tolist`` and verl_cppack's one host read) and peak extra memory (``counters.OpCounter``); at CP=1 verl's VLM
mask builders against the drop-ins (``vlm_masks.py``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from verl_cppack.bench.batches import EngineMicroBatch, MicroBatch, batch_seed, micro_batch
from verl_cppack.bench.counters import HostReadCounter, OpCounter
from verl_cppack.bench.floors import (
    all_gathers_alone,
    engine_floor_index,
    engine_postprocess_floor,
    engine_preprocess_floor,
    floor_index,
    postprocess_floor,
    preprocess_floor,
)
from verl_cppack.bench.host_allocator import keep_freed_memory
from verl_cppack.bench.ratios import ratios, spread
from verl_cppack.bench.settings import BenchSettings
from verl_cppack.bench.vlm_masks import measure_vlm_masks
from verl_cppack.runtime.gloo_world import run_world


# ---------------------------------------------------------------- the contenders
class UtilFunctions:
    """verl's ``verl.models.mcore.util`` or verl_cppack's drop-ins: the five calls of the unit."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def prepare(self, batch: Any) -> None:
        return None

    def preprocess(self, batch: MicroBatch, prepared: None) -> tuple[torch.Tensor, Any]:
        mask = batch.attention_mask
        packed_ids, params = self.module.preprocess_packed_seqs(batch.input_ids, mask, pre_process=True)
        self.module.preprocess_packed_seqs(batch.labels, mask, pre_process=True)
        self.module.preprocess_packed_seqs(batch.label_mask, mask, pre_process=True)
        return packed_ids, params

    def postprocess(self, batch: MicroBatch, params: Any, outputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        batch_size, seq_len = batch.shape
        mask = batch.attention_mask
        return [self.module.postprocess_packed_seqs(o, params, mask, batch_size, seq_len) for o in outputs]


class EngineFunctions(UtilFunctions):
    """The engine path of verl's forward (``gptmodel_forward_model_engine``): three ``preprocess_thd_engine`` calls
    (ids, labels rolled by verl, per-token temperature) and two ``postprocess_thd_engine`` calls, jagged in and out."""

    def preprocess(self, batch: EngineMicroBatch, prepared: None) -> tuple[torch.Tensor, Any]:
        packed_ids, params, _ = self.module.preprocess_thd_engine(batch.input_ids, pre_process=True)
        self.module.preprocess_thd_engine(batch.labels, pre_process=True, need_roll=True)
        self.module.preprocess_thd_engine(batch.temperature, pre_process=True)
        return packed_ids, params

    def postprocess(self, batch: EngineMicroBatch, params: Any, outputs: tuple[torch.Tensor, ...]) -> list[Any]:
        return [self.module.postprocess_thd_engine(o, params, batch.input_ids, batch.batch_size) for o in outputs]


class Floor:
    """The floors (``floors.py``): the index is prepared untimed from verl's functions, then only copies and
    all-gathers run."""

    def __init__(self, verl_util: Any, group: Any, cp_size: int, cp_rank: int) -> None:
        self.verl_util, self.group, self.cp_size, self.cp_rank = verl_util, group, cp_size, cp_rank

    def prepare(self, batch: MicroBatch) -> Any:
        return floor_index(self.verl_util, batch.attention_mask, self.cp_size, self.cp_rank)

    def preprocess(self, batch: MicroBatch, index: Any) -> tuple[torch.Tensor, Any]:
        return preprocess_floor(batch, index), index

    def postprocess(self, batch: MicroBatch, index: Any, outputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        return postprocess_floor(outputs, index, batch.shape, self.group)

    def all_gathers(self, index: Any, outputs: tuple[torch.Tensor, ...]) -> None:
        all_gathers_alone(outputs, index, self.group)


class EngineFloor(Floor):
    """The engine path's floors: copies from the jagged values, all-gathers plus one copy back into them."""

    def prepare(self, batch: EngineMicroBatch) -> Any:
        return engine_floor_index(self.verl_util, batch, self.cp_size, self.cp_rank)

    def preprocess(self, batch: EngineMicroBatch, index: Any) -> tuple[torch.Tensor, Any]:
        return engine_preprocess_floor(batch, index), index

    def postprocess(self, batch: EngineMicroBatch, index: Any, outputs: tuple[torch.Tensor, ...]) -> list[Any]:
        return engine_postprocess_floor(outputs, index, self.group)


def model_outputs(packed_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins for the model's per-token log-probs and entropy, ``[1, T_local]`` float32 (made untimed)."""
    log_probs = packed_ids.float()
    return log_probs, log_probs * 0.5


# ---------------------------------------------------------------- timing
def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], *, alone: bool = False) -> tuple[float, Any]:
    """(seconds, result) of ``fn`` started together on every rank of the group; ``alone``: run by one rank at a
    time, the others waiting at a barrier (for work that communicates nothing: see the module docstring)."""
    for turn in range(dist.get_world_size()) if alone else (None,):
        dist.barrier()
        if turn is None or turn == dist.get_rank():
            _synchronize()
            begin = time.perf_counter()
            result = fn()
            _synchronize()
            seconds = time.perf_counter() - begin
    return seconds, result


def _time_unit(contender: Any, batch: MicroBatch) -> dict[str, float]:
    prepared = contender.prepare(batch)
    pre_s, (packed_ids, params) = _timed(lambda: contender.preprocess(batch, prepared), alone=True)
    outputs = model_outputs(packed_ids)
    post_s, _ = _timed(lambda: contender.postprocess(batch, params, outputs))
    times = {"preprocess_ms": pre_s * 1e3, "postprocess_ms": post_s * 1e3, "step_ms": (pre_s + post_s) * 1e3}
    if isinstance(contender, Floor):
        times["all_gathers_ms"] = _timed(lambda: contender.all_gathers(params, outputs))[0] * 1e3
    return times


def _count_unit(contender: Any, batch: MicroBatch) -> dict[str, Any]:
    """ATen ops, host syncs and peak extra memory of one unit (the model-output stand-ins are not counted)."""
    prepared = contender.prepare(batch)
    counter = OpCounter()
    with HostReadCounter() as reads:
        with counter:
            packed_ids, params = contender.preprocess(batch, prepared)
        outputs = model_outputs(packed_ids)
        with counter:
            contender.postprocess(batch, params, outputs)
    return {
        "aten_ops": counter.total_ops,
        "host_syncs": counter.syncs() + reads.calls,
        "peak_extra_mb": counter.peak_bytes / 2**20,
        "ops": dict(sorted(counter.ops.items())),
    }


def post_init_cost(contender: Any, batch: MicroBatch) -> dict[str, float]:
    """What megatron-core's own ``PackedSeqParams.__post_init__`` (0.17+: it derives ``seq_idx`` when
    ``total_tokens`` is set) costs inside one unit: how many times it runs, and its median time per run on the
    unit's own params (``{}`` where the installed class has none, as megatron-core 0.16.1's)."""
    from verl_cppack.integrations.megatron import packed_seq_params_class

    cls = packed_seq_params_class()
    post_init = getattr(cls, "__post_init__", None)
    if post_init is None:
        return {}
    made: list[Any] = []

    def counted(self: Any) -> None:
        made.append(self)
        post_init(self)

    cls.__post_init__ = counted
    try:
        prepared = contender.prepare(batch)
        packed_ids, params = contender.preprocess(batch, prepared)
        contender.postprocess(batch, params, model_outputs(packed_ids))
    finally:
        cls.__post_init__ = post_init
    if not made:
        return {"post_init_calls": 0, "post_init_us": 0.0}
    runs = []
    for _ in range(50):
        begin = time.perf_counter()
        post_init(made[0])
        runs.append((time.perf_counter() - begin) * 1e6)
    return {"post_init_calls": len(made), "post_init_us": statistics.median(runs)}


def measure_point(
    contenders: dict[str, Any], batch_size: int, seq_len: int, settings: BenchSettings
) -> dict[str, dict[str, Any]]:
    """``{contender: {timings (medians), counts}}`` at one (B, S); the same on every rank but rank 0's is kept."""
    names = list(contenders)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    real_tokens = []

    def new_batch(index: int) -> Any:
        batch = micro_batch(batch_size, seq_len, seed=batch_seed(batch_size, seq_len, index), device=settings.device)
        real_tokens.append(int(batch.attention_mask.sum()))
        return EngineMicroBatch.of(batch) if settings.functions == "engine" else batch

    for index in range(settings.warmup + settings.repeats):
        base = new_batch(index)
        order = names[index % len(names) :] + names[: index % len(names)]
        for name in order:
            times = _time_unit(contenders[name], base.clone())  # new tensors for every contender
            if index >= settings.warmup:
                samples[name].append(times)
        del base
    counted_batch = new_batch(settings.warmup + settings.repeats)
    point: dict[str, dict[str, Any]] = {}
    for name in names:
        keys = samples[name][0].keys()
        point[name] = {key: statistics.median(sample[key] for sample in samples[name]) for key in keys}
        for stage in ("preprocess", "postprocess"):
            point[name][f"{stage}_spread"] = spread([sample[f"{stage}_ms"] for sample in samples[name]])
        point[name].update(_count_unit(contenders[name], counted_batch.clone()))
    point["verl_cppack"].update(post_init_cost(contenders["verl_cppack"], counted_batch.clone()))
    point["batch"] = {"mean_real_tokens": statistics.mean(real_tokens[settings.warmup : -1])}  # the timed ones
    return point


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
    functions, floor = (EngineFunctions, EngineFloor) if settings.functions == "engine" else (UtilFunctions, Floor)
    contenders = {
        "verl": functions(verl_util),
        "verl_cppack": functions(ours),
        "floor": floor(verl_util, parallel_state.get_context_parallel_group(), cp_size, rank),
    }
    rows = []
    try:
        for seq_len in settings.seq_lens:
            for batch_size in settings.batch_sizes:
                point = measure_point(contenders, batch_size, seq_len, settings)
                row = {"batch_size": batch_size, "seq_len": seq_len, "cp_size": cp_size, **point}
                row["functions"] = settings.functions
                if cp_size == 1:  # the builders communicate nothing: CP only rounds their rows
                    row["vlm_masks"] = measure_vlm_masks(
                        verl_util, ours, batch_size, seq_len, settings.repeats, settings.warmup, settings.device
                    )
                rows.append(row)
        return rows if rank == 0 else []
    finally:
        parallel_state.destroy_model_parallel()


def run_benchmark(settings: BenchSettings) -> list[dict[str, Any]]:
    """Every point of the grid, each measured in ``settings.runs`` fresh process groups; rows ordered CP, S, B."""
    settings.check()
    backend = "nccl" if settings.device == "cuda" else "gloo"
    rows: list[dict[str, Any]] = []
    for cp_size in settings.cp_sizes:
        runs = [
            run_world(_rank, cp_size, settings, backend=backend, torch_threads=settings.threads)[0]
            for _ in range(settings.runs)
        ]
        rows.extend(median_over_runs(point_runs) for point_runs in zip(*runs))
    return rows


def median_over_runs(point_runs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """One point measured in several runs -> the first run's row with every time the median over the runs (the
    times of one process drift together by up to ±20% on a shared VM; counts and sizes do not change), plus each
    run's own preprocess and postprocess ratios (``ratio_by_run``)."""
    row = {**_medians(point_runs), "runs": len(point_runs)}
    row["ratio_by_run"] = {stage: [ratios(run)[stage] for run in point_runs] for stage in ("preprocess", "postprocess")}
    return row


def _medians(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The first run's dict, nested ones alike, with every time (``ms``, ``*_ms``, and the ``*_spread`` that
    ``targets.py`` allows as noise) the median over ``runs``."""
    return {
        key: _medians([run[key] for run in runs])
        if isinstance(value, dict)
        else statistics.median(run[key] for run in runs)
        if key == "ms" or key.endswith(("_ms", "_spread"))
        else value
        for key, value in runs[0].items()
    }
