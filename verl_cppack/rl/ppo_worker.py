"""A CP worker that also holds the critic: values and the clipped value-loss update, next to the actor's methods.

``PPOWorker`` extends ``CPWorker`` (policy, frozen reference, sampling, log-probs, actor update) with a value
model built by the same factory with ``value_head=True``. Like every worker method these are collectives:
all CP ranks call them with the same arguments; rank 0 returns the result, the others ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from verl_cppack.rl.critic import clipped_value_loss, critic_values
from verl_cppack.rl.policy import model_kwargs, resolve_factory
from verl_cppack.rl.worker import CPWorker, WorkerSettings


@dataclass(frozen=True)
class PPOWorkerSettings(WorkerSettings):
    """``WorkerSettings`` plus the critic's optimiser and value clipping (verl's ``critic.cliprange_value``).

    The model factory must accept ``value_head=True`` (``build_tiny_gpt`` does) for the critic.
    """

    critic_learning_rate: float = 3e-3
    critic_max_grad_norm: float = 1.0
    value_clip: float = 0.5
    zero_value_head: bool = True  # start from values 0 instead of the head's random init (noise in GAE)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("critic_learning_rate", "critic_max_grad_norm", "value_clip"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def zero_value_head(critic: torch.nn.Module) -> None:
    """Zero the scalar head (``output_layer.weight`` ``[1, hidden]``, as ``build_tiny_gpt`` makes it) in place."""
    head = getattr(getattr(critic, "output_layer", None), "weight", None)
    if not isinstance(head, torch.Tensor) or head.dim() != 2 or head.shape[0] != 1:
        raise ValueError(
            "zero_value_head=True needs the critic's scalar head at output_layer.weight [1, hidden]; this model "
            "factory builds something else (set zero_value_head=False)"
        )
    with torch.no_grad():
        head.zero_()


def describe_critic_path(forward: str) -> str:
    if forward == "verl":
        from verl_cppack.integrations.verl import is_installed

        patched = "patched by verl_cppack" if is_installed() else "NOT patched"
        return f"verl.models.mcore.model_forward.gptmodel_forward_model_engine(value_model=True) ({patched})"
    return "verl_cppack.rl.critic.critic_values (plan -> packed forward -> unpack)"


class PPOWorker(CPWorker):
    def __init__(self, rank: int, world_size: int, master_port: int, settings: PPOWorkerSettings) -> None:
        if not isinstance(settings, PPOWorkerSettings):
            raise TypeError(f"PPOWorker needs PPOWorkerSettings, got {type(settings).__name__}")
        super().__init__(rank, world_size, master_port, settings)
        self.critic: torch.nn.Module | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None

    def setup(self, with_policy: bool = True) -> dict[str, Any]:
        """The actor's set-up, then the critic: same trunk initialisation, a fresh scalar value head."""
        info = super().setup(with_policy)
        factory = resolve_factory(self.settings.model_factory)
        critic = factory(**model_kwargs(self.settings), value_head=True).to(self.device)
        if self.settings.zero_value_head:
            zero_value_head(critic)
        self._broadcast_parameters(critic)  # every rank holds rank 0's weights
        critic.train()
        self.critic = critic
        self.critic_optimizer = torch.optim.Adam(critic.parameters(), lr=self.settings.critic_learning_rate)
        info["critic_forward"] = describe_critic_path(self.settings.forward)
        return info

    @torch.no_grad()
    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
        """The critic's values ``[B, S]`` (next-token alignment, 0 at padding) on rank 0, else None."""
        assert self.ctx is not None and self.critic is not None, "call setup() first"
        self.critic.eval()
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        values = critic_values(self.critic, input_ids, attention_mask, self.ctx, forward=self.settings.forward)
        self.critic.train()
        return values.cpu() if self.rank == 0 else None

    def update_critic(self, batch: dict[str, torch.Tensor], num_mini_batches: int) -> dict[str, float] | None:
        """One epoch of clipped value-loss steps over ``num_mini_batches`` mini-batches; mean metrics on rank 0.

        batch: input_ids, attention_mask [B, S]; loss_mask [B, S] (response positions, next-token alignment);
        old_values (the critic's values at rollout) and returns [B, S]. Gradients under the gather-back
        contract cover this rank's tokens; they are summed over the CP group before the optimiser step.
        """
        assert self.ctx is not None and self.critic is not None and self.critic_optimizer is not None

        def value_loss(mini: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
            values = critic_values(
                self.critic, mini["input_ids"], mini["attention_mask"], self.ctx, forward=self.settings.forward
            )
            out = clipped_value_loss(
                values, mini["old_values"], mini["returns"], mini["loss_mask"], clip_range=self.settings.value_clip
            )
            return out.loss, [out.loss, out.clip_fraction, out.value_mean]

        return self._train_epoch(
            batch,
            num_mini_batches,
            self.critic,
            self.critic_optimizer,
            self.settings.critic_max_grad_norm,
            ("value_loss", "value_clip_fraction", "value_mean", "critic_grad_norm"),
            value_loss,
        )


__all__ = ["PPOWorker", "PPOWorkerSettings", "describe_critic_path", "zero_value_head"]
