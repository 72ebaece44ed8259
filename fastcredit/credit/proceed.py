"""``proceed``: ProCeedRL's loss weights over GRPO or DAPO group advantages (docs/methods.md §5).

Legend: N packed tokens, S turns, B trajectories.

The rollout marks refined (demonstration) action tokens with ``demo_mask_N``. The
estimator returns the group advantage per turn and two per-token masks the loss reads:

* ``loss_mask_N``: action tokens that count. Demonstration tokens of failed
  trajectories are masked out when ``proceed.mask_failed_demo`` (they leave the loss
  and its token counts). Success is ``R_i = 1``, taken as ``r_i ≥ 1`` as in ``cwgrpo``;
  with the paper's binary reward, failure is exactly ``R_i = 0``, and a partial reward
  (F1, or CriticSearch's format-only 0.2) counts as a failure too.
* ``phi_mask_N``: demonstration tokens of successful trajectories, which the loss
  weights by CHORD-φ ``p·(1 − p)``, ``p = exp(logπθ)`` detached, when
  ``proceed.chord_phi``. φ needs the *current* policy's probabilities, so the loss,
  not the estimator, evaluates it (``fastcredit.trainer.loss.chord_phi``); on-policy tokens
  keep weight 1.
* ``weight_N`` stays None (1 on every counted token).

``proceed.base = dapo`` keeps the same group advantage (DAPO's is GRPO's) and also
masks every token of a group whose rewards are all equal: DAPO's dynamic sampling
drops such groups, so when the trainer could not refill them they must not dilute
the token-mean or contribute KL / entropy terms. After the dynamic-sampling filter
has run there are none left and the two bases agree.
"""
from __future__ import annotations

import torch

from fastcredit.config.credit import CreditConfig
from fastcredit.credit.grpo import group_metrics
from fastcredit.credit.registry import register_estimator
from fastcredit.credit.segments import degenerate_groups, gather_turns, group_advantage
from fastcredit.credit.types import CreditInputs, CreditResult, Needs, as_result_tensor


# Per-turn flag bits, gathered once per token through seg_id_N.
_DEMO_MASKED, _DROPPED, _PHI = 1, 2, 4  # the mask arithmetic below relies on these bits


def proceed_token_masks(inputs: CreditInputs, cfg: CreditConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_mask_N, phi_mask_N)``, both bool ``[N]``.

    The conditions are per trajectory, so they are packed into per-turn flag bits and
    read per token with one gather (observation tokens read ``_DROPPED``).
    """
    pc = cfg.proceed
    if pc.base not in ("grpo", "dapo"):
        raise ValueError(f"unknown credit.proceed.base {pc.base!r}; valid: grpo, dapo")
    failed_B = inputs.reward_B.to(torch.float64) < 1.0
    dropped_B = degenerate_groups(inputs.reward_B, inputs.group_id_B) if pc.base == "dapo" \
        else torch.zeros_like(failed_B)
    flags_B = ((failed_B & pc.mask_failed_demo) * _DEMO_MASKED + dropped_B * _DROPPED
               + (~failed_B & ~dropped_B & pc.chord_phi) * _PHI).to(torch.uint8)
    flags_N = gather_turns(flags_B[inputs.seg_traj_S], inputs.seg_id_N, fill=_DROPPED)
    # Demonstration tokens are never observation tokens (data-model invariant); 0/1 bytes.
    demo_N = inputs.demo_mask_N.to(torch.bool).view(torch.uint8)
    mask_N = ((flags_N & _DROPPED) | (flags_N & demo_N)) == 0  # _DEMO_MASKED is bit 0, as demo_N
    phi_N = ((flags_N >> 2) & demo_N).view(torch.bool)  # _PHI is bit 2
    return mask_N, phi_N


@register_estimator("proceed", needs=Needs(proceed_rollout=True, inputs=("demo_mask_N",)))
def compute_proceed_advantage(inputs: CreditInputs, cfg: CreditConfig) -> CreditResult:
    """Group advantage per turn ([S]) plus ProCeedRL's per-token loss mask and CHORD-φ flags ([N])."""
    adv_B = group_advantage(inputs.reward_B, inputs.group_id_B, cfg.norm_by_std, cfg.eps)
    mask_N, phi_N = proceed_token_masks(inputs, cfg)
    metrics = group_metrics(inputs)
    n_action = int(inputs.seg_action_len_S.sum())
    if n_action:
        metrics["demo_token_frac"] = int(torch.count_nonzero(inputs.demo_mask_N)) / n_action
        metrics["masked_token_frac"] = 1.0 - int(torch.count_nonzero(mask_N)) / n_action
    return CreditResult(adv_S=as_result_tensor(adv_B[inputs.seg_traj_S]), loss_mask_N=mask_N, phi_mask_N=phi_N,
                        metrics=metrics)
