"""Config sections of credit assignment (``credit.*``) and the losses (``loss.*``).

Equations and defaults: METHODS.md. Each switch names the paper's behaviour as the
default and the released code's as an alternative where the two disagree.

Who reads what: the estimators in this package read ``credit.*`` except ``reward``,
``lambda_f`` and ``format_bonus`` (``fastcredit.rewards``), ``critic.retries`` and
``criticsearch.gold_answer`` (the judge that asks the critic) and ``dynamic_sampling``
(the trainer, through ``fastcredit.credit.dapo``); ``fastcredit.loss`` reads ``loss.*``.
No torch import here: the config loader stays light.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional


def _f(default, help: str):
    if isinstance(default, type):
        return field(default_factory=default, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class CriticConfig:
    retries: int = _f(2, "re-ask the critic this many times when its answer cannot be parsed or has the wrong count")
    on_failure: Literal["outcome", "skip"] = _f("outcome", "after the retries: 'outcome' labels every search turn with EM, 'skip' gives the trajectory A^a = 0")


@dataclass
class CriticSearchConfig:
    alpha: float = _f(0.25, "Eq. 8 mix: alpha * turn advantage + (1 - alpha) * group advantage")
    eps_c: float = _f(1e-6, "Eq. 7 denominator epsilon")
    gold_answer: bool = _f(True, "show the critic the gold answers (false: the paper's 'NG' ablation)")


@dataclass
class CWGRPOConfig:
    alpha: float = _f(math.inf, "softmax temperature of contribution weights (Eq. 3); inf: p / sum p")
    all_zero: Literal["uniform", "zero"] = _f("uniform", "alpha = inf and every p = 0 in a success: uniform weights (paper) or zero (released code)")
    success_by: Literal["reward", "advantage"] = _f("reward", "success means R_i = 1 (paper) or A^_i >= 0 (released code)")


@dataclass
class PiCAConfig:
    step_reward: Literal["log_ratio", "linear"] = _f("log_ratio", "log f(t) - log f(t-1) (paper) or 1 - h_t - b (released code)")
    gae_level: Literal["token", "turn"] = _f("token", "GAE over action tokens, or over turns with values at turn boundaries (Eq. 13)")
    s_step: float = _f(0.3, "scale of step rewards")
    s_out: float = _f(1.5, "scale of the outcome reward")
    lambda_p: float = _f(0.3, "step penalty lambda_p (Eq. 11)")
    alpha_p: float = _f(1.5, "step penalty growth alpha_p (Eq. 11)")
    penalty_from_turn: int = _f(3, "first turn t that pays the step penalty lambda_p * alpha_p^(t - 3)")
    hazard_bias: float = _f(0.55, "b of the linear reward 1 - h_t - b")
    f_clamp: float = _f(1e-4, "f is clamped to [f_clamp, 1 - f_clamp] before the log")


@dataclass
class ProceedConfig:
    base: Literal["grpo", "dapo"] = _f("grpo", "group advantages under the ProCeed rollouts")
    chord_phi: bool = _f(True, "weight demonstration tokens of successful trajectories by phi = p (1 - p)")
    mask_failed_demo: bool = _f(True, "mask demonstration tokens of failed trajectories (R_i = 0)")


@dataclass
class DynamicSamplingConfig:
    enabled: bool = _f(False, "DAPO: drop groups whose rewards are all equal and refill with new prompts")
    max_refill_rounds: int = _f(3, "extra sampling rounds to refill dropped groups before training on fewer")


@dataclass
class CreditConfig:
    estimator: Literal["grpo", "ppo", "criticsearch", "cwgrpo", "proceed", "pica"] = _f("grpo", "advantage estimator (METHODS.md sections 1-6)")
    reward: Literal["criticsearch", "em", "f1", "f1_format"] = _f("criticsearch", "outcome reward: CriticSearch Eq. 4, plain EM, F1, or F1 + format (PiCA)")
    lambda_f: float = _f(0.2, "format weight of CriticSearch Eq. 4")
    format_bonus: float = _f(0.2, "format reward added to F1 by the f1_format reward")
    norm_by_std: bool = _f(True, "divide group advantages by the group's std (false: Dr. GRPO)")
    eps: float = _f(1e-6, "epsilon of the group std")
    gamma: float = _f(1.0, "GAE discount (ppo, pica)")
    lam: float = _f(1.0, "GAE lambda (ppo, pica)")
    whiten_advantages: bool = _f(False, "ppo / pica: whiten GAE advantages over the batch's action tokens, as veRL's GAE does")
    kl_in_reward: float = _f(0.0, "beta of a per-token -beta * KL reward (ppo, pica); 0 keeps KL in the loss only")
    critic: CriticConfig = _f(CriticConfig, "critic / judge failure policy")
    criticsearch: CriticSearchConfig = _f(CriticSearchConfig, "CriticSearch switches")
    cwgrpo: CWGRPOConfig = _f(CWGRPOConfig, "CW-GRPO switches")
    pica: PiCAConfig = _f(PiCAConfig, "PiCA switches")
    proceed: ProceedConfig = _f(ProceedConfig, "ProCeedRL loss weights")
    dynamic_sampling: DynamicSamplingConfig = _f(DynamicSamplingConfig, "DAPO dynamic sampling")


@dataclass
class LossConfig:
    clip_low: float = _f(0.2, "ratio lower clip: 1 - clip_low")
    clip_high: float = _f(0.2, "ratio upper clip: 1 + clip_high (DAPO: 0.28)")
    dual_clip: Optional[float] = _f(None, "dual-clip constant c for negative advantages (e.g. 3.0); null: off")
    kl_coef: float = _f(1e-3, "beta of the k3 KL to the reference policy")
    kl_clamp: float = _f(10.0, "k3 KL is clamped to [-kl_clamp, kl_clamp]")
    entropy_coef: float = _f(0.0, "eta of the entropy bonus -eta * H")
    agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "turn-mean"] = _f("token-mean", "how token losses are averaged over the global batch")
    value_clip: float = _f(0.2, "clip range of the value loss (ppo, pica)")
    vf_coef: float = _f(0.5, "value-loss weight")
    impl: Literal["auto", "triton", "torch"] = _f("auto", "policy-loss implementation: Triton kernels on CUDA tensors, torch elsewhere")
