"""Sampling for the Hugging Face rollout (torch only): one sequence decoded with a key/value cache, vLLM's rules."""

from __future__ import annotations

import hashlib
import math
import operator
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

GREEDY_TEMPERATURE = 1e-5  # below it, greedy (vLLM's _SAMPLING_EPS)
# rollout.logprobs_mode: 'processed' (verl's default; the distribution drawn from), 'raw' (the model's logits)
LOG_PROBS_MODES = ("processed_logprobs", "raw_logprobs")


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
    """The seed of one request's generator: a hash of (base seed, replica rank, prompt, occurrence, name).

    ``occurrence`` counts earlier requests for the same prompt (and name), so a GRPO group's samples differ while a
    rerun repeats them; ``request_name``: verl's row name under ``rollout.full_determinism``, else empty."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(array("q", [int(base_seed), int(replica_rank), int(occurrence)]).tobytes())
    digest.update(array("q", [int(token) for token in prompt_ids]).tobytes())
    digest.update(request_name.encode())
    return int.from_bytes(digest.digest(), "little") & (2**63 - 1)


def prompt_key(prompt_ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(array("q", [int(token) for token in prompt_ids]).tobytes(), digest_size=16).digest()


class HFTokenSampler:
    """Decoding of one sequence with a Hugging Face causal LM on the CPU, each token drawn as vLLM's sampler draws it."""

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
        """Decode up to ``settings.max_tokens`` tokens after ``prompt_ids``; stop after an end-of-sequence or stop
        token (kept, as in vLLM) or when ``should_abort()`` turns true between two steps ('aborted')."""
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
        logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator, seen: torch.Tensor | None = None
    ) -> tuple[int, float]:
        """A token from one position's ``logits`` ([vocab], float32) and its log-prob, in vLLM's order: repetition
        penalty (on tokens in ``seen``), then greedy or temperature, top-k, top-p and a draw."""
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
        """Copy Hugging Face-named tensors (``state_dict`` keys) into the model, cast to its dtype; returns how many.
        An unknown name or a shape mismatch is a ValueError: a skipped tensor would leave stale weights."""
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


def token_list(prompt_ids: Any) -> list[int]:
    """``prompt_ids`` (list, tuple, 1-D tensor or array of ints) as a list of Python ints."""
    if isinstance(prompt_ids, torch.Tensor) and prompt_ids.dim() != 1:
        raise ValueError(f"prompt_ids must be 1-D, got shape {tuple(prompt_ids.shape)}")
    if hasattr(prompt_ids, "tolist"):
        prompt_ids = prompt_ids.tolist()
    if not isinstance(prompt_ids, (list, tuple)):
        raise TypeError(f"prompt_ids must be a list of token ids, got {type(prompt_ids).__name__}")
    try:
        return [operator.index(token) for token in prompt_ids]
    except TypeError as error:
        raise TypeError(f"prompt_ids must contain integer token ids only: {error}") from error
