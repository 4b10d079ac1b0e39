"""The one rollout-batch maker: each padding's shape, its bounds, its stream."""

import pytest
import torch

from verl_cppack.bench.batches import rollout_batch


def _runs(row: torch.Tensor) -> int:
    """How many separate runs of real tokens a mask row holds."""
    return int((row & ~torch.nn.functional.pad(row, (1, 0))[:-1]).sum())


def test_rollout_rows_are_a_left_padded_prompt_then_a_right_padded_response():
    ids, mask = rollout_batch(64, 20, prompt_len=8, shortest=0, short_rows=0.3, seed=5)
    assert ids.shape == mask.shape == (64, 20) and ids.dtype == torch.int64 and mask.dtype == torch.bool
    prompt, response = mask[:, :8], mask[:, 8:]
    assert prompt[:, -1].all()  # every prompt ends at the boundary, at least 1 token long
    assert torch.equal(prompt.int().diff(dim=1).clamp(max=0), torch.zeros(64, 7, dtype=torch.int32))  # left padded
    assert torch.equal(response.int().diff(dim=1).clamp(min=0), torch.zeros(64, 11, dtype=torch.int32))  # right
    assert (response.sum(1) == 0).any()  # shortest=0: some responses are empty
    assert (mask.sum(1) <= 3).any() and (mask.sum(1) > 3).any()


def test_rollout_default_splits_in_half_and_keeps_one_response_token():
    _, mask = rollout_batch(256, 32, seed=1)
    assert mask[:, 15].all() and mask[:, 16].all()
    assert (mask.sum(1) > 1).all()


@pytest.mark.parametrize("shortest", [0, 1, 4])
def test_anywhere_rows_hold_shortest_to_all_tokens_anywhere(shortest):
    _, mask = rollout_batch(400, 14, padding="anywhere", shortest=shortest, seed=2)
    lengths = mask.sum(1)
    assert lengths.min() >= shortest and lengths.max() <= 14
    assert (lengths == shortest).any()
    assert 0.2 < (lengths <= max(shortest, 3)).float().mean() < 0.5  # about a third are short
    runs = torch.tensor([_runs(row) for row in mask])
    assert (runs >= 2).any()  # gaps
    one_run = mask[(runs == 1) & (lengths < 12)]
    assert (~one_run[:, 0] & ~one_run[:, -1]).any()  # middle: padding on both sides
    assert (one_run[:, 0] & ~one_run[:, -1]).any() and (~one_run[:, 0] & one_run[:, -1]).any()


def test_a_generator_continues_the_stream_and_a_seed_repeats_it():
    generator = torch.Generator().manual_seed(9)
    first = rollout_batch(3, 10, padding="anywhere", generator=generator)
    second = rollout_batch(3, 10, padding="anywhere", generator=generator)
    again = rollout_batch(3, 10, padding="anywhere", seed=9)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], second[0])


def test_ids_stay_inside_the_vocabulary():
    ids, _ = rollout_batch(8, 16, vocab_size=5)
    assert ids.min() >= 1 and ids.max() <= 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {"padding": "left"},
        {"prompt_len": 16},
        {"prompt_len": 0},
        {"shortest": 9},
        {"padding": "anywhere", "shortest": 17},
    ],
)
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        rollout_batch(2, 16, **kwargs)
