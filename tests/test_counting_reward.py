"""The counting task's reward (verl's ``custom_reward_function``): per-position partial credit for counting on.

Hand-computed cases, and a property against an oracle that reads the symbols as hexadecimal digits.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verl_cppack.jobs.counting_reward import RESPONSE_LENGTH, SYMBOLS, compute_score, correct_positions, score_response


@pytest.mark.parametrize(
    "last_prompt_symbol, response, score",
    [
        ("3", "456789", 6 / 6),
        ("3", "4567890", 6 / 6),  # only the first RESPONSE_LENGTH symbols count
        ("e", "f01", 3 / 6),  # f -> 0 wraps around, a response that stops early forfeits the rest
        ("3", "5678", 3 / 6),  # the first is wrong; each later one is judged against its own predecessor
        ("3", "", 0.0),
        ("z", "0123", 3 / 6),  # a predecessor outside the alphabet has no successor
    ],
)
def test_hand_computed_scores(last_prompt_symbol, response, score):
    assert score_response(last_prompt_symbol, response) == pytest.approx(score)
    assert compute_score("verl_cppack/counting", response, last_prompt_symbol) == pytest.approx(score)


@given(last=st.sampled_from(SYMBOLS), response=st.text(SYMBOLS, max_size=2 * RESPONSE_LENGTH))
def test_a_position_is_right_when_it_is_its_predecessor_plus_one_in_hexadecimal(last, response):
    previous = [last, *response]
    expected = [int(symbol, 16) == (int(before, 16) + 1) % 16 for before, symbol in zip(previous, response)]
    assert correct_positions(last, response) == expected[:RESPONSE_LENGTH]
    assert score_response(last, response) == sum(expected[:RESPONSE_LENGTH]) / RESPONSE_LENGTH
