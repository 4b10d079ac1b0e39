"""The Hugging Face rollout backend for verl 0.9.x on the host (``verl_cppack.runtime.rollout``): its server and
verl's side (the sampler alone: ``test_rollout_sampling.py``).

A tiny random Llama stands in for a model (nothing can be downloaded). The server is exercised directly (its
logic is a plain class) and, once, as the Ray actor ``HFReplica`` launches, with weights pushed by
``HFServerAdapter``.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("verl")

from verl.workers.config import HFModelConfig, RolloutConfig  # noqa: E402

from tests.tiny_llama import tiny_llama  # noqa: E402
from verl_cppack.runtime import FixTargetChanged  # noqa: E402
from verl_cppack.runtime import cpu_fixes as fixes  # noqa: E402
from verl_cppack.runtime.rollout.sampling import HFTokenSampler, SamplingSettings  # noqa: E402
from verl_cppack.runtime.rollout.server import HFRolloutServer, eos_token_ids_of  # noqa: E402
from verl_cppack.runtime.rollout.verl_adapter import HFReplica, HFServerAdapter  # noqa: E402

AGENT_LOOP_PARAMS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
"""What verl 0.9.1's agent loop sends (``AgentLoopWorker.generate_sequences``) with calculate_log_probs=True."""

PROMPT = [3, 4, 5, 6]


def _save_tiny_llama(directory, seed: int) -> str:
    tiny_llama(seed).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return _save_tiny_llama(tmp_path_factory.mktemp("llama_a"), seed=0)


@pytest.fixture(scope="module")
def other_model_path(tmp_path_factory) -> str:
    return _save_tiny_llama(tmp_path_factory.mktemp("llama_b"), seed=1)


def _rollout_config(**overrides) -> RolloutConfig:
    settings = dict(name="hf", tensor_model_parallel_size=1, prompt_length=8, response_length=12, seed=7)
    settings.update(overrides)
    return RolloutConfig(**settings)


def _server(path: str, **overrides) -> HFRolloutServer:
    return HFRolloutServer(_rollout_config(**overrides), HFModelConfig(path=path, load_tokenizer=False))


def _generate(server: HFRolloutServer, prompt=PROMPT, request_id: str = "request", **params):
    return asyncio.run(server.generate(request_id, list(prompt), {**AGENT_LOOP_PARAMS, **params}))


def _forward_log_probs(model, prompt, response, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of ``response`` after ``prompt`` from one full forward pass: log_softmax(logits / T) gathered."""
    with torch.no_grad():
        ids = torch.tensor([list(prompt) + list(response)])  # [1, prompt + response]
        logits = model(input_ids=ids).logits[0].float() / temperature  # [prompt + response, vocab]
    predicting = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # [response, vocab]
    return predicting.gather(1, torch.tensor(response)[:, None])[:, 0]  # [response]


# -- generate -------------------------------------------------------------------------------------------------


def test_response_is_bounded_by_max_tokens_response_length_and_max_model_len(model_path):
    server = _server(model_path, ignore_eos=True)
    assert len(_generate(server, max_tokens=5).token_ids) == 5
    assert len(_generate(server, max_new_tokens=3).token_ids) == 3
    assert len(_generate(server).token_ids) == 12  # response_length when no max_tokens is passed
    long_prompt = list(range(3, 32)) * 2  # 58 tokens of 64 positions
    assert len(_generate(server, prompt=long_prompt, max_tokens=50).token_ids) == 64 - 58
    with pytest.raises(ValueError, match="no room to generate"):
        _generate(server, prompt=[5] * 64)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_equal_a_forward_recomputation(model_path, temperature):
    server = _server(model_path, ignore_eos=True)
    output = _generate(server, temperature=temperature)
    assert output.stop_reason == "completed" and len(output.log_probs) == len(output.token_ids) == 12
    expected = _forward_log_probs(server.sampler.model, PROMPT, output.token_ids, temperature)
    torch.testing.assert_close(torch.tensor(output.log_probs), expected, rtol=0, atol=1e-5)


def test_raw_log_probs_mode_ignores_temperature_and_no_logprobs_returns_none(model_path):
    server = _server(model_path, ignore_eos=True, logprobs_mode="raw_logprobs")
    output = _generate(server, temperature=0.5)
    expected = _forward_log_probs(server.sampler.model, PROMPT, output.token_ids, 1.0)
    torch.testing.assert_close(torch.tensor(output.log_probs), expected, rtol=0, atol=1e-5)
    assert _generate(server, logprobs=False).log_probs is None


def test_same_seed_repeats_whatever_the_arrival_order_and_a_new_seed_differs(model_path):
    other_prompt = [9, 8, 7]
    first, second = _server(model_path, ignore_eos=True), _server(model_path, ignore_eos=True)
    group = [_generate(first, request_id=f"uuid-{index}").token_ids for index in range(3)]
    alone = _generate(first, prompt=other_prompt).token_ids
    assert len({tuple(tokens) for tokens in group}) == 3  # the n samples of one prompt differ
    # the other run sees other request ids and the other prompt first
    assert _generate(second, prompt=other_prompt, request_id="x").token_ids == alone
    assert [_generate(second, request_id=f"other-{index}").token_ids for index in range(3)] == group
    reseeded = _server(model_path, ignore_eos=True, seed=8)
    assert _generate(reseeded).token_ids != group[0]
    request_seeded = _generate(_server(model_path, ignore_eos=True), seed=8)  # a request's seed overrides rollout.seed
    assert request_seeded.token_ids == _generate(_server(model_path, ignore_eos=True, seed=8)).token_ids


def test_under_full_determinism_each_named_request_repeats_whatever_the_arrival_order(model_path):
    """verl's rollout.full_determinism names each request after its row (det-<row>): the name enters the seed, so a
    row draws the same sample in every run however its group's requests arrive, and a group's rows still differ."""
    first = _server(model_path, ignore_eos=True, full_determinism=True)
    second = _server(model_path, ignore_eos=True, full_determinism=True)
    names = [f"det-{row}" for row in range(3)]
    group = {name: _generate(first, request_id=name).token_ids for name in names}
    assert len({tuple(tokens) for tokens in group.values()}) == 3
    assert {name: _generate(second, request_id=name).token_ids for name in reversed(names)} == group
    assert _generate(second, request_id="det-0").token_ids != group["det-0"]  # the next step's row 0: a new draw
    # by default the uuid request ids stay out of the seed: the first request for a prompt draws the same either way
    assert (
        _generate(_server(model_path, ignore_eos=True), request_id="det-0").token_ids
        == _generate(_server(model_path, ignore_eos=True), request_id="uuid").token_ids
    )


def test_end_of_sequence_stops_and_is_part_of_the_response(model_path):
    server = _server(model_path)
    assert eos_token_ids_of(server.model_config) == frozenset({2})  # LlamaConfig's eos_token_id
    first = _generate(server, temperature=0.0, max_tokens=1).token_ids[0]
    sampler = HFTokenSampler(server.sampler.model, eos_token_ids=[first])
    greedy = SamplingSettings(max_tokens=10, temperature=0.0)
    response = sampler.sample(PROMPT, greedy, torch.Generator())
    assert response.token_ids == [first] and response.stop_reason == "completed"
    ignoring = SamplingSettings(max_tokens=10, temperature=0.0, ignore_eos=True)
    assert len(sampler.sample(PROMPT, ignoring, torch.Generator()).token_ids) == 10
    assert _generate(server, temperature=0.0, stop_token_ids=[first]).token_ids == [first]


def test_unsupported_requests_are_refused_clearly(model_path):
    server = _server(model_path)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        _generate(server, prompt_logprobs=1)
    with pytest.raises(NotImplementedError, match="text-only"):
        asyncio.run(server.generate("r", PROMPT, dict(AGENT_LOOP_PARAMS), image_data=[object()]))
    with pytest.raises(TypeError, match="integer token ids"):
        _generate(server, prompt=[1.5, 2.0])
    with pytest.raises(ValueError, match="logprobs_mode"):
        _server(model_path, logprobs_mode="processed_logits")


def test_abort_holds_or_rejects_requests_until_resume(model_path):
    server = _server(model_path)

    async def scenario():
        result = await server.abort_all_requests(reject_request=True)
        rejected = await server.generate("late", PROMPT, dict(AGENT_LOOP_PARAMS))
        await server.resume_generation()
        admitted = await server.generate("after", PROMPT, dict(AGENT_LOOP_PARAMS))
        return result, rejected, admitted

    result, rejected, admitted = asyncio.run(scenario())
    assert result == {"aborted_count": 0, "request_ids": []}
    assert rejected.stop_reason == "aborted" and rejected.token_ids == []
    assert admitted.stop_reason == "completed" and admitted.token_ids


# -- weights --------------------------------------------------------------------------------------------------


def test_loaded_weights_replace_the_model(model_path, other_model_path):
    server, reference = _server(model_path, ignore_eos=True), _server(other_model_path, ignore_eos=True)
    before = _generate(server, prompt=[11, 12]).token_ids
    new_weights = list(reference.sampler.model.state_dict().items())
    assert asyncio.run(server.load_weights(new_weights)) == len(new_weights)
    assert _generate(server).token_ids == _generate(reference).token_ids
    assert _generate(server, temperature=0.0).token_ids == _generate(reference, temperature=0.0).token_ids
    assert before != _generate(_server(other_model_path, ignore_eos=True), prompt=[11, 12]).token_ids
    with pytest.raises(ValueError, match="not in the rollout model"):
        asyncio.run(server.load_weights([("model.not_a_layer.weight", torch.zeros(1))]))
    with pytest.raises(ValueError, match="has shape"):
        asyncio.run(server.load_weights([("lm_head.weight", torch.zeros(3, 3))]))


# -- registration ---------------------------------------------------------------------------------------------


@pytest.fixture
def clean_registries(monkeypatch):
    """verl's two rollout registries, restored after the test."""
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    monkeypatch.setattr(base, "_ROLLOUT_REGISTRY", dict(base._ROLLOUT_REGISTRY))
    monkeypatch.setattr(RolloutReplicaRegistry, "_registry", dict(RolloutReplicaRegistry._registry))
    return base, RolloutReplicaRegistry


def test_the_rollout_fixes_make_verl_resolve_the_hf_rollout(clean_registries):
    """The two CPU fixes register rollout.name=hf in verl's own registries; applying them twice is harmless."""
    from verl.workers.rollout import replica

    base, replica_registry = clean_registries
    for _ in range(2):
        fixes.hf_rollout_adapter(base)
        fixes.hf_rollout_replica(replica)
    assert base.get_rollout_class("hf", "async") is HFServerAdapter
    assert replica_registry.get("hf") is HFReplica
    assert ("vllm", "async") in base._ROLLOUT_REGISTRY and "vllm" in replica_registry._registry  # built-ins stay


def test_the_rollout_fixes_refuse_a_changed_registry(clean_registries, monkeypatch):
    """A registry of another shape, or 'hf' taken by someone else, stops the fix with FixTargetChanged."""
    base, _ = clean_registries
    monkeypatch.setattr(base, "_ROLLOUT_REGISTRY", [("vllm", "async")])
    with pytest.raises(FixTargetChanged, match="_ROLLOUT_REGISTRY"):
        fixes.hf_rollout_adapter(base)
    monkeypatch.setattr(base, "_ROLLOUT_REGISTRY", {("hf", "async"): "somebody.else.Adapter"})
    with pytest.raises(FixTargetChanged, match="already registered to somebody.else.Adapter"):
        fixes.hf_rollout_adapter(base)


# -- on Ray ---------------------------------------------------------------------------------------------------


@pytest.mark.slow  # a local Ray cluster
def test_replica_server_actor_generates_and_the_adapter_pushes_weights(model_path, other_model_path, monkeypatch):
    """One local Ray cluster: ``HFReplica.init_hybrid`` starts the server actor next to a stand-in worker;
    ``HFServerAdapter.update_weights`` (rank 0 of replica 0) loads new weights into it."""
    ray = pytest.importorskip("ray")

    @ray.remote(num_cpus=0)
    class StandInWorker:
        pass

    class StandInWorkerGroup:
        def __init__(self, workers):
            self.workers = workers

    config = _rollout_config(ignore_eos=True)
    model_config = HFModelConfig(path=model_path, load_tokenizer=False)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        replica = HFReplica(replica_rank=0, config=config, model_config=model_config, gpus_per_node=1)
        asyncio.run(replica.init_hybrid(StandInWorkerGroup([StandInWorker.remote()])))
        assert replica.servers == [replica.server_handle] and replica.server_address == "ray://hf_server_0"

        output = ray.get(replica.server_handle.generate.remote("uuid", PROMPT, dict(AGENT_LOOP_PARAMS)))
        expected = _generate(_server(model_path, ignore_eos=True))
        assert output.token_ids == expected.token_ids
        # The actor runs torch with Ray's thread count (OMP_NUM_THREADS=1), this process with the machine's: float32
        # sums in another order, 1 ulp (2.4e-7 at |log p| ~ 3) per thread-count change measured, a few ulps over a
        # response; 1e-5 relative is ~40 ulps there, and a wrong log-prob (temperature, position) is off by > 1e-2.
        assert output.log_probs == pytest.approx(expected.log_probs, rel=1e-5, abs=1e-6)

        monkeypatch.setenv("RANK", "0")
        adapter = HFServerAdapter(config=config, model_config=model_config, device_mesh=None)
        assert adapter.is_leader_rank and adapter.replica_rank == 0
        new_weights = _server(other_model_path).sampler.model.state_dict()
        asyncio.run(adapter.update_weights(iter(new_weights.items()), global_steps=3))
        updated = ray.get(replica.server_handle.generate.remote("uuid-2", [9, 8], dict(AGENT_LOOP_PARAMS)))
        assert updated.token_ids == _generate(_server(other_model_path, ignore_eos=True), prompt=[9, 8]).token_ids
        assert updated.extra_fields["global_steps"] == 3
        asyncio.run(replica.sleep())
        asyncio.run(replica.wake_up())
        asyncio.run(replica.clear_kv_cache())
    finally:
        ray.shutdown()


def test_the_registered_adapter_name_is_the_adapter_class():
    assert f"{HFServerAdapter.__module__}.{HFServerAdapter.__qualname__}" == fixes.HF_ROLLOUT_ADAPTER
