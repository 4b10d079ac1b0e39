"""verl's Megatron critic engine on the host, without Ray: values and one value-loss step, CP=2 == CP=1.

The engine is verl's ``MegatronEngineWithValueHead``, built as the trainer's critic ``TrainingWorkerConfig``
asks (``model_type="value_model"``, ``EngineRegistry.new``) by ``verl_cppack.runtime.megatron_engine``, in real
gloo processes with ``VERL_PLATFORM=cpu`` set before verl is imported and ``verl_cppack.verl_plugin`` imported.
Values go the trainer's ``_compute_values`` path: ``left_right_2_no_padding`` -> ``infer_batch`` (``compute_loss``
off) -> ``values`` -> ``no_padding_2_padding`` -> ``float()``. verl defines the value of response token t as the
head's output at the token before it (position prompt_len + t - 1: the same one-token shift as log-probs), and
``no_padding_2_padding`` fills response padding with 0.

The value head (mbridge's ``LinearForLastLayer``, hidden -> 1) is not in the HF checkpoint: it is a fresh
``torch.nn.Linear`` drawn from torch's RNG after verl's ``set_random_seed(engine seed)``. The test checks that it
comes out bit-identical on every rank and at both CP sizes before comparing values.

Specified:
- the engine is the critic: its output layer is the scalar head, values are ``[B, R]``, finite, zero at padding;
- values equal the Hugging Face ``LlamaModel``'s last hidden state times the engine's head (<= 1e-5), and CP=2
  values equal CP=1's (<= 1e-5), including a one-token response and a two-token sequence;
- verl called verl_cppack's drop-ins from the critic engine (role ``critic`` counted);
- one ``train_batch`` with verl's ``value_loss`` gives 0.5 * token-mean((value - return)^2) and the same grad
  norm at CP=2 as at CP=1 (<= 1e-4 relative).
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.verl_engine_cases import (  # noqa: E402
    GRAD_NORM_RELATIVE_TOLERANCE,
    RESPONSE_LENGTH,
    SAMPLES,
    TINY,
    TOLERANCE,
    build_engine,
    engine_fixtures,
    from_rank_with_outputs,
)

pytestmark = pytest.mark.slow  # verl's Megatron engine in gloo processes

RETURN_OFFSETS = (0.3, -0.2, 0.1, -0.4, 0.25)  # returns = values + offset (per sample), inside cliprange 0.5


def run_critic(rank: int, world_size: int, model_path: str, context_parallel_size: int, count_dir: str) -> dict:
    """One gloo rank: build verl's critic engine, compute values as ``_compute_values`` does, then one
    ``train_batch`` with verl's ``value_loss`` as ``_update_critic`` -> ``train_mini_batch`` does."""
    built = build_engine(model_path, context_parallel_size, count_dir, model_type="value_model")
    from functools import partial

    from megatron.core import parallel_state as mpu
    from verl.utils.megatron_utils import unwrap_model
    from verl.workers.config import McoreCriticConfig
    from verl.workers.utils.losses import value_loss

    from verl_cppack.runtime.megatron_engine import engine_batch, response_values, rollout_tensors

    batch_size = len(SAMPLES)
    engine, outputs = built.engine, built.has_outputs
    model = unwrap_model(engine.module[0])
    head = model.output_layer.weight.detach().clone()
    tensors = rollout_tensors(SAMPLES)

    # _compute_values -> TrainingWorker.infer_batch
    values = response_values(built, tensors, micro_batch_size=batch_size)

    # _update_critic -> train_mini_batch -> TrainingWorker.train_batch, one mini-batch
    old_values = from_rank_with_outputs(built, values)
    response_mask = tensors["response_mask"].float()
    returns = (old_values + torch.tensor(RETURN_OFFSETS)[:, None]) * response_mask
    critic_config = McoreCriticConfig(
        strategy="megatron",
        ppo_mini_batch_size=batch_size,
        ppo_micro_batch_size_per_gpu=batch_size,
        megatron=built.engine_config,
        optim=built.optimizer_config,
    )
    data = engine_batch(
        {**tensors, "values": old_values, "returns": returns},
        batch_size,
        compute_loss=True,
        global_batch_size=batch_size,
    )
    with engine.train_mode():
        result = engine.train_batch(data, loss_function=partial(value_loss, config=critic_config))
    return {
        "cp_world_size": mpu.get_context_parallel_world_size(),
        "engine": type(engine).__name__,
        "head": head,
        "head_type": type(model.output_layer).__name__,
        "values": values,
        "loss": result["loss"] if outputs else None,
        "grad_norm": float(result["metrics"]["grad_norm"]) if outputs else None,
    }


model_path, runs = engine_fixtures(run_critic)


def hf_values(model_path: str, head: torch.Tensor) -> torch.Tensor:
    """Reference: the HF ``LlamaModel``'s final hidden states (after the last norm) times ``head`` [1, hidden],
    one unpadded forward per sample, taken at positions prompt_len - 1 .. len - 2 (verl's shift), zero at
    response padding. [batch, RESPONSE_LENGTH]"""
    model = transformers.LlamaModel.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    expected = torch.zeros(len(SAMPLES), RESPONSE_LENGTH)
    with torch.no_grad():
        for row, (prompt, response) in enumerate(SAMPLES):
            hidden = model(input_ids=torch.tensor([prompt + response])).last_hidden_state[0]  # [T, hidden]
            expected[row, : len(response)] = (hidden[len(prompt) - 1 : -1] @ head.T)[:, 0]
    return expected


def test_engine_is_verls_critic_with_a_scalar_value_head_seeded_alike(runs):
    """``model_type="value_model"`` builds ``MegatronEngineWithValueHead`` at the asked CP size; its output layer is
    a hidden -> 1 linear head, bit-identical on every rank and at CP=1 and CP=2 (same seed, same draws)."""
    reference = runs[1]["head"]
    assert reference.shape == (1, TINY.hidden_size)
    assert reference.abs().sum() > 0
    for context_parallel_size, run in runs.items():
        for rank in run["all_ranks"]:
            assert rank["engine"] == "MegatronEngineWithValueHead"
            assert rank["head_type"] == "LinearForLastLayer"
            assert rank["cp_world_size"] == context_parallel_size
            assert torch.equal(rank["head"], reference), context_parallel_size


def test_values_at_cp2_equal_cp1_and_the_hugging_face_hidden_states_times_the_head(runs, model_path):
    """Values ``[B, R]`` float32, finite, zero exactly at response padding and non-zero at real tokens;
    CP=2 == CP=1 == HF final hidden state @ head at verl's shifted positions (<= 1e-5), including a one-token
    response and a two-token sequence; only rank 0 (CP rank 0) gets them."""
    cp1, cp2 = runs[1]["values"], runs[2]["values"]
    assert runs[2]["all_ranks"][1]["values"] is None
    assert cp1.shape == cp2.shape == (len(SAMPLES), RESPONSE_LENGTH)
    assert cp1.dtype == cp2.dtype == torch.float32
    assert torch.isfinite(cp1).all() and torch.isfinite(cp2).all()
    real = torch.zeros(len(SAMPLES), RESPONSE_LENGTH, dtype=torch.bool)
    for row, (_, response) in enumerate(SAMPLES):
        real[row, : len(response)] = True
    for values in (cp1, cp2):
        assert (values[~real] == 0).all()
        assert (values[real] != 0).all()
    torch.testing.assert_close(cp2, cp1, rtol=0, atol=TOLERANCE)
    expected = hf_values(model_path, runs[1]["head"])
    torch.testing.assert_close(cp1, expected, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(cp2, expected, rtol=0, atol=TOLERANCE)


def test_verl_called_verl_cppack_dropins_from_the_critic(runs):
    """The critic engine's forward and training step went through verl_cppack's THD drop-ins: every call was
    counted under role ``critic`` (no policy engine exists here), at least once per CP rank per pass."""
    for context_parallel_size, run in runs.items():
        roles, calls = run["roles"], run["calls"]
        assert roles.get("critic", 0) >= 2 * 2 * context_parallel_size, roles  # pre + post, infer + train
        assert roles.get("policy", 0) == 0, roles
        assert calls.get("preprocess_thd_engine", 0) >= 2 * context_parallel_size, calls
        assert calls.get("postprocess_thd_engine", 0) >= 2 * context_parallel_size, calls


def test_one_train_batch_step_with_value_loss(runs):
    """One ``train_batch`` with verl's ``value_loss`` (old values = current ones, returns offset per sample inside
    the clip range): the loss is 0.5 * token-mean(offset^2), the grad norm is finite and positive, and CP=2 gives
    CP=1's loss and grad norm (<= 1e-4 relative)."""
    lengths = [len(response) for _, response in SAMPLES]
    expected_loss = 0.5 * sum(o * o * n for o, n in zip(RETURN_OFFSETS, lengths)) / sum(lengths)
    for run in runs.values():
        assert sum(run["loss"]) == pytest.approx(expected_loss, abs=1e-6)
        assert math.isfinite(run["grad_norm"]) and run["grad_norm"] > 0
    assert runs[2]["grad_norm"] == pytest.approx(runs[1]["grad_norm"], rel=GRAD_NORM_RELATIVE_TOLERANCE)
    assert sum(runs[2]["loss"]) == pytest.approx(sum(runs[1]["loss"]), abs=1e-7)


def test_engine_settings_accept_only_verls_model_types():
    """``EngineSettings.model_type`` is verl's registry key: ``language_model`` by default, ``value_model`` for the
    critic; anything else is refused before verl is touched."""
    from verl_cppack.runtime.megatron_engine import EngineSettings

    assert EngineSettings("model").model_type == "language_model"
    assert EngineSettings("model", model_type="value_model").model_type == "value_model"
    with pytest.raises(ValueError, match="model_type"):
        EngineSettings("model", model_type="critic")
