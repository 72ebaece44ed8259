"""The learning-rate schedule: a linear warm-up, then constant, cosine or linear decay (``optim.*``).

The RL trainer sets the policy's and the value model's rates before each optimizer step
(:class:`LRSchedule`); the PRM trainer (``fastcredit.prm.train``) uses :func:`lr_factor` too.
"""
from __future__ import annotations

import math


def lr_factor(step: int, total: int, warmup_ratio: float, schedule: str) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` of ``total``."""
    warm = int(total * warmup_ratio)
    if step < warm:
        return (step + 1) / warm
    frac = (step - warm) / max(total - warm, 1)
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
    if schedule == "linear":
        return max(0.0, 1.0 - frac)
    return 1.0


def total_opt_steps(optim) -> int:
    """Optimizer steps of a whole run (an ``OptimConfig``): steps × PPO epochs × mini-batches per step."""
    return optim.total_steps * optim.ppo_epochs * max(optim.batch_prompts // optim.mini_batch_prompts, 1)


class LRSchedule:
    """Sets the learning rates before each optimizer step; ``opt_steps`` counts the steps taken (checkpointed).

    The value model warms up over ``optim.critic_warmup_ratio`` (``optim.warmup_ratio`` when null)."""

    def __init__(self, optim, opt_steps: int = 0):
        self.optim, self.opt_steps = optim, opt_steps

    def before_step(self, policy, value=None) -> None:
        """Set ``policy``'s (and ``value``'s) rate for the optimizer step about to be taken, and count it."""
        o, total = self.optim, total_opt_steps(self.optim)
        policy.set_lr(o.lr * lr_factor(self.opt_steps, total, o.warmup_ratio, o.schedule))
        if value is not None:
            warm = o.warmup_ratio if o.critic_warmup_ratio is None else o.critic_warmup_ratio
            value.set_lr(o.critic_lr * lr_factor(self.opt_steps, total, warm, o.schedule))
        self.opt_steps += 1
