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

Each estimator adds its own: ``degenerate_group_frac`` (group-based ones),
``good_turn_frac`` and ``critic_failure_rate`` (criticsearch; ``good_turn_frac``: of the
scored search turns, the share labelled Good), ``contributive_round_frac`` (cwgrpo: of the
judged rounds, non-final rounds of successes, the share with ``p = u·v = 1``; another judge
over other turns, hence another name), ``weight_entropy`` and ``judge_failure_rate``
(cwgrpo), ``demo_token_frac`` and ``masked_token_frac`` (proceed), ``step_reward_mean`` (pica).
"""
from __future__ import annotations

import torch

from fastcredit.credit.segments import group_advantage
from fastcredit.credit.types import TURN_KINDS, CreditInputs, CreditResult

ZERO_ADV_TOL = 1e-8


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
    outcome_C = group_advantage(inputs.reward_B, inputs.group_id_B, norm_by_std=False)[
        inputs.seg_traj_S[seg_N[counted_N]]]
    both_C = (adv_C.abs() > ZERO_ADV_TOL) & (outcome_C.abs() > ZERO_ADV_TOL)
    if bool(both_C.any()):
        metrics["against_outcome_frac"] = float((adv_C[both_C].sign() != outcome_C[both_C].sign()).double().mean())
    for k, name in enumerate(TURN_KINDS):  # a loop over the 4 kinds, not over data
        if cnt_K[k] > 0:
            metrics[f"adv_mean/{name}"] = float(mean_K[k])
            metrics[f"adv_std/{name}"] = float(std_K[k])
    return metrics
