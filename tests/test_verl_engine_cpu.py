"""verl's own Megatron engine on the host, without Ray: log-probs and one training step with the plugin.

The engine is built exactly as verl's ``TrainingWorker.__init__`` builds it (``EngineRegistry.new`` with
``HFModelConfig`` / ``McoreEngineConfig`` / ``McoreOptimizerConfig`` / ``CheckpointConfig``), with the CPU
settings of docs/design.md ("verl's own trainer on CPU", the config knobs), in real gloo processes with ``VERL_PLATFORM=cpu`` set
before verl is imported and ``verl_cppack.verl_plugin`` imported (verl_cppack's drop-ins plus the CPU fixes).
The engine initialises Megatron's parallel state itself (``MegatronEngine._init_device_mesh``).

The batch is what verl's trainer sends to ``compute_log_prob`` / ``update_actor``: left-padded prompts,
right-padded responses of varying lengths (one of a single token), converted by verl's
``left_right_2_no_padding``. Log-probs come back through verl's ``no_padding_2_padding``. Engine, batch and
log-prob pass are ``verl_cppack.runtime.megatron_engine``'s (what ``verl-cppack ref-logprobs`` runs).

Specified:
- the engine's log-probs at CP=2 equal those at CP=1, and both equal ``log_softmax`` of the Hugging Face
  ``LlamaForCausalLM`` logits at the response tokens (float32, <= 1e-5);
- verl resolved ``preprocess_thd_engine`` / ``postprocess_thd_engine`` to verl_cppack's drop-ins (counted);
- one ``train_batch`` step with verl's ``ppo_loss`` (low-variance KL on) gives a finite loss and grad norm,
  changes the weights, and the grad norm at CP=2 equals the one at CP=1.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.stacks import STACK  # noqa: E402
from tests.verl_engine_cases import (  # noqa: E402
    GRAD_NORM_RELATIVE_TOLERANCE,
    RESPONSE_LENGTH,
    SAMPLES,
    TOLERANCE,
    build_engine,
    engine_fixtures,
    from_rank_with_outputs,
)

pytestmark = [pytest.mark.slow, pytest.mark.stacks]  # verl's Megatron engine in gloo processes, on both stacks


# what builds the model: Megatron-Bridge where it is installed (the current stack: verl's default), else mbridge
MODEL_BUILDER_FIXES = (
    ("transformer-engine-stand-in", "bridge-local-layer-spec")
    if STACK == "current"
    else ("local-layer-spec", "local-layernorm-names")
)


def hf_response_log_probs(model_path: str) -> torch.Tensor:
    """Reference: ``log_softmax`` of the Hugging Face model's logits at each response token, one unpadded
    forward per sample, zero at response padding. [batch, RESPONSE_LENGTH]"""
    model = transformers.LlamaForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    expected = torch.zeros(len(SAMPLES), RESPONSE_LENGTH)
    with torch.no_grad():
        for row, (prompt, response) in enumerate(SAMPLES):
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
            log_probs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
            expected[row, : len(response)] = log_probs.gather(1, torch.tensor(response)[:, None])[:, 0]
    return expected


KL_COEF, REF_OFFSET = 0.1, 0.05  # reference log-probs = old log-probs - REF_OFFSET
ADVANTAGES = (1.0, -1.0, 1.0, -0.5, 2.0)  # one per sample, the same at every response token


def run_engine(rank: int, world_size: int, model_path: str, context_parallel_size: int, count_dir: str) -> dict:
    """One gloo rank: build verl's Megatron engine as ``TrainingWorker`` does, compute log-probs as the
    trainer's ``_compute_ref_log_prob`` -> ``TrainingWorker.infer_batch`` does, then one ``train_batch``
    with verl's ``ppo_loss`` as ``_update_actor`` -> ``train_mini_batch`` -> ``train_batch`` does."""
    built = build_engine(model_path, context_parallel_size, count_dir)
    from functools import partial

    from megatron.core import parallel_state as mpu
    from verl.workers.config import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss

    import verl_cppack.verl_plugin as plugin
    from verl_cppack import runtime
    from verl_cppack.runtime.megatron_engine import engine_batch, response_log_probs, rollout_tensors

    batch_size = len(SAMPLES)
    engine, outputs = built.engine, built.has_outputs
    actor_config = McoreActorConfig(
        strategy="megatron",
        rollout_n=1,
        ppo_mini_batch_size=batch_size,
        ppo_micro_batch_size_per_gpu=batch_size,
        use_kl_loss=True,
        kl_loss_type="low_var_kl",
        kl_loss_coef=KL_COEF,
        megatron=built.engine_config,
        optim=built.optimizer_config,
    )
    attention = engine.module[0].module.decoder.layers[0].self_attention.core_attention
    tensors = rollout_tensors(SAMPLES)

    # _compute_ref_log_prob -> compute_ref_log_prob -> TrainingWorker.infer_batch
    log_probs = response_log_probs(built, tensors, micro_batch_size=batch_size)

    # _update_actor -> update_actor -> train_mini_batch -> TrainingWorker.train_batch, one mini-batch
    old_log_probs = from_rank_with_outputs(built, log_probs)
    response_mask = tensors["response_mask"].float()
    advantages = torch.tensor(ADVANTAGES)[:, None] * response_mask
    extra = {"old_log_probs": old_log_probs, "ref_log_prob": old_log_probs - REF_OFFSET, "advantages": advantages}
    data = engine_batch(
        {**tensors, **extra},
        batch_size,
        calculate_entropy=False,
        compute_loss=True,
        global_batch_size=batch_size,
        distillation_use_topk=False,
        distillation_only=False,
    )
    before = [parameter.detach().clone() for parameter in engine.module[0].parameters()]
    with engine.train_mode():
        result = engine.train_batch(data, loss_function=partial(ppo_loss, config=actor_config))
    after = [parameter.detach() for parameter in engine.module[0].parameters()]
    return {
        "cp_world_size": mpu.get_context_parallel_world_size(),
        "plugin": (plugin.INSTALLED, plugin.CPU_SUPPORT),
        "fixes": {status.fix.name: status.state for status in runtime.report()},
        "core_attention": f"{type(attention).__module__}.{type(attention).__name__}",
        "log_probs": log_probs,
        "loss": result["loss"] if outputs else None,
        "grad_norm": float(result["metrics"]["grad_norm"]) if outputs else None,
        "largest_weight_change": max((a - b).abs().max().item() for a, b in zip(after, before, strict=True)),
        "unchanged_parameters": sum(bool(torch.equal(a, b)) for a, b in zip(after, before, strict=True)),
    }


model_path, runs = engine_fixtures(run_engine)


def test_engine_runs_on_the_host_with_the_plugin_and_every_cpu_fix_applied(runs):
    """Built through verl's registry with ``VERL_PLATFORM=cpu``: the plugin installed verl_cppack's drop-ins and
    armed the CPU fixes; every fix whose module verl loaded was applied (none refused); the engine initialised
    Megatron with the asked CP size; attention is verl_cppack's core attention (local spec, no TE)."""
    for context_parallel_size, run in runs.items():
        for rank in run["all_ranks"]:
            assert rank["plugin"] == (True, True)
            assert rank["cp_world_size"] == context_parallel_size
            assert "refused" not in rank["fixes"].values(), rank["fixes"]
            for name in (
                "cpu-platform",
                "float32-engine-config",
                "megatron-engine-on-cpu",
                "clip-grads-on-host",
                *MODEL_BUILDER_FIXES,
            ):
                assert rank["fixes"][name] == "applied", (name, rank["fixes"])
            assert rank["core_attention"].startswith("verl_cppack.attention."), rank["core_attention"]


def test_log_probs_at_cp2_equal_cp1_and_the_hugging_face_model(runs, model_path):
    """Packed THD log-probs of the response tokens from verl's engine: CP=2 == CP=1 == log_softmax of
    ``LlamaForCausalLM`` logits (float32, <= 1e-5), including a one-token response and a two-token sequence;
    response padding is zero."""
    expected = hf_response_log_probs(model_path)
    cp1, cp2 = runs[1]["log_probs"], runs[2]["log_probs"]
    assert cp1.shape == cp2.shape == expected.shape == (len(SAMPLES), RESPONSE_LENGTH)
    torch.testing.assert_close(cp2, cp1, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(cp1, expected, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(cp2, expected, rtol=0, atol=TOLERANCE)
    assert (expected != 0).sum() == sum(len(response) for _, response in SAMPLES)  # no real token was zero


def test_verl_called_verl_cppack_dropins(runs):
    """verl's engine resolved ``preprocess_thd_engine`` / ``postprocess_thd_engine`` to verl_cppack's drop-ins:
    each CP rank calls them for the log-prob pass and the training step."""
    for context_parallel_size, run in runs.items():
        calls = run["calls"]
        assert calls.get("preprocess_thd_engine", 0) >= 2 * context_parallel_size, calls
        assert calls.get("postprocess_thd_engine", 0) >= 2 * context_parallel_size, calls


def test_one_train_batch_step_with_ppo_loss(runs):
    """One ``train_batch`` with verl's ``ppo_loss`` (old log-probs = current ones, so the ratio is 1; low-variance
    KL against reference log-probs 0.05 lower): the loss is -token-mean(advantage) + coef * low_var_kl(-0.05),
    the grad norm is finite and positive, every parameter moved (Adam's first step is about lr), and CP=2 gives
    CP=1's loss and grad norm (<= 1e-4 relative)."""
    response_lengths = [len(response) for _, response in SAMPLES]
    token_mean_advantage = sum(a * n for a, n in zip(ADVANTAGES, response_lengths)) / sum(response_lengths)
    kl = -REF_OFFSET  # ref - log_prob
    low_var_kl = math.exp(kl) - kl - 1
    expected_loss = -token_mean_advantage + KL_COEF * low_var_kl
    for run in runs.values():
        assert sum(run["loss"]) == pytest.approx(expected_loss, abs=1e-6)
        assert math.isfinite(run["grad_norm"]) and run["grad_norm"] > 0
        for rank in run["all_ranks"]:
            assert rank["unchanged_parameters"] == 0
            assert 0.5e-2 < rank["largest_weight_change"] < 2e-2  # lr = 1e-2
    assert runs[2]["grad_norm"] == pytest.approx(runs[1]["grad_norm"], rel=GRAD_NORM_RELATIVE_TOLERANCE)
    assert sum(runs[2]["loss"]) == pytest.approx(sum(runs[1]["loss"]), abs=1e-7)
