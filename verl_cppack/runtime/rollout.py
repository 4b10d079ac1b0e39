"""A Hugging Face rollout backend for verl 0.9.x on the host: token in, sampled tokens and their log-probs out.

verl 0.9.1 registers only GPU inference engines (vLLM, SGLang, TensorRT-LLM) for its async rollout; its
``hf_rollout.py`` is the retired synchronous API. This module supplies the three pieces verl's async rollout
protocol asks for, registered through verl's own registries by ``register_hf_rollout()``:

- ``HFRolloutServer``: the server. ``HFReplica`` runs it as a Ray actor (``ray.remote(HFRolloutServer)``); it
  holds an ``AutoModelForCausalLM`` in float32 on the CPU and answers
  ``generate(request_id, prompt_ids, sampling_params, ...) -> TokenOutput`` as vLLM's ``vLLMHttpServer`` does,
  plus every control call verl makes on a server (no-ops where the host has nothing to free).
- ``HFServerAdapter``: the ``BaseRollout`` inside each hybrid actor worker. ``update_weights`` receives the
  actor's weights in Hugging Face naming (``checkpoint_engine.backend=naive``) and loads them into the server.
- ``HFReplica``: the ``RolloutReplica`` the trainer builds; ``launch_servers`` starts one server per replica.

The decoding itself is ``HFTokenSampler``: one sequence at a time, a key/value cache, and the same sampling and
log-probability rules as vLLM (see ``HFTokenSampler.next_token``). Nothing here touches a GPU.

Written for verl 0.9.x (checked by ``register_hf_rollout``), transformers 5.x, Ray 2.x.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import operator
import os
from array import array
from collections.abc import AsyncIterable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, TokenOutput

from verl_cppack.runtime.fixes import HF_ROLLOUT_NAME

logger = logging.getLogger(__name__)

ROLLOUT_NAME = HF_ROLLOUT_NAME
"""The value of ``actor_rollout_ref.rollout.name`` that selects this backend (registered by ``fixes.py``)."""

SERVER_NAME_PREFIX = f"{ROLLOUT_NAME}_server_"
"""Ray actor name of a replica's server: prefix + replica rank (+ the replica's name suffix)."""

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this decode greedily (vLLM's ``_SAMPLING_EPS``)."""

LOG_PROBS_MODES = ("processed_logprobs", "raw_logprobs")
"""``rollout.logprobs_mode`` values served. 'processed' (verl's default): log-probs under the distribution the
token was drawn from (penalties, temperature, top-k, top-p applied); 'raw': log_softmax of the model's logits."""

_SAMPLING_KEYS_USED = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "repetition_penalty",
        "logprobs",
        "max_tokens",
        "max_new_tokens",
        "stop_token_ids",
        "ignore_eos",
        "seed",
        "n",
    }
)
_SAMPLING_KEYS_WITHOUT_EFFECT = frozenset({"skip_special_tokens", "spaces_between_special_tokens", "detokenize"})
"""Text-side options: they change how vLLM detokenizes, not which tokens it returns, so token-in/token-out ignores
them."""


# --------------------------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingSettings:
    """How one request is decoded (already resolved against the rollout config)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    repetition_penalty: float = 1.0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    log_probs_mode: str = "processed_logprobs"

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.log_probs_mode not in LOG_PROBS_MODES:
            raise ValueError(f"log-probs mode must be one of {LOG_PROBS_MODES}, got {self.log_probs_mode!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True)
class SampledResponse:
    """What one request produced: the response tokens, the log-prob of each, and why decoding stopped."""

    token_ids: list[int]
    log_probs: list[float]
    stop_reason: str  # 'completed' (end-of-sequence token or max_tokens) or 'aborted'


def request_seed(
    base_seed: int, replica_rank: int, prompt_ids: Sequence[int], occurrence: int, request_name: str = ""
) -> int:
    """The seed of one request's sampling generator: a hash of (base seed, replica rank, prompt, occurrence, name).

    ``occurrence`` counts earlier requests for the same prompt (and name) on the same server, so the ``n`` samples of
    one prompt (GRPO groups) differ while a rerun draws the same ``n`` samples. verl's request ids are fresh uuids
    and requests arrive in an order that depends on timing, so by default neither an id nor a global counter
    repeats and ``request_name`` is empty. Under ``rollout.full_determinism`` verl names each request after its row
    (``det-<row>``) and routes it to a replica by that name; the name then enters the seed, so each row draws the
    same sample in every run whatever the arrival order.
    """
    digest = hashlib.blake2b(digest_size=8)
    digest.update(array("q", [int(base_seed), int(replica_rank), int(occurrence)]).tobytes())
    digest.update(array("q", [int(token) for token in prompt_ids]).tobytes())
    digest.update(request_name.encode())
    return int.from_bytes(digest.digest(), "little") & (2**63 - 1)


def _prompt_key(prompt_ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(array("q", [int(token) for token in prompt_ids]).tobytes(), digest_size=16).digest()


class HFTokenSampler:
    """Autoregressive decoding of one sequence with a Hugging Face causal LM on the CPU.

    Each step runs the model on the new token (key/value cache), turns the last logits into a distribution the
    way vLLM's sampler does, draws from it with the request's generator and records the chosen token's log-prob.
    """

    def __init__(self, model: torch.nn.Module, eos_token_ids: Iterable[int] = ()) -> None:
        if not hasattr(model, "forward") or not hasattr(model, "config"):
            raise TypeError(f"expected a Hugging Face causal LM, got {type(model).__name__}")
        self.model = model.eval()
        self.eos_token_ids = frozenset(int(token) for token in eos_token_ids)

    @torch.no_grad()
    def sample(
        self,
        prompt_ids: Sequence[int],
        settings: SamplingSettings,
        generator: torch.Generator,
        should_abort: Callable[[], bool] = lambda: False,
    ) -> SampledResponse:
        """Decode up to ``settings.max_tokens`` tokens after ``prompt_ids``.

        Stops after an end-of-sequence token (the model's, unless ``ignore_eos``) or one of
        ``settings.stop_token_ids`` (the stop token is part of the response, as in vLLM), at ``max_tokens``, or
        when ``should_abort()`` turns true between two steps ('aborted', with the tokens so far).
        """
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids is empty: there is nothing to condition the first token on")
        stop_ids = settings.stop_token_ids | (frozenset() if settings.ignore_eos else self.eos_token_ids)
        parameter = next(self.model.parameters())
        step_input = torch.tensor([list(prompt_ids)], dtype=torch.long, device=parameter.device)  # [1, prompt]
        seen = None
        if settings.repetition_penalty != 1.0:
            vocabulary = self.model.get_output_embeddings().weight.shape[0]
            seen = torch.zeros(vocabulary, dtype=torch.bool, device=parameter.device)  # [vocab]
            seen[step_input[0]] = True
        cache = None
        token_ids: list[int] = []
        log_probs: list[float] = []
        stop_reason = "completed"
        for _ in range(settings.max_tokens):
            if should_abort():
                stop_reason = "aborted"
                break
            output = self.model(input_ids=step_input, past_key_values=cache, use_cache=True)
            cache = output.past_key_values
            logits = output.logits[0, -1].float()  # [vocab]
            token, log_prob = self.next_token(logits, settings, generator, seen)
            token_ids.append(token)
            log_probs.append(log_prob)
            if token in stop_ids:
                break
            if seen is not None:
                seen[token] = True
            step_input = torch.tensor([[token]], dtype=torch.long, device=parameter.device)  # [1, 1]
        return SampledResponse(token_ids=token_ids, log_probs=log_probs, stop_reason=stop_reason)

    @staticmethod
    def next_token(
        logits: torch.Tensor,
        settings: SamplingSettings,
        generator: torch.Generator,
        seen: torch.Tensor | None = None,
    ) -> tuple[int, float]:
        """Choose a token from one position's ``logits`` ([vocab], float32); return it and its log-prob.

        vLLM's order: repetition penalty (on tokens in ``seen``: positive logits divided, negative multiplied),
        then greedy (temperature < 1e-5: argmax, log-probs of the penalised logits) or temperature, top-k, top-p
        (the smallest most-likely set whose mass reaches top_p) and a draw. 'processed_logprobs' is the chosen
        token's log-prob under that final distribution, which at top_k=-1, top_p=1 is
        ``log_softmax(logits / temperature)``, the quantity verl's actor recomputes; 'raw_logprobs' is
        ``log_softmax(logits)``.
        """
        raw = logits
        if seen is not None and settings.repetition_penalty != 1.0:
            penalty = settings.repetition_penalty
            penalised = torch.where(logits > 0, logits / penalty, logits * penalty)  # [vocab]
            logits = torch.where(seen, penalised, logits)  # [vocab]
        if settings.greedy:
            processed = logits  # [vocab]
            token = int(torch.argmax(processed))
        else:
            processed = logits / settings.temperature  # [vocab]
            vocabulary = processed.shape[0]
            if 0 < settings.top_k < vocabulary:
                kth_largest = torch.topk(processed, settings.top_k).values[-1]
                processed = processed.masked_fill(processed < kth_largest, float("-inf"))
            if settings.top_p < 1.0:
                sorted_logits, order = torch.sort(processed, descending=True)  # [vocab]
                sorted_probs = torch.softmax(sorted_logits, dim=-1)
                mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly likelier tokens
                drop_sorted = mass_before >= settings.top_p
                drop_sorted[0] = False
                drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)  # [vocab], back to token order
                processed = processed.masked_fill(drop, float("-inf"))
            probabilities = torch.softmax(processed, dim=-1)  # [vocab]
            token = int(torch.multinomial(probabilities, 1, generator=generator))
        chosen = raw if settings.log_probs_mode == "raw_logprobs" else processed
        log_prob = float(torch.log_softmax(chosen, dim=-1)[token])
        return token, log_prob

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy Hugging Face-named tensors into the model (cast to its dtype); returns how many were loaded.

        Names are the model's ``state_dict`` keys (tied weights answer to both names). An unknown name or a shape
        mismatch is a ValueError: silently skipping a tensor would leave the rollout on stale weights.
        """
        targets = self.model.state_dict(keep_vars=True)
        loaded = 0
        for name, tensor in named_tensors:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, expected a torch.Tensor")
            target = targets.get(name)
            if target is None:
                known = ", ".join(sorted(targets)[:8])
                raise ValueError(f"weight {name!r} is not in the rollout model (its names start: {known}, ...)")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, the rollout model's has {tuple(target.shape)}"
                )
            target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
            loaded += 1
        return loaded


def load_causal_lm(path: str, torch_threads: int | None = None) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path)`` in float32 on the CPU, in eval mode."""
    from transformers import AutoModelForCausalLM

    if torch_threads is not None:
        torch.set_num_threads(int(torch_threads))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def eos_token_ids_of(model_config: Any) -> frozenset[int]:
    """End-of-sequence ids from a verl ``HFModelConfig``: generation config, model config and tokenizer."""
    found: set[int] = set()
    sources = (
        getattr(model_config, "generation_config", None),
        getattr(model_config, "hf_config", None),
        getattr(model_config, "tokenizer", None),
    )
    for source in sources:
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        found.update(int(token) for token in (value if isinstance(value, (list, tuple, set)) else [value]))
    return frozenset(found)


def _token_list(prompt_ids: Any) -> list[int]:
    """``prompt_ids`` (list, tuple, 1-D tensor or array of ints) as a list of Python ints."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 1:
            raise ValueError(f"prompt_ids must be 1-D, got shape {tuple(prompt_ids.shape)}")
        return [int(token) for token in prompt_ids.tolist()]
    if hasattr(prompt_ids, "tolist") and not isinstance(prompt_ids, (list, tuple)):
        prompt_ids = prompt_ids.tolist()
    if not isinstance(prompt_ids, (list, tuple)):
        raise TypeError(f"prompt_ids must be a list of token ids, got {type(prompt_ids).__name__}")
    try:
        return [operator.index(token) for token in prompt_ids]
    except TypeError as error:
        raise TypeError(f"prompt_ids must contain integer token ids only: {error}") from error


# --------------------------------------------------------------------------------------------------------------
# Server
# --------------------------------------------------------------------------------------------------------------


class HFRolloutServer:
    """The rollout server of one replica: an HF causal LM in float32 on the CPU behind verl's server protocol.

    ``HFReplica`` runs it as a Ray actor; tests may build it directly. Requests are decoded one at a time (a lock):
    two host cores gain nothing from interleaving them, and every request's draws come from its own generator.

    Seeding (what makes a run repeat): each request gets a ``torch.Generator`` seeded by
    ``request_seed(seed, replica_rank, prompt_ids, occurrence)``, ``seed`` being ``sampling_params['seed']`` when
    given, else ``rollout.seed``, and ``occurrence`` how many requests for the same prompt this server has taken
    before. The samples of a prompt therefore repeat across runs whatever the request ids and arrival order; only
    which of ``n`` identical requests receives which of the ``n`` samples follows arrival order. With more than
    one replica, which replica serves a prompt follows verl's load balancer (least loaded: timing). Under
    ``rollout.full_determinism`` verl names requests after their rows and routes them by name, and the name enters
    the seed (``request_seed``): every row's sample repeats.
    """

    def __init__(
        self,
        config: RolloutConfig | Mapping[str, Any],
        model_config: HFModelConfig | Mapping[str, Any],
        rollout_mode: RolloutMode = RolloutMode.HYBRID,
        replica_rank: int = 0,
        model: torch.nn.Module | None = None,
    ) -> None:
        """``model``: an already built causal LM (tests); by default it is loaded from ``model_config.local_path``."""
        self.config: RolloutConfig = omega_conf_to_dataclass(config)
        self.model_config: HFModelConfig = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.rollout_mode = rollout_mode
        self.replica_rank = int(replica_rank)
        log_probs_mode = self.config.logprobs_mode or "processed_logprobs"
        if log_probs_mode not in LOG_PROBS_MODES:
            raise ValueError(f"rollout.logprobs_mode={log_probs_mode!r}: the HF rollout serves {LOG_PROBS_MODES}")
        self.log_probs_mode = log_probs_mode
        engine_options = dict((self.config.engine_kwargs or {}).get(ROLLOUT_NAME) or {})
        if model is None:
            path = self.model_config.local_path or self.model_config.path
            model = load_causal_lm(path, torch_threads=engine_options.get("num_threads"))
        self.sampler = HFTokenSampler(model, eos_token_ids_of(self.model_config))
        if not self.sampler.eos_token_ids:
            logger.warning("HF rollout: no end-of-sequence token id found; responses end at max_tokens only")
        max_positions = getattr(model.config, "max_position_embeddings", None)
        self.max_model_len = int(self.config.max_model_len or max_positions or 0)
        if self.max_model_len < 2:
            raise ValueError("rollout.max_model_len is unset and the model config has no max_position_embeddings")

        self.global_steps: int | None = None
        self._occurrences: dict[bytes, int] = {}
        self._decode_lock = asyncio.Lock()
        self._in_flight: set[str] = set()
        self._abort_requested = False
        self._gate_open = asyncio.Event()
        self._gate_open.set()
        self._rejecting = False

    # -- generation ------------------------------------------------------------------------------------------

    def sampling_settings(
        self, prompt_length: int, sampling_params: Mapping[str, Any]
    ) -> tuple[SamplingSettings, bool]:
        """Resolve verl's ``sampling_params`` against the rollout config, as ``vLLMHttpServer.generate`` does.

        The agent loop passes temperature, top_p, top_k, repetition_penalty and logprobs (bool: return
        log-probs); the tool agent adds stop_token_ids; clients may pass max_tokens or max_new_tokens. Without
        them, max tokens = min(response_length, prompt_length + response_length - prompt length), clamped to
        [1, max_model_len - prompt length]. Returns the settings and whether log-probs were asked for.
        """
        unknown = set(sampling_params) - _SAMPLING_KEYS_USED - _SAMPLING_KEYS_WITHOUT_EFFECT
        if unknown:
            raise ValueError(f"HF rollout: unsupported sampling_params {sorted(unknown)}")
        if int(sampling_params.get("n", 1)) != 1:
            raise ValueError("HF rollout: one sample per request (n=1); verl repeats the prompt for n>1")
        headroom = self.max_model_len - prompt_length
        if headroom < 1:
            raise ValueError(
                f"Prompt length ({prompt_length}) leaves no room to generate within max_model_len "
                f"({self.max_model_len}); need at least 1 token of headroom."
            )
        max_tokens = sampling_params.get("max_tokens", sampling_params.get("max_new_tokens"))
        if max_tokens is None:
            config = self.config
            max_tokens = min(config.response_length, config.prompt_length + config.response_length - prompt_length)
        max_tokens = max(1, min(int(max_tokens), headroom))
        top_k = sampling_params.get("top_k", -1)
        settings = SamplingSettings(
            max_tokens=max_tokens,
            temperature=float(sampling_params.get("temperature", 1.0)),
            top_p=float(sampling_params.get("top_p", 1.0)),
            top_k=-1 if top_k is None else int(top_k),
            repetition_penalty=float(sampling_params.get("repetition_penalty", self.config.repetition_penalty)),
            stop_token_ids=frozenset(int(token) for token in (sampling_params.get("stop_token_ids") or ())),
            ignore_eos=bool(sampling_params.get("ignore_eos", self.config.ignore_eos)),
            log_probs_mode=self.log_probs_mode,
        )
        logprobs = sampling_params.get("logprobs", False)
        return settings, logprobs is not None and logprobs is not False

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        audio_data: list[Any] | None = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """Token-in/token-out generation (verl's server protocol): response ids and, when
        ``sampling_params['logprobs']``, each one's log-prob under the distribution it was drawn from."""
        if image_data is not None or video_data is not None or audio_data is not None:
            raise NotImplementedError("HF rollout serves text-only models: image/video/audio data is not supported")
        prompt = _token_list(prompt_ids)
        settings, return_log_probs = self.sampling_settings(len(prompt), sampling_params)
        # Counted before any await: one event loop, so the occurrence numbers of concurrent requests are distinct.
        request_name = str(request_id) if self.config.full_determinism else ""
        key = _prompt_key(prompt) + request_name.encode()
        occurrence = self._occurrences.get(key, 0)
        self._occurrences[key] = occurrence + 1
        request_given_seed = sampling_params.get("seed")
        base_seed = int(self.config.seed if request_given_seed is None else request_given_seed)
        generator = torch.Generator(device="cpu")
        generator.manual_seed(request_seed(base_seed, self.replica_rank, prompt, occurrence, request_name))

        while not self._gate_open.is_set():
            if self._rejecting:
                return self._aborted_output()
            await self._gate_open.wait()
        self._in_flight.add(request_id)
        try:
            async with self._decode_lock:
                if self._abort_requested:
                    return self._aborted_output()
                response = await asyncio.to_thread(
                    self.sampler.sample, prompt, settings, generator, lambda: self._abort_requested
                )
        finally:
            self._in_flight.discard(request_id)
        return TokenOutput(
            token_ids=response.token_ids,
            log_probs=response.log_probs if return_log_probs else None,
            stop_reason=response.stop_reason,
            num_preempted=0,
            extra_fields={"global_steps": self.global_steps, "num_cached_tokens": 0},
        )

    def _aborted_output(self) -> TokenOutput:
        return TokenOutput(
            token_ids=[], log_probs=None, stop_reason="aborted", extra_fields={"global_steps": self.global_steps}
        )

    # -- weights ----------------------------------------------------------------------------------------------

    async def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of Hugging Face-named tensors (from ``HFServerAdapter.update_weights``); returns its
        size. Waits for the request being decoded, so no response mixes two weight versions."""
        async with self._decode_lock:
            return self.sampler.load_weights(named_tensors)

    async def set_global_steps(self, global_steps: int | None) -> None:
        """Record the training step of the weights now loaded (reported in ``TokenOutput.extra_fields``)."""
        self.global_steps = global_steps

    # -- control calls verl makes on servers (verl 0.9.1 ``RolloutReplica`` and ``vLLMHttpServer``) ---------

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        """Stop the request being decoded (it returns 'aborted' with its tokens so far) and hold new ones until
        ``resume_generation`` (or refuse them, 'aborted', when ``reject_request``)."""
        self._gate_open.clear()
        self._rejecting = reject_request
        self._abort_requested = True
        request_ids = sorted(self._in_flight)
        async with self._decode_lock:  # the decode in progress has stopped
            self._abort_requested = False
        return {"aborted_count": len(request_ids), "request_ids": request_ids}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        """Single-request abort is not offered: requests are decoded one at a time and finish quickly."""
        return {"aborted": False, "request_id": request_id}

    async def resume_generation(self) -> None:
        """Admit requests again after ``abort_all_requests``."""
        self._rejecting = False
        self._gate_open.set()

    async def resume_engine_generation(self) -> None:
        """Nothing to resume in an engine: admission is the gate ``open_submission_gate`` opens."""

    async def open_submission_gate(self) -> None:
        await self.resume_generation()

    async def wait_for_requests_to_drain(self) -> None:
        """Return once no request is being decoded."""
        while self._in_flight:
            await asyncio.sleep(0.01)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """No-op: weights and cache stay in host memory."""

    async def sleep(self) -> None:
        """No-op: there is no device memory to hand back to the trainer."""

    async def clear_kv_cache(self) -> None:
        """No-op: the key/value cache lives only for the duration of one request."""

    async def release_kv_cache(self) -> None:
        """No-op (see ``clear_kv_cache``)."""

    async def resume_kv_cache(self) -> None:
        """No-op (see ``clear_kv_cache``)."""

    async def start_profile(self, **kwargs: Any) -> None:
        """No-op: no engine profiler on the host."""

    async def stop_profile(self) -> None:
        """No-op: no engine profiler on the host."""

    def get_server_address(self) -> str:
        return server_address(self.replica_rank)

    def get_rollout_config(self) -> RolloutConfig:
        return self.config


def server_actor_name(replica_rank: int, name_suffix: str = "") -> str:
    """Ray actor name of replica ``replica_rank``'s server; ``HFServerAdapter`` looks it up by this name."""
    return f"{SERVER_NAME_PREFIX}{replica_rank}{name_suffix}"


def server_address(replica_rank: int, name_suffix: str = "") -> str:
    """The replica's key in verl's load balancer. Not an HTTP endpoint: the HF server speaks only Ray calls."""
    return f"ray://{server_actor_name(replica_rank, name_suffix)}"


# --------------------------------------------------------------------------------------------------------------
# Server adapter (inside each hybrid actor worker)
# --------------------------------------------------------------------------------------------------------------


class HFServerAdapter(BaseRollout):
    """verl's ``BaseRollout`` for the HF server, living in each hybrid ``ActorRolloutRefWorker`` (verl 0.9.x).

    ``update_weights`` consumes the actor's weight generator on every rank (Megatron's export runs collectives
    while it yields, so every rank must iterate it) and rank 0 of each replica, the only one holding a server,
    sends the tensors in buckets of ``checkpoint_engine.update_weights_bucket_megabytes`` to its server by Ray
    calls. ``resume`` and ``release`` do nothing: the server's memory is host memory.
    """

    def __init__(
        self,
        config: RolloutConfig,
        model_config: HFModelConfig,
        device_mesh: Any = None,
        replica_rank: int = -1,
    ) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        replica_world_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // replica_world_size if replica_rank == -1 else int(replica_rank)
        self.rollout_rank = rank % replica_world_size
        self.is_leader_rank = self.rollout_rank == 0
        self.server_handle: ray.actor.ActorHandle | None = None

    def _server(self) -> ray.actor.ActorHandle:
        if self.server_handle is None:  # the replica launches its server after the workers exist
            self.server_handle = ray.get_actor(server_actor_name(self.replica_rank))
        return self.server_handle

    async def resume(self, tags: list[str]) -> None:
        """No-op: nothing was released."""

    async def release(self) -> None:
        """No-op: there is no device memory to release."""

    @torch.no_grad()
    async def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
        wire_format: str = "named_tensors",
        global_steps: int | None = None,
        peft_config: Any = None,
        **kwargs: Any,
    ) -> None:
        """Load the actor's full weights (``(name, tensor)`` pairs, Hugging Face naming) into the replica's server."""
        if wire_format != "named_tensors":
            raise ValueError(f"HF rollout takes wire_format='named_tensors' (full tensors), got {wire_format!r}")
        if peft_config is not None:
            raise NotImplementedError("HF rollout loads full weights only; use model.lora.merge=True for LoRA")
        bucket_bytes = max(1, int(self.config.checkpoint_engine.update_weights_bucket_megabytes)) << 20
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        loaded = 0
        async for name, tensor in _iterate(weights):
            if not self.is_leader_rank:
                continue  # iterated for the collectives only
            host_copy = tensor.detach().to("cpu", copy=True)  # the exporter may reuse its buffers
            bucket.append((name, host_copy))
            size += host_copy.numel() * host_copy.element_size()
            if size >= bucket_bytes:
                loaded += await self._server().load_weights.remote(bucket)
                bucket, size = [], 0
        if not self.is_leader_rank:
            return
        if bucket:
            loaded += await self._server().load_weights.remote(bucket)
        if loaded == 0:
            raise ValueError("update_weights received no tensors: the rollout would keep its old weights")
        await self._server().clear_kv_cache.remote()
        if global_steps is not None:
            await self._server().set_global_steps.remote(global_steps)
        logger.info("HF rollout replica %d: loaded %d tensors (step %s)", self.replica_rank, loaded, global_steps)

    def generate_sequences(self, prompts: Any) -> Any:
        raise NotImplementedError("HF rollout is server mode only: generate through the agent loop")


async def _iterate(items: Iterable[Any] | AsyncIterable[Any]):
    if hasattr(items, "__aiter__"):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


# --------------------------------------------------------------------------------------------------------------
# Replica (trainer side)
# --------------------------------------------------------------------------------------------------------------


class HFReplica(RolloutReplica):
    """verl's ``RolloutReplica`` for the HF rollout (verl 0.9.x): one CPU server actor per replica.

    Hybrid mode only (rollout and training share the workers, weights synced by ``HFServerAdapter``). The server
    asks Ray for no GPU and no CPU: the workers hold the logical GPUs a CPU run starts Ray with and take turns
    with the rollout, so reserving anything would only block scheduling. It is pinned to the node of the
    replica's first worker.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(HFRolloutServer)

    async def launch_servers(self) -> None:
        if self.rollout_mode != RolloutMode.HYBRID:
            raise NotImplementedError(
                f"HF rollout supports hybrid mode only (rollout in the training workers), not {self.rollout_mode}; "
                "colocated and standalone servers would need a checkpoint engine to receive weights"
            )
        if len(self.workers) != self.world_size:
            raise RuntimeError(
                f"replica {self.replica_rank} has {len(self.workers)} workers, expected {self.world_size}"
            )
        node_id = await self.workers[0].__ray_call__.remote(lambda worker: ray.get_runtime_context().get_node_id())
        name = server_actor_name(self.replica_rank, self.name_suffix)
        server = self.server_class.options(
            name=name,
            num_cpus=0,
            num_gpus=0,
            max_concurrency=self.max_concurrency,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ).remote(
            config=self.config,
            model_config=self.model_config,
            rollout_mode=self.rollout_mode,
            replica_rank=self.replica_rank,
        )
        await server.get_server_address.remote()  # the model is loaded
        self.servers = [server]
        self._server_handle = server
        self._server_address = server_address(self.replica_rank, self.name_suffix)


__all__ = [
    "HFReplica",
    "HFRolloutServer",
    "HFServerAdapter",
    "HFTokenSampler",
    "ROLLOUT_NAME",
    "SampledResponse",
    "SamplingSettings",
    "eos_token_ids_of",
    "load_causal_lm",
    "request_seed",
    "server_actor_name",
]
