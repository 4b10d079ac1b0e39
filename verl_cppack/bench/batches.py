"""The one rollout-batch maker (``rollout_batch``), for the bench, the benchmarks, the CLI checks and the tests.

* ``padding="rollout"`` (the default, what RL rollouts look like): the first ``prompt_len`` columns (default
  ``S // 2``) hold a left-padded prompt of 1..prompt_len tokens, the rest a right-padded response of
  ``shortest``..S-prompt_len tokens, long-tailed towards short ones. ``shortest=0`` allows empty responses.
* ``padding="anywhere"``: each row holds ``shortest``..S real tokens placed anywhere: half the rows one run of
  tokens (left, right or middle padding), the others scattered (gaps). ``shortest=0`` allows empty rows.
* ``short_rows``: the share of rows made 3 tokens or fewer (a 1-token prompt and ``shortest``..``shortest + 2``
  response tokens, or ``shortest``..max(shortest, 3) tokens anywhere); default 0 for "rollout", 0.3 for "anywhere".
* ids are uniform in ``[1, vocab_size)``, drawn after the mask. With ``generator`` the batch is drawn from it
  (``seed`` unused), so a caller draws its extra tensors from the same stream."""

from __future__ import annotations

from dataclasses import dataclass

import torch

PADDINGS = ("rollout", "anywhere")


def rollout_batch(
    batch_size: int,
    seq_len: int,
    *,
    padding: str = "rollout",
    prompt_len: int | None = None,
    shortest: int = 1,
    short_rows: float | None = None,
    vocab_size: int = 32_000,
    seed: int = 0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, S] int64, attention_mask [B, S] bool)``: see the module docstring for the arguments."""
    if padding not in PADDINGS:
        raise ValueError(f"padding must be one of {PADDINGS}, got {padding!r}")
    generator = generator if generator is not None else torch.Generator().manual_seed(seed)
    if padding == "anywhere":
        mask = _anywhere(generator, batch_size, seq_len, shortest, 0.3 if short_rows is None else short_rows)
    else:
        prompt = seq_len // 2 if prompt_len is None else prompt_len
        mask = _rollout(generator, batch_size, seq_len, prompt, shortest, short_rows or 0.0)
    return torch.randint(1, vocab_size, mask.shape, generator=generator), mask


def _rollout(
    generator: torch.Generator, batch: int, seq_len: int, prompt: int, shortest: int, short_rows: float
) -> torch.Tensor:
    if not 0 < prompt < seq_len or not 0 <= shortest <= seq_len - prompt:
        raise ValueError(f"need 0 < prompt_len < seq_len and 0 <= shortest <= the response length, got {prompt=}")
    prompts = torch.randint(1, prompt + 1, (batch, 1), generator=generator)
    fraction = torch.rand(batch, 1, generator=generator) ** 2  # long tail towards short responses
    responses = (fraction * (seq_len - prompt)).long().clamp(min=shortest)
    if short_rows:
        short = torch.rand(batch, 1, generator=generator) < short_rows
        prompts = torch.where(short, 1, prompts)
        few = torch.randint(shortest, min(shortest + 2, seq_len - prompt) + 1, (batch, 1), generator=generator)
        responses = torch.where(short, few, responses)
    columns = torch.arange(seq_len)
    return ((columns >= prompt - prompts) & (columns < prompt)) | ((columns >= prompt) & (columns < prompt + responses))


def _anywhere(generator: torch.Generator, batch: int, seq_len: int, shortest: int, short_rows: float) -> torch.Tensor:
    if not 0 <= shortest <= seq_len:
        raise ValueError(f"need 0 <= shortest <= seq_len, got {shortest=}")
    lengths = torch.randint(shortest, seq_len + 1, (batch,), generator=generator)
    short = torch.randint(shortest, max(shortest, 3) + 1, (batch,), generator=generator)
    lengths = torch.where(torch.rand(batch, generator=generator) < short_rows, short, lengths)
    scores = torch.rand(batch, seq_len, generator=generator)  # a scattered row's real tokens: its highest scores
    gapped = torch.rand(batch, generator=generator) < 0.5  # the other rows: one run, placed anywhere
    starts = (torch.rand(batch, generator=generator) * (seq_len - lengths + 1)).long()
    columns = torch.arange(seq_len)
    run = (columns >= starts[:, None]) & (columns < (starts + lengths)[:, None])
    ranks = scores.argsort(dim=1, descending=True).argsort(dim=1)
    return torch.where(gapped[:, None], ranks < lengths[:, None], run)


@dataclass(frozen=True)
class MicroBatch:
    """What verl's Megatron forward packs per micro-batch, as new tensors (nothing shared with any other batch)."""

    input_ids: torch.Tensor  # [B, S] int64
    labels: torch.Tensor  # [B, S] int64: the ids shifted left by one
    label_mask: torch.Tensor  # [B, S] bool: positions whose next token is real
    attention_mask: torch.Tensor  # [B, S] bool

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.attention_mask.shape)  # (B, S)

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
    """What verl's engine forward packs per micro-batch: jagged ``[B, j]`` real tokens sharing one offsets tensor."""

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
        """The same values in new storage, the three sharing one new offsets tensor (as verl's do)."""
        offsets = self.input_ids.offsets().clone()
        return EngineMicroBatch(*(_jagged(t.values().clone(), offsets) for t in self.tensors))

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.input_ids, self.labels, self.temperature
