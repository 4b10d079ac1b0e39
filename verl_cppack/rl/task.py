"""The synthetic GRPO task: "count up from the prompt's last digit", with a rule-based reward in [0, 1].

A prompt is a random run of ``min_prompt_length..max_prompt_length`` tokens from ``[0, vocab_size)``, left-padded
(verl's rollout layout). The ideal response continues counting modulo ``vocab_size`` from the prompt's last token:
prompt ``[.., 7]`` -> response ``[8, 9, 10, ..]``. The reward is the fraction of response tokens that are the
previous token plus one (mod ``vocab_size``), so it gives partial credit per position and a random policy scores
about ``1 / vocab_size``. A tiny GPT learns it in a few dozen GRPO steps on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CountingTask:
    vocab_size: int = 16
    min_prompt_length: int = 2
    max_prompt_length: int = 6
    response_length: int = 6

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
        if not 1 <= self.min_prompt_length <= self.max_prompt_length:
            raise ValueError(
                f"need 1 <= min_prompt_length <= max_prompt_length, got {self.min_prompt_length}, {self.max_prompt_length}"
            )
        if self.response_length < 1:
            raise ValueError(f"response_length must be >= 1, got {self.response_length}")

    @property
    def sequence_length(self) -> int:
        return self.max_prompt_length + self.response_length

    def sample_prompts(self, num_prompts: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompts: ``(prompt_ids [N, P] int64, prompt_mask [N, P] bool)``, padding ids are 0."""
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        width = self.max_prompt_length
        lengths = torch.randint(self.min_prompt_length, width + 1, (num_prompts,), generator=generator)  # [N]
        tokens = torch.randint(0, self.vocab_size, (num_prompts, width), generator=generator)  # [N, P]
        columns = torch.arange(width)  # [P]
        prompt_mask = columns.unsqueeze(0) >= (width - lengths).unsqueeze(1)  # [N, P], real tokens at the right
        return tokens.masked_fill(~prompt_mask, 0), prompt_mask

    def reward(self, prompt_ids: torch.Tensor, response_ids: torch.Tensor) -> torch.Tensor:
        """Fraction of response tokens equal to their predecessor + 1 (mod V): ``[N] float32`` in [0, 1].

        ``prompt_ids [N, P]`` must be left-padded (its last column is the last real prompt token);
        ``response_ids [N, R]`` are the generated tokens.
        """
        if prompt_ids.dim() != 2 or response_ids.dim() != 2 or prompt_ids.shape[0] != response_ids.shape[0]:
            raise ValueError(
                f"prompt_ids [N, P] and response_ids [N, R] must share N; got {tuple(prompt_ids.shape)} "
                f"and {tuple(response_ids.shape)}"
            )
        previous = torch.cat([prompt_ids[:, -1:], response_ids[:, :-1]], dim=1)  # [N, R]
        correct = response_ids == (previous + 1) % self.vocab_size  # [N, R]
        return correct.float().mean(dim=1)
