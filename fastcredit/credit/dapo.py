"""DAPO's dynamic sampling: which groups to drop, how many prompts to refill (docs/methods.md §8).

Legend: B trajectories, G groups.

A group whose rewards are all equal has ``Â = 0`` for every sample: it carries no
policy gradient, only KL / entropy terms and a share of the token-mean denominator.
DAPO drops such groups and samples more prompts until the batch holds the target
number of groups; the trainer calls :func:`dynamic_sampling_step` after scoring each
round and :func:`take_groups` to cut the accumulated groups to the target (veRL
keeps the first ones in arrival order). The other DAPO pieces live in the loss:
separate ``loss.clip_low`` / ``loss.clip_high`` and ``loss.agg_mode = token-mean``.

Where the papers are silent: a group of one counts as "all rewards equal" and is
dropped (veRL keeps it; its advantage is 0 either way). The refill request is the
number of missing groups divided by the share of groups that survived so far
(rounded up), at least the missing count and at most one full batch; when no
group has survived yet it is one full batch, as veRL's ``gen_batch_size``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastcredit.config.credit import DynamicSamplingConfig
from fastcredit.credit.segments import degenerate_groups, group_index


@dataclass
class DynamicSamplingDecision:
    """The filter's verdict on one sampling round."""

    keep_B: torch.Tensor  # bool [B] trajectories of groups with at least two distinct rewards
    kept_groups: int  # groups of this round that survive
    dropped_groups: int  # groups of this round whose rewards are all equal
    refill_prompts: int  # prompts to sample next round (0 when done)
    done: bool  # enough groups in total, or out of refill rounds: train on what is kept

    @property
    def metrics(self) -> dict:
        total = self.kept_groups + self.dropped_groups
        return {"dropped_group_frac": self.dropped_groups / total if total else 0.0,
                "refill_prompts": float(self.refill_prompts)}


def keep_mask(reward_B: torch.Tensor, group_id_B: torch.Tensor) -> torch.Tensor:
    """bool ``[B]``: the trajectory's group has at least two distinct rewards."""
    return ~degenerate_groups(reward_B, group_id_B)


def dynamic_sampling_step(reward_B: torch.Tensor, group_id_B: torch.Tensor, cfg: DynamicSamplingConfig, *,
                          target_groups: int, kept_before: int = 0, seen_before: int = 0,
                          refill_round: int = 0) -> DynamicSamplingDecision:
    """Filter one round's groups and plan the next round.

    ``kept_before`` / ``seen_before``: groups kept / sampled in the earlier rounds of
    this step; ``refill_round``: how many refill rounds already ran (0 after the first
    sampling). With ``cfg.enabled = False`` everything is kept and nothing refilled.
    """
    inv_B, G = group_index(group_id_B)
    if not cfg.enabled:
        return DynamicSamplingDecision(torch.ones(reward_B.numel(), dtype=torch.bool, device=reward_B.device),
                                       G, 0, 0, True)
    keep_B = keep_mask(reward_B, group_id_B)
    kept = int(torch.zeros(G, dtype=torch.bool, device=inv_B.device).index_fill_(0, inv_B[keep_B], True).sum())
    have, seen = kept_before + kept, seen_before + G
    missing = target_groups - have
    if missing <= 0 or refill_round >= cfg.max_refill_rounds:
        return DynamicSamplingDecision(keep_B, kept, G - kept, 0, True)
    if have == 0:
        refill = target_groups
    else:
        refill = min(max(math.ceil(missing * seen / have), missing), target_groups)
    return DynamicSamplingDecision(keep_B, kept, G - kept, refill, False)


def take_groups(keep_B: torch.Tensor, group_id_B: torch.Tensor, n_groups: int) -> torch.Tensor:
    """bool ``[B]``: ``keep_B`` restricted to the first ``n_groups`` kept groups, in order of first appearance."""
    B = group_id_B.numel()
    if B == 0:
        return keep_B.clone()
    inv_B, G = group_index(group_id_B)
    # First position of every group, then the arrival rank of each kept group.
    dev = group_id_B.device
    first_G = torch.full((G,), B, dtype=torch.int64, device=dev).scatter_reduce(
        0, inv_B, torch.arange(B, device=dev), reduce="amin")
    kept_G = torch.zeros(G, dtype=torch.bool, device=dev).index_fill_(0, inv_B[keep_B], True)
    order_G = torch.argsort(torch.where(kept_G, first_G, torch.full_like(first_G, B)))
    rank_G = torch.empty_like(order_G).scatter_(0, order_G, torch.arange(G, device=dev))
    return keep_B & (rank_G[inv_B] < n_groups)
