"""Config section of credit assignment (``credit.*``).

Equations and defaults: docs/methods.md. Each switch names the paper's behaviour as the
default and the released code's as an alternative where the two disagree.

Who reads what: the estimators in this package read ``credit.*`` except ``reward``,
``lambda_f`` and ``format_bonus`` (``fastcredit.credit.rewards``), ``critic.retries`` and
``criticsearch.gold_answer`` (the judge that asks the critic) and ``dynamic_sampling``
(the trainer, through ``fastcredit.credit.dapo``). The loss's section is
``fastcredit.config.loss``. No torch import here: the config loader stays light.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from fastcredit.config.fields import COUNT, NONNEG, POS, UNIT, opt


@dataclass
class CriticConfig:
    retries: int = opt(2, "re-ask the critic this many times when its answer cannot be parsed or has the wrong count",
                       range=NONNEG)
    on_failure: Literal["outcome", "skip"] = opt(
        "outcome", "after the retries: 'outcome' labels every search turn with EM, 'skip' "
                   "gives the trajectory A^a = 0")


@dataclass
class CriticSearchConfig:
    alpha: float = opt(0.25, "Eq. 8 mix: alpha * turn advantage + (1 - alpha) * group advantage", range=UNIT)
    eps_c: float = opt(1e-6, "Eq. 7 denominator epsilon", range=POS)
    gold_answer: bool = opt(True, "show the critic the gold answers (false: the paper's 'NG' ablation)")


@dataclass
class CWGRPOConfig:
    alpha: float = opt(math.inf, "softmax temperature of contribution weights (Eq. 3); inf: p / sum p",
                       range="[0, inf]", note="inf: p / sum p")
    all_zero: Literal["uniform", "zero"] = opt(
        "uniform", "alpha = inf and every p = 0 in a success: uniform weights (paper) or zero (released code)")
    success_by: Literal["reward", "advantage"] = opt(
        "reward", "success means R_i = 1 (paper) or A^_i >= 0 (released code)")


@dataclass
class PiCAConfig:
    step_reward: Literal["log_ratio", "linear"] = opt(
        "log_ratio", "log f(t) - log f(t-1) (paper) or 1 - h_t - b (released code)")
    gae_level: Literal["token", "turn"] = opt("token", "GAE over action tokens, or over turns with values at "
                                                       "turn boundaries (Eq. 13)")
    s_step: float = opt(0.3, "scale of step rewards", range=NONNEG)
    s_out: float = opt(1.5, "scale of the outcome reward", range=NONNEG)
    lambda_p: float = opt(0.3, "step penalty lambda_p (Eq. 11)", range=NONNEG)
    alpha_p: float = opt(1.5, "step penalty growth alpha_p (Eq. 11)", range=POS)
    penalty_from_turn: int = opt(3, "first turn t that pays the step penalty lambda_p * "
                                    "alpha_p^(t - penalty_from_turn)", range=COUNT, note="turns count from 1")
    hazard_bias: float = opt(0.55, "b of the linear reward 1 - h_t - b", range=UNIT)
    f_clamp: float = opt(1e-4, "f is clamped to [f_clamp, 1 - f_clamp] before the log",
                         range="(0, 0.5)", note="f is clamped to [f_clamp, 1 - f_clamp] before the log")


@dataclass
class ProceedConfig:
    base: Literal["grpo", "dapo"] = opt("grpo", "group advantages under the ProCeed rollouts")
    chord_phi: bool = opt(True, "weight demonstration tokens of successful trajectories by phi = p (1 - p)")
    mask_failed_demo: bool = opt(True, "mask demonstration tokens of failed trajectories (R_i = 0)")


@dataclass
class GiGPOConfig:
    omega: float = opt(1.0, "weight of the step advantage: A = A_episode + omega * A_step", range=NONNEG)
    gamma: float = opt(0.95, "discount of the step returns inside step groups", range=UNIT)
    step_norm: Literal["mean_std_norm", "mean_norm"] = opt(
        "mean_std_norm", "step groups: (R - mean) / (std + eps), or R - mean (the released code's mean_norm)")
    episode_stats: Literal["trajectories", "turns"] = opt(
        "trajectories", "episode mean / std over the group's trajectories (paper) or its turns (released code)")
    anchor: Literal["history", "last"] = opt(
        "history", "a turn's anchor state: every earlier observation, or only the last (released search env)")
    match: Literal["exact", "similar"] = opt("exact", "step groups of equal anchor states, or of similar ones")
    threshold: float = opt(0.95, "match=similar: least estimated Jaccard similarity of two anchor states",
                           range="(0, 1]")
    shingle: int = opt(4, "match=similar: tokens per n-gram of an observation", range="[1, 16]")
    bins: int = opt(128, "match=similar: bins of the one-permutation MinHash sketch of an anchor state",
                    range=COUNT)
    invalid_penalty: float = opt(0.0, "reward -p on every invalid turn (the released search recipe: 0.01)",
                                 range=NONNEG)


@dataclass
class IGSearchConfig:
    delta: float = opt(0.1, "dead zone: a search turn's information gain (nats per gold token) with |IG| < delta "
                            "counts as 0", range=NONNEG)
    neg_scale: float = opt(0.5, "lambda: a negative information gain is multiplied by it before the soft clip",
                           range=UNIT, note="1: both signs alike")
    clip: float = opt(1.0, "c of the soft clip c * tanh(g / c)", range=POS)
    alpha: float = opt(1.0, "weight of the clipped gain, spread over the query's tokens: A = A^ + alpha * IG~ / |Q|",
                       range=NONNEG, note="0: grpo")
    n_random: int = opt(3, "N: observations drawn from the step's other search turns for the counterfactual baseline",
                        range=COUNT)
    max_golds: int = opt(3, "score at most this many of a question's gold answers (the best one is kept)",
                         range=COUNT)
    opening: Literal["released", "policy"] = opt(
        "released", "what comes between a scored context's observation and the gold answer: released, IG-Search's "
                    "code's '\\n<answer> '; policy, the think the policy itself writes there (greedy, up to "
                    "</think>, by the rollout engine), then '\\n<answer> ' (docs/methods.md §11)")


@dataclass
class DynamicSamplingConfig:
    enabled: bool = opt(False, "DAPO: drop groups whose rewards are all equal and refill with new prompts")
    max_refill_rounds: int = opt(3, "extra sampling rounds to refill dropped groups before training on fewer",
                                 range=NONNEG)


@dataclass
class CreditConfig:
    estimator: Literal["grpo", "ppo", "criticsearch", "cwgrpo", "proceed", "pica", "gigpo", "igsearch"] = opt(
        "grpo", "advantage estimator (docs/methods.md sections 1-6, 10 and 11)")
    reward: Literal["auto", "criticsearch", "em", "f1", "f1_format"] = opt(
        "auto", "outcome reward: CriticSearch Eq. 4, plain EM, F1, or F1 + format (PiCA); auto: Eq. 4, or plain EM on "
                "the lookup toy world (data.toy.kind=lookup), whose study of credit pays no format bonus")
    lambda_f: float = opt(0.2, "format weight of CriticSearch Eq. 4", range=UNIT)
    format_bonus: float = opt(0.2, "format reward added to F1 by the f1_format reward", range=NONNEG)
    norm_by_std: bool = opt(True, "divide group advantages by the group's std (false: Dr. GRPO)")
    eps: float = opt(1e-6, "epsilon of the group std", range=POS, note="0 divides by zero in a group of equal rewards")
    gamma: float = opt(1.0, "GAE discount (ppo, pica)", range=UNIT)
    lam: float = opt(1.0, "GAE lambda (ppo, pica)", range=UNIT)
    whiten_advantages: bool = opt(False, "ppo / pica: whiten GAE advantages over the batch's action "
                                         "tokens, as veRL's GAE does")
    kl_in_reward: float = opt(0.0, "beta of a per-token -beta * KL reward (ppo, pica); 0 keeps KL in the loss only",
                              range=NONNEG)
    critic: CriticConfig = opt(CriticConfig, "critic / judge failure policy")
    criticsearch: CriticSearchConfig = opt(CriticSearchConfig, "CriticSearch switches")
    cwgrpo: CWGRPOConfig = opt(CWGRPOConfig, "CW-GRPO switches")
    pica: PiCAConfig = opt(PiCAConfig, "PiCA switches")
    proceed: ProceedConfig = opt(ProceedConfig, "ProCeedRL loss weights")
    gigpo: GiGPOConfig = opt(GiGPOConfig, "GiGPO switches")
    igsearch: IGSearchConfig = opt(IGSearchConfig, "IG-Search's information gain and its mapping to advantages")
    dynamic_sampling: DynamicSamplingConfig = opt(DynamicSamplingConfig, "DAPO dynamic sampling")


def outcome_reward(cfg) -> str:
    """The outcome reward a run pays (``credit.reward``, ``auto`` resolved): ``cfg`` is the whole TrainConfig."""
    if cfg.credit.reward != "auto":
        return cfg.credit.reward
    lookup = cfg.data.source == "toy" and cfg.data.toy.kind == "lookup"
    return "em" if lookup else "criticsearch"
