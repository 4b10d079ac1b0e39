"""PPO with a critic on a real local Ray cluster: CP=2 gloo worker actors holding actor, reference and critic."""

from __future__ import annotations

import json
import math

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("megatron.core")
pytest.importorskip("verl")

from verl_cppack.rl.cluster import WorkerGroup  # noqa: E402
from verl_cppack.jobs.output import read_metrics  # noqa: E402
from verl_cppack.rl.ppo_worker import PPOWorker, PPOWorkerSettings  # noqa: E402

REQUIRED_METRICS = {
    "step", "reward_mean", "kl", "value_loss", "explained_variance", "entropy", "tokens", "cp", "time_step_s",
    "time_rollout_s", "time_ref_s", "time_old_s", "time_values_s", "time_update_critic_s", "time_update_actor_s",
}  # fmt: skip


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def test_cli_ppo_short_run_at_cp2_writes_finite_metrics_plots_and_a_summary(ray_cluster, tmp_path, capsys):
    from verl_cppack.cli import main

    argv = ["ppo", "--steps", "3", "--prompts-per-step", "4", "--group-size", "2", "--output", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "3 steps at CP=2" in out and "explained variance" in out
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [record["step"] for record in records] == [0, 1, 2]
    for record in records:
        assert REQUIRED_METRICS <= set(record)
        assert record["cp"] == 2 and record["actor_updated"] is True
        assert all(math.isfinite(value) for value in record.values() if isinstance(value, float))
        assert 0.0 <= record["reward_mean"] <= 1.0 and record["kl"] >= 0.0 and record["value_loss"] >= 0.0
        assert record["response_tokens"] == 8 * 6  # 8 sequences x 6 response tokens
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["job"] == "ppo" and summary["steps"] == 3 and summary["cp"] == 2
    assert "value_model=True" in summary["value_path"] and "patched by verl_cppack" in summary["value_path"]
    assert math.isfinite(summary["final_value_loss"])
    if summary["critic_curve"] is not None:  # matplotlib installed
        assert (tmp_path / "critic_curve.png").stat().st_size > 0 and (tmp_path / "reward_curve.png").exists()


def test_critic_worker_group_fits_fixed_returns_and_rank0_values_match_the_padding(ray_cluster):
    settings = PPOWorkerSettings(critic_learning_rate=1e-2)
    workers = WorkerGroup(2, settings, worker_class=PPOWorker)
    try:
        infos = workers.start(with_policy=True)
        assert [info["cp_size"] for info in infos] == [2, 2]
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, settings.vocab_size, (8, 10), generator=generator)
        attention_mask = torch.ones(8, 10, dtype=torch.bool)
        attention_mask[:4, :3] = False  # left-padded prompts
        attention_mask[2, -2:] = False  # a right-padded response
        loss_mask = torch.zeros_like(attention_mask)
        loss_mask[:, 4:-1] = attention_mask[:, 5:]
        returns = torch.rand(8, 10, generator=generator) * loss_mask

        values, other_rank = workers.call("values", input_ids, attention_mask)
        assert other_rank is None and values.shape == (8, 10)
        assert (values == 0).all()  # the critic starts from a zero value head
        batch = dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask, returns=returns)
        losses = []
        for _ in range(6):
            batch["old_values"] = workers.call("values", input_ids, attention_mask)[0]
            losses.append(workers.call("update_critic", batch, 2)[0]["value_loss"])
        values = workers.call("values", input_ids, attention_mask)[0]
        assert (values[~attention_mask] == 0).all() and (values[attention_mask] != 0).all()
        assert losses[-1] < 0.5 * losses[0], losses
    finally:
        workers.shutdown()
