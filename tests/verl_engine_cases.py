"""What the two engine-on-the-host tests share: the tiny model, the rollout samples and tolerances, and the runs.

``test_verl_engine_cpu.py`` (verl's policy engine) and ``test_verl_critic_engine_cpu.py`` (verl's critic engine)
build verl's Megatron engine in real gloo processes at CP=1 and CP=2 on the same tiny model and batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import run_gloo
from verl_cppack.jobs.counting_task import CountingAssets, ensure_counting_assets

for _module in ("megatron.core", "verl", "mbridge"):  # what verl's Megatron engine needs: a test without them skips
    pytest.importorskip(_module)

TOLERANCE = 1e-5
GRAD_NORM_RELATIVE_TOLERANCE = 1e-4

# Small enough for two cores; 2 layers so layer-to-layer state (RoPE, attention) is exercised.
TINY = CountingAssets(
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    train_prompts=4,
    test_prompts=4,
)

# (prompt, response) token ids; verl's rollout batch left-pads prompts to the longest (6) and right-pads responses
# to the longest (5). Responses of one and of full length, prompts of one and of full length, a two-token sequence.
PROMPT_LENGTH, RESPONSE_LENGTH = 6, 5
SAMPLES = (
    ([5, 6, 7], [8, 9, 10, 11]),
    ([2], [3, 4]),
    ([12, 13, 14, 15, 16, 17], [1]),
    ([4, 4, 9, 2], [7, 7, 7, 7, 7]),
    ([9], [10]),  # two tokens in all: shorter than one CP=2 slot (4)
)


def run_at_cp_1_and_2(worker: Callable[..., dict], model_path: str, count_root: Path) -> dict[int, dict]:
    """Per CP size: rank 0's results (the rank with outputs), every rank's results (``all_ranks``) and the drop-in
    call counts of every process, by function (``calls``) and by engine role (``roles``).

    ``worker(rank, world_size, model_path, context_parallel_size, count_dir)`` runs in each gloo process."""
    from verl_cppack.jobs.call_counts import read_call_counts

    results = {}
    for context_parallel_size in (1, 2):
        count_dir = count_root / f"calls_cp{context_parallel_size}"
        count_dir.mkdir()
        ranks = run_gloo(worker, context_parallel_size, model_path, context_parallel_size, str(count_dir))
        results[context_parallel_size] = {
            **ranks[0],
            "all_ranks": ranks,
            "calls": read_call_counts(count_dir),
            "roles": read_call_counts(count_dir, "roles"),
        }
    return results


def build_engine(model_path: str, context_parallel_size: int, count_dir: str, **settings: Any) -> Any:
    """In a gloo rank: ``VERL_PLATFORM=cpu`` and the call-count directory set before verl is imported, the plugin (the
    drop-ins and the CPU fixes) and the call counter imported, then verl's engine taking every sample in one
    micro-batch (``runtime.megatron_engine.build_megatron_engine``)."""
    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ["VERL_CPPACK_CALL_COUNT_DIR"] = count_dir  # read before the drop-ins are installed
    import verl_cppack.jobs.call_counts  # noqa: F401 - counts the drop-in calls
    import verl_cppack.verl_plugin  # noqa: F401 - verl_cppack's drop-ins + the CPU fixes
    from verl_cppack.runtime.megatron_engine import EngineSettings, build_megatron_engine

    settings = dict(micro_batch_size=len(SAMPLES), learning_rate=1e-2, clip_grad=1.0, total_training_steps=1) | settings
    return build_megatron_engine(EngineSettings(model_path, context_parallel_size=context_parallel_size, **settings))


def from_rank_with_outputs(built: Any, outputs: Any) -> Any:
    """What the trainer sends every rank: the outputs of the rank that has them, ``[B, R]``."""
    import torch

    shared = outputs if built.has_outputs else torch.zeros(len(SAMPLES), RESPONSE_LENGTH)
    torch.distributed.broadcast(shared, src=0)
    return shared


def engine_fixtures(worker: Callable[..., dict]) -> tuple[Any, Any]:
    """An engine test's module fixtures: ``model_path`` (the tiny model) and ``runs`` (``run_at_cp_1_and_2(worker)``)."""

    @pytest.fixture(scope="module")
    def model_path(tmp_path_factory) -> str:
        return str(ensure_counting_assets(TINY, root=tmp_path_factory.mktemp("counting")).model)

    @pytest.fixture(scope="module")
    def runs(model_path, tmp_path_factory) -> dict[int, dict]:
        return run_at_cp_1_and_2(worker, model_path, tmp_path_factory.mktemp("calls"))

    return model_path, runs
