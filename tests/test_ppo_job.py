"""PPO through verl's own trainer with a Megatron critic: actor, reference and critic at CP=2 with verl_cppack on.

One real two-step run (Ray, verl's workers, three Megatron engines, the Hugging Face rollout): verl's critic
metrics are logged and finite, the critic's forward and backward went through verl_cppack's drop-ins (calls
counted in the workers, told apart by the engine that made them), and the actor's packed CP=2 log-probs equal
the rollout's.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytest.importorskip("verl")
pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # verl's trainer, minutes per run

CRITIC_METRICS = {"critic/vf_loss", "critic/vf_explained_var", "critic/values/mean", "critic/returns/mean"}


def test_two_ppo_steps_with_a_megatron_critic_at_cp2(tmp_path):
    output = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl_cppack.cli",
            "ppo",
            "--rollout",
            "hf",  # the test is about the critic
            "--steps",
            "2",
            "--output",
            str(output),
            "trainer.critic_warmup=2",
        ],  # verl skips the actor while critic_warmup > step: step 1 critic only
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((output / "summary.json").read_text())
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2]
    for record in records:
        assert set(record) >= CRITIC_METRICS
        assert all(math.isfinite(record[name]) for name in CRITIC_METRICS)
        assert record["training/rollout_probs_diff_max"] <= 1e-4
    assert "actor/pg_loss" not in records[0] and "actor/pg_loss" in records[1]  # critic warm-up, then both
    assert summary["job"] == "ppo" and summary["critic_cp"] == 2
    assert summary["dropin_calls_by_role"]["critic"] > 0 and summary["dropin_calls_by_role"]["policy"] > 0
    assert summary["explained_variance_last_fifth"] is not None
    assert {"reward_curve.png", "critic_curve.png"} <= {path.name for path in output.iterdir()}
