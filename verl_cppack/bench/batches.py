"""Rollout-shaped batches: a left-padded prompt half and a right-padded response half, lengths spread out."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rollout_batch(
    batch_size: int, seq_len: int, *, vocab_size: int = 32_000, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, S] int64, attention_mask [B, S] bool)``.

    The first ``S // 2`` columns hold a prompt ending at the middle (left padding), the rest a response
    starting there (right padding). Prompt lengths are uniform in ``[1, S/2]``; response lengths follow a
    long-tailed spread (most short, some hitting the limit), as RL rollouts do.
    """
    generator = torch.Generator().manual_seed(seed)
    half = seq_len // 2
    prompt = torch.randint(1, half + 1, (batch_size, 1), generator=generator)
    fraction = torch.rand(batch_size, 1, generator=generator) ** 2  # long tail towards short responses
    response = (fraction * (seq_len - half)).long().clamp(min=1)
    columns = torch.arange(seq_len)
    mask = ((columns >= half - prompt) & (columns < half)) | ((columns >= half) & (columns < half + response))
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    return input_ids, mask


@dataclass(frozen=True)
class MicroBatch:
    """What verl's Megatron forward packs per micro-batch, as new tensors (nothing shared with any other batch)."""

    input_ids: torch.Tensor  # [B, S] int64
    labels: torch.Tensor  # [B, S] int64: the ids shifted left by one
    label_mask: torch.Tensor  # [B, S] bool: positions whose next token is real
    attention_mask: torch.Tensor  # [B, S] bool

    @property
    def shape(self) -> tuple[int, int]:
        batch_size, seq_len = self.attention_mask.shape
        return batch_size, seq_len

    def clone(self) -> MicroBatch:
        """The same values in new storage: a plan keyed on, or cached by, an earlier batch's tensors cannot match."""
        return MicroBatch(*(tensor.clone() for tensor in self.tensors))

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.input_ids, self.labels, self.label_mask, self.attention_mask


def micro_batch(batch_size: int, seq_len: int, *, seed: int, device: str = "cpu") -> MicroBatch:
    """A rollout batch (``rollout_batch``) with its labels and label mask, on ``device``."""
    input_ids, mask = rollout_batch(batch_size, seq_len, seed=seed)
    input_ids, mask = input_ids.to(device), mask.to(device)
    labels = torch.roll(input_ids, -1, dims=1)
    label_mask = mask & torch.roll(mask, -1, dims=1)
    return MicroBatch(input_ids, labels, label_mask, mask)


def batch_seed(batch_size: int, seq_len: int, index: int) -> int:
    """The seed of a point's ``index``-th micro-batch: the same batches in every run and on every rank."""
    return (batch_size * 1_000_003 + seq_len) * 1_000 + index


def _jagged(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


@dataclass(frozen=True)
class EngineMicroBatch:
    """What verl's engine forward (``gptmodel_forward_model_engine``) packs per micro-batch: jagged ``[B, j]`` tensors
    of the real tokens (the same rollout batch as ``MicroBatch``), as new tensors sharing one offsets tensor."""

    input_ids: torch.Tensor  # [B, j] int64 nested (jagged)
    labels: torch.Tensor  # [B, j] int64 nested: verl rolls them itself (need_roll=True)
    temperature: torch.Tensor  # [B, j] float32 nested: the per-token temperature verl packs for the logits processor

    @classmethod
    def of(cls, batch: MicroBatch, temperature: float = 1.0) -> EngineMicroBatch:
        mask = batch.attention_mask
        offsets = torch.nn.functional.pad(mask.sum(1).cumsum(0), (1, 0))
        values = batch.input_ids[mask]  # [N]
        temperatures = torch.full(values.shape, temperature, device=values.device)
        return cls(_jagged(values, offsets), _jagged(values.clone(), offsets), _jagged(temperatures, offsets))

    @property
    def batch_size(self) -> int:
        return self.input_ids.size(0)

    def clone(self) -> EngineMicroBatch:
        """The same values in new storage, the three sharing one new offsets tensor (as verl's do: its labels are a
        ``clone`` of the ids and its temperatures ``expand_as_nested`` of them)."""
        offsets = self.input_ids.offsets().clone()
        return EngineMicroBatch(*(_jagged(t.values().clone(), offsets) for t in self.tensors))

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.input_ids, self.labels, self.temperature
