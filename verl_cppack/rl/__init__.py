"""GRPO on Ray with context-parallel workers: synthetic task, rule reward, advantages, losses, workers, driver.

Heavy imports (Ray, Megatron) happen only inside the worker / runner modules.
"""

from verl_cppack.rl.advantages import group_normalized_advantages
from verl_cppack.rl.losses import PolicyLossOutput, clipped_policy_loss, low_variance_kl, masked_token_mean
from verl_cppack.rl.task import CountingTask

__all__ = [
    "CountingTask",
    "PolicyLossOutput",
    "clipped_policy_loss",
    "group_normalized_advantages",
    "low_variance_kl",
    "masked_token_mean",
]
