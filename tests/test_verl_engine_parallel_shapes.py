"""verl's Megatron engine at (TP2, CP2) and (DP2, CP2) equals (TP1, CP1, DP1) on one global batch, without Ray.

Each shape runs in real gloo processes (4 ranks, 1 for the reference shape) with ``VERL_PLATFORM=cpu`` and the
plugin, as ``test_verl_engine_cpu.py`` does at CP=1/2. The global batch is what verl's trainer holds after rollout
(left-padded prompts, right-padded responses, one padding width for all rows); verl's trainer hands each
data-parallel rank a contiguous share of its rows, so the two DP ranks see different masks. Specified:

- per-token log-probs of the response tokens (``infer_batch``, the reference worker's path), DP shares put back in
  order: equal to the single rank's within 1e-5;
- one ``train_batch`` with verl's ``ppo_loss`` (token-mean, low-variance KL): the loss (verl reports each DP rank's
  share scaled by the DP size, so their mean is the global loss) and the grad norm (global: after the DP
  all-reduce) equal the single rank's within 1e-5 relative;
- the drop-ins ran in every rank, and the engine took the asked TP/CP/DP sizes.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("verl")
pytest.importorskip("mbridge")
pytestmark = pytest.mark.slow  # 9 gloo processes building verl's engine, minutes

from tests.distributed import run_gloo  # noqa: E402
from tests.verl_engine_cases import TINY  # noqa: E402
from verl_cppack.jobs.counting_task import ensure_counting_assets  # noqa: E402

RELATIVE_TOLERANCE = 1e-5
LOG_PROB_TOLERANCE = 1e-5
KL_COEF, REF_OFFSET = 0.1, 0.05
# (prompt, response) token ids: 8 rows, so each of 2 DP ranks gets 4 with their own lengths; a one-token response,
# a two-token sequence (shorter than a TP2 x CP2 slot of 8), prompts of one and of six tokens.
GLOBAL_BATCH = (
    ([5, 6, 7], [8, 9, 10, 11]),
    ([2], [3, 4]),
    ([12, 13, 14, 15, 16, 17], [1]),
    ([4, 4, 9, 2], [7, 7, 7, 7, 7]),
    ([9], [10]),
    ([3, 3], [4, 5, 6]),
    ([11, 12, 13, 14, 15], [16, 17, 2, 3, 4]),
    ([6, 7, 8, 9], [10, 11]),
)
ADVANTAGES = (1.0, -1.0, 1.0, -0.5, 2.0, 0.5, -2.0, 1.5)
SHAPES = {"TP1 CP1 DP1": (1, 1, 1), "TP2 CP2": (2, 2, 1), "DP2 CP2": (1, 2, 2)}  # (tp, cp, dp)


def run_shape(rank: int, world_size: int, model_path: str, tp: int, cp: int, count_dir: str) -> dict:
    """One gloo rank: verl's engine at (tp, cp, world/(tp*cp)); this DP rank's share of the global batch through
    ``infer_batch`` (log-probs) and one ``train_batch`` with verl's ``ppo_loss``."""
    os.environ["VERL_PLATFORM"] = "cpu"  # before verl is imported
    os.environ["VERL_CPPACK_CALL_COUNT_DIR"] = count_dir
    from functools import partial

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from verl.workers.config import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss

    import verl_cppack.jobs.call_counts  # noqa: F401 - counts the drop-in calls
    import verl_cppack.verl_plugin  # noqa: F401 - the drop-ins and the CPU fixes
    from verl_cppack.runtime.megatron_engine import (
        EngineSettings,
        build_megatron_engine,
        engine_batch,
        response_log_probs,
        rollout_tensors,
    )

    dp = world_size // (tp * cp)
    rows = len(GLOBAL_BATCH) // dp
    built = build_megatron_engine(
        EngineSettings(
            model_path,
            context_parallel_size=cp,
            tensor_model_parallel_size=tp,
            micro_batch_size=rows,
            learning_rate=1e-2,
            clip_grad=1.0,
            total_training_steps=1,
        )
    )
    dp_rank = mpu.get_data_parallel_rank()
    share = slice(dp_rank * rows, (dp_rank + 1) * rows)
    tensors = {key: value[share] for key, value in rollout_tensors(GLOBAL_BATCH).items()}  # global padding widths

    log_probs = response_log_probs(built, tensors, micro_batch_size=rows)
    # Old log-probs = these log-probs, on every rank of this DP share (only the rank with outputs has them).
    old_log_probs = log_probs if built.has_outputs else torch.zeros_like(tensors["responses"], dtype=torch.float32)
    dist.all_reduce(old_log_probs, group=mpu.get_tensor_and_context_parallel_group())
    response_mask = tensors["response_mask"].float()
    advantages = torch.tensor(ADVANTAGES)[share, None] * response_mask
    extra = {"old_log_probs": old_log_probs, "ref_log_prob": old_log_probs - REF_OFFSET, "advantages": advantages}
    data = engine_batch(
        {**tensors, **extra},
        rows,
        calculate_entropy=False,
        compute_loss=True,
        global_batch_size=len(GLOBAL_BATCH),
        distillation_use_topk=False,
        distillation_only=False,
    )
    actor_config = McoreActorConfig(
        strategy="megatron",
        rollout_n=1,
        ppo_mini_batch_size=len(GLOBAL_BATCH),
        ppo_micro_batch_size_per_gpu=rows,
        use_kl_loss=True,
        kl_loss_type="low_var_kl",
        kl_loss_coef=KL_COEF,
        megatron=built.engine_config,
        optim=built.optimizer_config,
    )
    with built.engine.train_mode():
        result = built.engine.train_batch(data, loss_function=partial(ppo_loss, config=actor_config))
    return {
        "sizes": (
            mpu.get_tensor_model_parallel_world_size(),
            mpu.get_context_parallel_world_size(),
            mpu.get_data_parallel_world_size(),
        ),
        "dp_rank": dp_rank,
        "has_outputs": built.has_outputs,
        "log_probs": log_probs,
        "loss": sum(result["loss"]) if built.has_outputs else None,
        "grad_norm": float(result["metrics"]["grad_norm"]) if built.has_outputs else None,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Per shape: every rank's results and the drop-in calls counted in its processes."""
    from verl_cppack.jobs.call_counts import read_call_counts

    model_path = str(ensure_counting_assets(TINY, root=tmp_path_factory.mktemp("counting")).model)
    results = {}
    for name, (tp, cp, dp) in SHAPES.items():
        count_dir = tmp_path_factory.mktemp("calls")
        ranks = run_gloo(run_shape, tp * cp * dp, model_path, tp, cp, str(count_dir))
        results[name] = {"ranks": ranks, "calls": read_call_counts(count_dir), "shape": (tp, cp, dp)}
    return results


def with_outputs(run: dict) -> list[dict]:
    """The ranks that receive the outputs (TP rank 0, CP rank 0), one per DP share, in DP order."""
    ranks = sorted((rank for rank in run["ranks"] if rank["has_outputs"]), key=lambda rank: rank["dp_rank"])
    assert [rank["dp_rank"] for rank in ranks] == list(range(run["shape"][2]))
    return ranks


def test_every_rank_runs_at_the_asked_shape_with_the_dropins(runs):
    for name, run in runs.items():
        assert {rank["sizes"] for rank in run["ranks"]} == {run["shape"]}, name
        tp, cp, dp = run["shape"]
        assert run["calls"].get("preprocess_thd_engine", 0) >= 2 * tp * cp * dp, (name, run["calls"])
        assert run["calls"].get("postprocess_thd_engine", 0) >= 2 * tp * cp * dp, (name, run["calls"])


@pytest.mark.parametrize("name", ["TP2 CP2", "DP2 CP2"])
def test_log_probs_equal_the_single_rank(runs, name):
    expected = with_outputs(runs["TP1 CP1 DP1"])[0]["log_probs"]
    got = torch.cat([rank["log_probs"] for rank in with_outputs(runs[name])], dim=0)
    assert got.shape == expected.shape == (len(GLOBAL_BATCH), max(len(r) for _, r in GLOBAL_BATCH))
    torch.testing.assert_close(got, expected, rtol=0, atol=LOG_PROB_TOLERANCE)
    assert (expected != 0).sum() == sum(len(response) for _, response in GLOBAL_BATCH)


@pytest.mark.parametrize("name", ["TP2 CP2", "DP2 CP2"])
def test_one_training_step_gives_the_single_ranks_loss_and_grad_norm(runs, name):
    reference = with_outputs(runs["TP1 CP1 DP1"])[0]
    shares = with_outputs(runs[name])
    loss = sum(rank["loss"] for rank in shares) / len(shares)
    assert loss == pytest.approx(reference["loss"], rel=RELATIVE_TOLERANCE)
    for rank in shares:
        assert rank["grad_norm"] == pytest.approx(reference["grad_norm"], rel=RELATIVE_TOLERANCE)
    assert reference["grad_norm"] > 0
