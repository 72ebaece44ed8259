"""``igsearch``: IG-Search's information gain of each search turn, added to GRPO on its query (docs/methods.md §11).

Legend: N packed tokens, S turns, B trajectories, Q the query tokens of the rewarded turns.

    g_t   = 0 if |IG_t| < δ, else IG_t                                 dead zone, δ = igsearch.delta
    g_t   ← λ·g_t where g_t < 0                                        λ = igsearch.neg_scale ≤ 1
    ĨG_t  = c·tanh(g_t / c)                                            soft clip, c = igsearch.clip
    A_k   = Â_i + α·ĨG_t / |Q_t|     k a token of turn t's query         α = igsearch.alpha
    A_k   = Â_i                      every other action token of trajectory i

``IG_t`` (``ig_S``) and the query spans come from the training side's scoring phase
(``fastcredit.trainer.igscore``): the gold answer's weighted mean log-prob under the rollout policy after
turn t's own observation, minus its mean over N observations of other search turns. ``Â_i`` is GRPO's
group advantage (§0). A turn adds nothing when it is not a search, when its query has no token, or when
the phase gave it no gain (NaN: no observation, no gold answer, no other observation to compare with):
a trajectory that never searched gets ``Â_i`` on every token, as under ``grpo``. ``α = 0`` is ``grpo``.
The loop reference is at the end of this file.
"""
from __future__ import annotations

import math

import torch

from fastcredit.config.credit import CreditConfig
from fastcredit.credit.grpo import group_metrics
from fastcredit.credit.reference import group_advantage_reference
from fastcredit.credit.registry import REFERENCES, register_estimator
from fastcredit.credit.segments import gather_turns, group_advantage
from fastcredit.credit.types import CreditInputs, CreditResult, Needs, TurnKind, as_result_tensor

INPUTS = ("ig_S", "seg_query_start_S", "seg_query_len_S")


def shape_information_gain(ig: torch.Tensor, delta: float, neg_scale: float, clip: float) -> torch.Tensor:
    """float64, ``ig``'s shape: ``c·tanh(g / c)`` where ``g`` is ``ig`` outside the dead zone ``|ig| < delta`` (0
    inside) and ``neg_scale·ig`` where that is negative. Finite values in; the caller decides what NaN means."""
    g = ig.to(torch.float64)
    g = torch.where(g.abs() < delta, torch.zeros_like(g), g)
    g = torch.where(g < 0, neg_scale * g, g)
    return clip * torch.tanh(g / clip)


def rewarded_turns(inputs: CreditInputs) -> torch.Tensor:
    """bool ``[S]``: search turns with a gain (not NaN) and at least one query token, whose query gets the IG term."""
    return ((inputs.seg_kind_S.long() == int(TurnKind.SEARCH)) & ~torch.isnan(inputs.ig_S.to(torch.float64))
            & (inputs.seg_query_len_S > 0))


def check_query_spans(inputs: CreditInputs) -> None:
    """Every query span lies inside its turn's action; a ValueError names the first that does not."""
    start_S, len_S = inputs.seg_query_start_S, inputs.seg_query_len_S
    bad = (start_S < 0) | (len_S < 0) | (start_S + len_S > inputs.seg_action_len_S)
    if bool(bad.any()):
        s = int(torch.nonzero(bad)[0])
        raise ValueError(f"turn {s}: query tokens [{int(start_S[s])}, {int(start_S[s] + len_S[s])}) lie outside its "
                         f"{int(inputs.seg_action_len_S[s])} action tokens")


def _metrics(inputs: CreditInputs, rewarded_S: torch.Tensor, ig_S: torch.Tensor, shaped_S: torch.Tensor,
             delta: float) -> dict:
    """``ig_scored_frac``: of the search turns, the share with a gain and a query; over those turns ``ig_mean``,
    ``ig_positive_frac``, ``ig_dead_frac`` (inside the dead zone) and ``ig_shaped_mean`` (ĨG)."""
    metrics = group_metrics(inputs)
    search_S = inputs.seg_kind_S.long() == int(TurnKind.SEARCH)
    if bool(search_S.any()):
        metrics["ig_scored_frac"] = float(rewarded_S[search_S].double().mean())
    if bool(rewarded_S.any()):
        ig = ig_S[rewarded_S]
        metrics.update(ig_mean=float(ig.mean()), ig_positive_frac=float((ig > 0).double().mean()),
                       ig_dead_frac=float((ig.abs() < delta).double().mean()),
                       ig_shaped_mean=float(shaped_S[rewarded_S].mean()))
    return metrics


@register_estimator("igsearch", needs=Needs(gold_answers=True, answer_scoring=True, inputs=INPUTS))
def compute_igsearch_advantage(inputs: CreditInputs, cfg: CreditConfig) -> CreditResult:
    """``adv_N``: ``Â_i`` on every action token of trajectory i, plus ``α·ĨG_t / |Q_t|`` on turn t's query tokens."""
    c = cfg.igsearch
    check_query_spans(inputs)
    adv_B = group_advantage(inputs.reward_B, inputs.group_id_B, cfg.norm_by_std, cfg.eps)
    adv_N = gather_turns(adv_B[inputs.seg_traj_S], inputs.seg_id_N)  # float64, 0 on observations
    rewarded_S = rewarded_turns(inputs)
    ig_S = torch.nan_to_num(inputs.ig_S.to(torch.float64), nan=0.0)
    shaped_S = torch.where(rewarded_S, shape_information_gain(ig_S, c.delta, c.neg_scale, c.clip),
                           torch.zeros_like(ig_S))
    len_S = torch.where(rewarded_S, inputs.seg_query_len_S, torch.zeros_like(inputs.seg_query_len_S))
    bonus_S = c.alpha * shaped_S / len_S.clamp(min=1).to(torch.float64)
    first_S = inputs.seg_start_S + inputs.seg_query_start_S
    Q = int(len_S.sum())
    within_Q = torch.arange(Q, device=adv_N.device) - torch.repeat_interleave(torch.cumsum(len_S, 0) - len_S, len_S)
    adv_N.index_add_(0, torch.repeat_interleave(first_S, len_S) + within_Q, torch.repeat_interleave(bonus_S, len_S))
    return CreditResult(adv_N=as_result_tensor(adv_N), turn_S={"ig": ig_S, "shaped": shaped_S, "bonus": bonus_S},
                        metrics=_metrics(inputs, rewarded_S, ig_S, shaped_S, c.delta))


@register_estimator("igsearch", REFERENCES)
def igsearch_reference(inp: CreditInputs, cfg: CreditConfig) -> CreditResult:
    c = cfg.igsearch
    adv = group_advantage_reference(inp.reward_B.tolist(), inp.group_id_B.tolist(), cfg.norm_by_std, cfg.eps)
    traj, kinds = inp.seg_traj_S.tolist(), inp.seg_kind_S.tolist()
    out = [0.0] * inp.N
    for s in range(inp.S):
        start = int(inp.seg_start_S[s])
        for j in range(start, start + int(inp.seg_action_len_S[s])):
            out[j] = adv[traj[s]]
        ig, q = float(inp.ig_S[s]), int(inp.seg_query_len_S[s])
        if kinds[s] != TurnKind.SEARCH or math.isnan(ig) or q == 0:
            continue
        g = 0.0 if abs(ig) < c.delta else ig
        if g < 0:
            g = c.neg_scale * g
        g = c.clip * math.tanh(g / c.clip)
        first = start + int(inp.seg_query_start_S[s])
        for j in range(first, first + q):
            out[j] += c.alpha * g / q
    return CreditResult(adv_N=torch.tensor(out, dtype=torch.float64).to(torch.float32))
