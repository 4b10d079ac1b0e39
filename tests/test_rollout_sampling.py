"""The Hugging Face rollout's sampler (``verl_cppack.runtime.rollout.sampling``), without verl or Ray.

- ``next_token`` applies vLLM's rules: top-k and top-p keep the likeliest tokens and renormalise, greedy takes the
  argmax, and the log-prob is the chosen token's under the distribution it was drawn from;
- ``sample`` decodes with a key/value cache: its log-probs equal one full forward pass's, it stops after an
  end-of-sequence token (kept in the response) unless told to ignore it;
- ``request_seed`` depends on every part of the request and on nothing else;
- the module imports neither verl nor Ray (it is the part of the rollout a host test can drive alone).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.tiny_llama import tiny_llama  # noqa: E402
from verl_cppack.runtime.rollout.sampling import HFTokenSampler, SamplingSettings, request_seed  # noqa: E402

PROMPT = [3, 4, 5, 6]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def test_importing_the_sampler_imports_neither_verl_nor_ray():
    probe = "import sys, verl_cppack.runtime.rollout.sampling; print(sorted({'verl', 'ray'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_top_k_and_top_p_keep_the_likeliest_tokens_and_renormalise():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()  # [vocab=4]
    generator = torch.Generator().manual_seed(0)
    nucleus = SamplingSettings(max_tokens=1, top_p=0.7)  # keeps {0, 1}: 0.5 < 0.7 <= 0.5 + 0.3
    draws = [HFTokenSampler.next_token(logits, nucleus, generator) for _ in range(200)]
    assert {token for token, _ in draws} == {0, 1}
    for token, log_prob in draws:
        assert log_prob == pytest.approx(torch.tensor([0.5, 0.3])[token].div(0.8).log().item(), abs=1e-6)
    top_one = SamplingSettings(max_tokens=1, top_k=1)
    assert HFTokenSampler.next_token(logits, top_one, generator) == (0, pytest.approx(0.0, abs=1e-6))
    top_two = SamplingSettings(max_tokens=1, top_k=2, temperature=2.0)
    token, log_prob = HFTokenSampler.next_token(logits, top_two, generator)
    assert token in (0, 1)
    assert log_prob == pytest.approx(torch.log_softmax(logits[:2] / 2.0, dim=-1)[token].item(), abs=1e-6)
    greedy = SamplingSettings(max_tokens=1, temperature=0.0)
    assert HFTokenSampler.next_token(logits, greedy, generator) == (0, pytest.approx(torch.tensor(0.5).log().item()))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_equal_one_forward_pass(model, temperature):
    settings = SamplingSettings(max_tokens=8, temperature=temperature, ignore_eos=True)
    response = HFTokenSampler(model).sample(PROMPT, settings, torch.Generator().manual_seed(3))
    assert len(response.token_ids) == len(response.log_probs) == 8 and response.stop_reason == "completed"
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + response.token_ids])).logits[0] / temperature
    expected = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1).gather(
        1, torch.tensor(response.token_ids)[:, None]
    )
    torch.testing.assert_close(torch.tensor(response.log_probs), expected[:, 0], rtol=0, atol=1e-5)


def test_end_of_sequence_stops_and_is_part_of_the_response_unless_ignored(model):
    greedy = SamplingSettings(max_tokens=10, temperature=0.0)
    first = HFTokenSampler(model).sample(PROMPT, SamplingSettings(max_tokens=1, temperature=0.0), torch.Generator())
    sampler = HFTokenSampler(model, eos_token_ids=first.token_ids)
    response = sampler.sample(PROMPT, greedy, torch.Generator())
    assert response.token_ids == first.token_ids and response.stop_reason == "completed"
    ignoring = SamplingSettings(max_tokens=10, temperature=0.0, ignore_eos=True)
    assert len(sampler.sample(PROMPT, ignoring, torch.Generator()).token_ids) == 10
    aborted = sampler.sample(PROMPT, ignoring, torch.Generator(), should_abort=lambda: True)
    assert aborted.token_ids == [] and aborted.stop_reason == "aborted"


def test_the_request_seed_depends_on_every_part_of_the_request():
    base = request_seed(7, 0, PROMPT, 0)
    assert request_seed(7, 0, list(PROMPT), 0) == base  # the same request, the same seed
    variants = [
        request_seed(8, 0, PROMPT, 0),
        request_seed(7, 1, PROMPT, 0),
        request_seed(7, 0, PROMPT[:-1], 0),
        request_seed(7, 0, PROMPT, 1),
        request_seed(7, 0, PROMPT, 0, "det-0"),
    ]
    assert len({base, *variants}) == 6 and all(0 <= seed < 2**63 for seed in variants)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"max_tokens": 1, "temperature": -1.0}, "temperature"),
        ({"max_tokens": 1, "top_p": 0.0}, "top_p"),
        ({"max_tokens": 1, "top_k": -2}, "top_k"),
        ({"max_tokens": 1, "log_probs_mode": "other"}, "log-probs mode"),
    ],
)
def test_settings_outside_vllms_ranges_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingSettings(**fields)
