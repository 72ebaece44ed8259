"""Logging metrics every estimator reports (plain floats), computed without Python loops over data.

Legend: N packed tokens, S turns, K the four turn kinds.

Common to all estimators (:func:`estimator_metrics`), over the tokens that count in
the loss (``loss_mask_N``, else every action token):

* ``adv_mean/<kind>``, ``adv_std/<kind>`` for kind in search / answer / invalid /
  truncated: token-weighted, as the loss sees them; a kind without tokens is omitted.
* ``zero_adv_frac``: share of tokens whose advantage is 0 (|A| ≤ 1e-8), i.e. tokens
  that only feel the KL and entropy terms.
* ``adv_mean``, ``adv_std`` over all counted tokens.
* ``against_outcome_frac``: of the counted tokens with a nonzero advantage in a group whose
  rewards differ, the share whose advantage has the opposite sign to their trajectory's
  outcome ``r_i − mean_g r``: how often the turn-level credit reverses what outcome-only
  GRPO would push (0 for ``grpo``; value baselines reverse some tokens by design).
* ``degenerate_adv_share``: of the absolute advantage mass ``Σ|A|`` over the counted tokens,
  the share in groups whose samples all got the same outcome (all EM 1 or all EM 0): credit
  that can only come from the format bonus, a partial reward, a value baseline or a judge.
* ``all_fail_group_frac``: share of the batch's groups in which no sample succeeded (EM 0).
* ``all_fail_nonzero_frac``: of those all-fail groups, the share in which some counted token has a nonzero
  advantage (|A| > 1e-8): the groups outcome-only GRPO learns nothing from where the method still pushes
  (a format bonus, a value baseline, a judge, a step reward); absent in a batch without an all-fail group.

The per-turn accuracy of the credit against good / wasted search labels is in
:mod:`fastcredit.credit.accuracy` (it needs labels the estimator does not read).

Each estimator adds its own: ``degenerate_group_frac`` (group-based ones),
``good_turn_frac`` and ``critic_failure_rate`` (criticsearch; ``good_turn_frac``: of the
scored search turns, the share labelled Good), ``contributive_round_frac`` (cwgrpo: of the
judged rounds, non-final rounds of successes, the share with ``p = u·v = 1``; another judge
over other turns, hence another name), ``weight_entropy`` and ``judge_failure_rate``
(cwgrpo), ``demo_token_frac`` and ``masked_token_frac`` (proceed), ``step_reward_mean`` (pica),
``ig_scored_frac``, ``ig_mean``, ``ig_positive_frac``, ``ig_dead_frac`` and ``ig_shaped_mean`` (igsearch).
"""
from __future__ import annotations

import torch

from fastcredit.credit.segments import degenerate_groups, group_advantage, group_index, seg_max
from fastcredit.credit.types import TURN_KINDS, CreditInputs, CreditResult

ZERO_ADV_TOL = 1e-8


def succeeded(em_B: torch.Tensor) -> torch.Tensor:
    """bool ``[B]``: the trajectory's outcome is a success (exact match)."""
    return em_B.to(torch.float64) > 0.5


def outcome_metrics(inputs: CreditInputs, adv_C: torch.Tensor, traj_C: torch.Tensor) -> dict:
    """``degenerate_adv_share``, ``all_fail_group_frac`` and ``all_fail_nonzero_frac`` (module docstring) from the
    counted tokens' advantages ``adv_C`` (float64) and their trajectories ``traj_C``."""
    success_B = succeeded(inputs.em_B)
    inv_B, G = group_index(inputs.group_id_B)
    fail_G = seg_max(success_B.double(), inv_B, G) < 0.5
    metrics = {"all_fail_group_frac": float(fail_G.double().mean())}
    if bool(fail_G.any()):
        live_G = seg_max((adv_C.abs() > ZERO_ADV_TOL).double(), inv_B[traj_C], G) > 0.5
        metrics["all_fail_nonzero_frac"] = float(live_G[fail_G].double().mean())
    mass_C = adv_C.abs()
    total = float(mass_C.sum())
    if total > 0.0:
        same_B = degenerate_groups(success_B.double(), inputs.group_id_B)
        metrics["degenerate_adv_share"] = float(mass_C[same_B[traj_C]].sum()) / total
    return metrics


def estimator_metrics(inputs: CreditInputs, result: CreditResult) -> dict:
    """Common advantage statistics of one estimator's result (see the module docstring)."""
    seg_N = inputs.seg_id_N.long()
    counted_N = result.loss_mask_N.bool() if result.loss_mask_N is not None else seg_N >= 0
    n = int(counted_N.sum())
    if n == 0 or inputs.S == 0:
        return {}
    adv_N = result.token_advantages(inputs.seg_id_N).to(torch.float64)
    adv_C = adv_N[counted_N]
    kind_C = inputs.seg_kind_S.long()[seg_N[counted_N]]
    K = len(TURN_KINDS)
    # Per-kind count, sum and sum of squares in one pass each (index_add_ over 4 bins).
    zeros_K = adv_C.new_zeros(K)
    cnt_K = zeros_K.index_add(0, kind_C, torch.ones_like(adv_C))
    sum_K = zeros_K.index_add(0, kind_C, adv_C)
    mean_K = sum_K / cnt_K.clamp(min=1)
    sq_K = zeros_K.index_add(0, kind_C, (adv_C - mean_K[kind_C]) ** 2)
    std_K = (sq_K / cnt_K.clamp(min=1)).sqrt()
    metrics = {
        "adv_mean": float(adv_C.mean()),
        "adv_std": float(adv_C.std(unbiased=False)),
        "zero_adv_frac": float((adv_C.abs() <= ZERO_ADV_TOL).double().mean()),
    }
    traj_C = inputs.seg_traj_S[seg_N[counted_N]]
    outcome_C = group_advantage(inputs.reward_B, inputs.group_id_B, norm_by_std=False)[traj_C]
    both_C = (adv_C.abs() > ZERO_ADV_TOL) & (outcome_C.abs() > ZERO_ADV_TOL)
    if bool(both_C.any()):
        metrics["against_outcome_frac"] = float((adv_C[both_C].sign() != outcome_C[both_C].sign()).double().mean())
    metrics.update(outcome_metrics(inputs, adv_C, traj_C))
    for k, name in enumerate(TURN_KINDS):  # a loop over the 4 kinds, not over data
        if cnt_K[k] > 0:
            metrics[f"adv_mean/{name}"] = float(mean_K[k])
            metrics[f"adv_std/{name}"] = float(std_K[k])
    return metrics
