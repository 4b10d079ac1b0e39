"""The Hugging Face rollout server (``verl_adapter.HFReplica``'s Ray actor): verl's token-in/token-out protocol over
``HFTokenSampler``, answering ``generate`` as vLLM's ``vLLMHttpServer`` does, plus verl's control calls on a server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.replica import RolloutMode, TokenOutput

from verl_cppack.runtime.cpu_fixes import HF_ROLLOUT_NAME
from verl_cppack.runtime.rollout.sampling import (
    LOG_PROBS_MODES,
    HFTokenSampler,
    SamplingSettings,
    load_causal_lm,
    prompt_key,
    request_seed,
    token_list,
)

logger = logging.getLogger(__name__)

_SAMPLING_KEYS_USED = frozenset(
    ("temperature", "top_p", "top_k", "repetition_penalty", "logprobs", "seed", "n")
    + ("max_tokens", "max_new_tokens", "stop_token_ids", "ignore_eos")
)
# text-side options: they change how vLLM detokenizes, not which tokens it returns
_SAMPLING_KEYS_WITHOUT_EFFECT = frozenset({"skip_special_tokens", "spaces_between_special_tokens", "detokenize"})


def eos_token_ids_of(model_config: Any) -> frozenset[int]:
    """End-of-sequence ids from a verl ``HFModelConfig``: generation config, model config and tokenizer."""
    found: set[int] = set()
    for source in ("generation_config", "hf_config", "tokenizer"):
        value = getattr(getattr(model_config, source, None), "eos_token_id", None)
        if value is not None:
            found.update(int(token) for token in (value if isinstance(value, (list, tuple, set)) else [value]))
    return frozenset(found)


class HFRolloutServer:
    """The rollout server of one replica: an HF causal LM in float32 behind verl's server protocol; requests decoded
    one at a time (two host cores gain nothing from interleaving), each seeded by ``request_seed``."""

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
        engine_options = dict((self.config.engine_kwargs or {}).get(HF_ROLLOUT_NAME) or {})
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
        """Resolve verl's ``sampling_params`` against the rollout config as ``vLLMHttpServer.generate`` does -> (the
        settings, whether log-probs were asked for); max tokens are clamped to the model's headroom."""
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
        settings = SamplingSettings(
            max_tokens=max_tokens,
            temperature=float(sampling_params.get("temperature", 1.0)),
            top_p=float(sampling_params.get("top_p", 1.0)),
            top_k=int(sampling_params.get("top_k") or -1),  # None and 0 are off too
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
        prompt = token_list(prompt_ids)
        settings, return_log_probs = self.sampling_settings(len(prompt), sampling_params)
        # Counted before any await: one event loop, so the occurrence numbers of concurrent requests are distinct.
        request_name = str(request_id) if self.config.full_determinism else ""
        key = prompt_key(prompt) + request_name.encode()
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

    open_submission_gate = resume_generation

    async def wait_for_requests_to_drain(self) -> None:
        """Return once no request is being decoded."""
        while self._in_flight:
            await asyncio.sleep(0.01)

    async def _no_op(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do on the host: weights and KV cache are host memory, no profiler, admission is the gate."""

    wake_up = sleep = clear_kv_cache = release_kv_cache = resume_kv_cache = _no_op
    start_profile = stop_profile = resume_engine_generation = _no_op

    def get_server_address(self) -> str:
        return server_address(self.replica_rank)

    def get_rollout_config(self) -> RolloutConfig:
        return self.config


def server_actor_name(replica_rank: int, name_suffix: str = "") -> str:
    """Ray actor name of replica ``replica_rank``'s server; ``HFServerAdapter`` looks it up by this name."""
    return f"{HF_ROLLOUT_NAME}_server_{replica_rank}{name_suffix}"


def server_address(replica_rank: int, name_suffix: str = "") -> str:
    """The replica's key in verl's load balancer. Not an HTTP endpoint: the HF server speaks only Ray calls."""
    return f"ray://{server_actor_name(replica_rank, name_suffix)}"
