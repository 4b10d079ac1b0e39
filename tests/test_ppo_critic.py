"""The critic under context parallelism: values and value-loss gradients at CP=1 and CP=2 are the same.

Real gloo processes run the tiny Megatron GPT with a scalar value head on a rollout-shaped batch
(left-padded prompts, right-padded responses), through verl's ``gptmodel_forward_model_engine(value_model=True)``
patched by verl_cppack and through the plan's own packed forward. Under the gather-back contract each rank's
gradient covers its own tokens; summed over the CP group it must equal the CP=1 gradient.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("verl")

from tests.distributed import run_gloo  # noqa: E402
from verl_cppack.rl.critic import clipped_value_loss, explained_variance  # noqa: E402

VOCAB = 16
PATHS = ("verl", "cppack")


def rollout_batch() -> dict[str, torch.Tensor]:
    """8 rows: prompts of 2..6 tokens left-padded to 6, responses of 6 tokens, two of them right-padded."""
    generator = torch.Generator().manual_seed(11)
    prompt_lengths = torch.tensor([2, 6, 3, 5, 4, 6, 2, 3])
    columns = torch.arange(6)
    prompt_mask = columns.unsqueeze(0) >= (6 - prompt_lengths).unsqueeze(1)  # [8, 6]
    response_mask = torch.ones(8, 6, dtype=torch.bool)
    response_mask[0, -2:] = False
    response_mask[5, -4:] = False
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)  # [8, 12]
    input_ids = torch.randint(0, VOCAB, (8, 12), generator=generator).masked_fill(~attention_mask, 0)
    # next-token alignment: position t is a response position when token t+1 is a response token
    loss_mask = torch.zeros_like(attention_mask)
    loss_mask[:, 5:11] = response_mask  # [8, 12]
    old_values = torch.randn(8, 12, generator=generator) * 0.8
    returns = torch.rand(8, 12, generator=generator)
    return dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask, old_values=old_values,
                returns=returns)  # fmt: skip


def critic_values_and_gradients(rank: int, world_size: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    from verl_cppack.integrations.megatron_model import build_tiny_gpt, init_megatron_parallel
    from verl_cppack.rl.critic import critic_values
    from verl_cppack.rl.policy import prepare_forward_path

    ctx = init_megatron_parallel(cp_size=world_size)
    prepare_forward_path("verl")
    critic = build_tiny_gpt(vocab_size=VOCAB, max_sequence_length=64, value_head=True, seed=5)
    batch = rollout_batch()
    results = {}
    for path in PATHS:
        critic.zero_grad(set_to_none=True)
        values = critic_values(critic, batch["input_ids"], batch["attention_mask"], ctx, forward=path)
        out = clipped_value_loss(values, batch["old_values"], batch["returns"], batch["loss_mask"], clip_range=0.2)
        out.loss.backward()
        grads = torch.cat([p.grad.reshape(-1) for p in critic.parameters() if p.grad is not None])
        torch.distributed.all_reduce(grads, group=ctx.cp_group)  # the worker's CP all-reduce before the step
        results[path] = (values.detach(), grads, float(out.clip_fraction))
    return results


@pytest.fixture(scope="module")
def cp1_cp2():
    cp1 = run_gloo(critic_values_and_gradients, 1)[0]
    cp2 = run_gloo(critic_values_and_gradients, 2)
    return cp1, cp2


@pytest.mark.parametrize("path", PATHS)
def test_critic_values_at_cp2_equal_cp1_on_every_rank(cp1_cp2, path):
    cp1, cp2 = cp1_cp2
    attention_mask = rollout_batch()["attention_mask"]
    values_cp1 = cp1[path][0]
    assert values_cp1.shape == (8, 12) and values_cp1.dtype == torch.float32
    assert (values_cp1[~attention_mask] == 0).all()  # padding holds 0
    assert (values_cp1[attention_mask] != 0).all()  # every real token has a value
    for rank_results in cp2:
        torch.testing.assert_close(rank_results[path][0], values_cp1, atol=1e-5, rtol=0)


@pytest.mark.parametrize("path", PATHS)
def test_value_loss_gradients_all_reduced_over_cp2_equal_cp1(cp1_cp2, path):
    cp1, cp2 = cp1_cp2
    grads_cp1 = cp1[path][1]
    assert 0.0 < cp1[path][2] < 1.0  # both branches of the clipped loss occur in this batch
    for rank_results in cp2:
        grads_cp2 = rank_results[path][1]
        relative = float((grads_cp2 - grads_cp1).norm() / grads_cp1.norm())
        assert relative < 1e-4, relative
        torch.testing.assert_close(grads_cp2, grads_cp1, rtol=1e-4, atol=1e-4 * float(grads_cp1.abs().max()))


def test_verl_value_model_forward_equals_the_plans_packed_forward(cp1_cp2):
    _, cp2 = cp1_cp2
    for rank_results in cp2:
        torch.testing.assert_close(rank_results["verl"][0], rank_results["cppack"][0], atol=1e-6, rtol=0)
        torch.testing.assert_close(rank_results["verl"][1], rank_results["cppack"][1], atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------ value loss
def test_clipped_value_loss_equals_verls_compute_value_loss_values_and_gradients():
    from verl.trainer.ppo.core_algos import compute_value_loss

    generator = torch.Generator().manual_seed(3)
    values = torch.randn(5, 9, generator=generator)
    old_values = values + torch.randn(5, 9, generator=generator) * 0.6  # some beyond the clip range, some inside
    returns = torch.randn(5, 9, generator=generator)
    mask = torch.rand(5, 9, generator=generator) > 0.3

    ours_values = values.clone().requires_grad_(True)
    ours = clipped_value_loss(ours_values, old_values, returns, mask, clip_range=0.5)
    ours.loss.backward()
    verl_values = values.clone().requires_grad_(True)
    verl_loss, verl_clip_fraction = compute_value_loss(
        verl_values, returns, old_values, mask.float(), cliprange_value=0.5, loss_agg_mode="token-mean"
    )
    verl_loss.backward()

    torch.testing.assert_close(ours.loss, verl_loss, atol=1e-6, rtol=1e-6)
    assert float(ours.clip_fraction) == pytest.approx(float(verl_clip_fraction), abs=1e-6)
    torch.testing.assert_close(ours_values.grad, verl_values.grad, atol=1e-7, rtol=1e-6)
    assert 0.0 < float(ours.clip_fraction) < 1.0
    assert (ours_values.grad[~mask] == 0).all()  # masked tokens get no gradient


def test_clipped_value_loss_by_hand_on_two_tokens():
    values = torch.tensor([[1.0, 0.0]], requires_grad=True)
    old_values = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0]])
    out = clipped_value_loss(values, old_values, returns, torch.tensor([[True, True]]), clip_range=0.5)
    # token 0: unclipped (1-2)^2 = 1, clipped (0.5-2)^2 = 2.25 -> 2.25; token 1: both (0-1)^2 = 1 -> 1
    assert float(out.loss) == pytest.approx(0.5 * (2.25 + 1.0) / 2)
    assert float(out.clip_fraction) == pytest.approx(0.5)
    out.loss.backward()
    # the clipped branch is constant in v (clip active): no gradient; token 1: 0.5 * 2 (v - R) / 2 = -0.5
    assert values.grad.tolist() == [[0.0, -0.5]]


def test_clipped_value_loss_rejects_bad_input():
    values = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="returns has shape"):
        clipped_value_loss(values, values, torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="zero tokens"):
        clipped_value_loss(values, values, values, torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="clip_range"):
        clipped_value_loss(values, values, values, torch.ones(2, 3, dtype=torch.bool), clip_range=0.0)


def test_explained_variance_is_one_for_a_perfect_critic_and_near_zero_for_a_constant_one():
    generator = torch.Generator().manual_seed(0)
    returns = torch.randn(4, 50, generator=generator)
    mask = torch.ones(4, 50, dtype=torch.bool)
    mask[:, :10] = False  # prompt positions do not count
    noisy_prompt = torch.where(mask, returns, torch.randn(4, 50, generator=generator) * 100)
    assert explained_variance(noisy_prompt, returns, mask) == pytest.approx(1.0)
    constant = torch.full_like(returns, float(returns[mask].mean()))
    assert explained_variance(constant, returns, mask) == pytest.approx(0.0, abs=1e-4)
    with pytest.raises(ValueError, match="at least 2"):
        explained_variance(returns, returns, torch.zeros_like(mask))
