"""What the chosen estimator needs of the config (a critic, a judge, a PRM, ProCeed rollouts) is configured.

    cfg = load_config(path, overrides)
    check_needs(cfg)   # ConfigError: "credit.estimator=cwgrpo needs a judge: set judges.backend to ..."

The needs are declared where each estimator registers (``fastcredit.credit.registry``); the
config package cannot read them (it imports nothing else of fastcredit), so the training
command calls this right after ``load_config`` and the trainer again before it builds anything.
"""
from __future__ import annotations

from fastcredit.config import ConfigError, TrainConfig
from fastcredit.credit.registry import estimator_needs

# What each judge kind of an estimator's Needs asks of the config: (unmet?, what to set).
JUDGE_SETTINGS = {
    "critic": (lambda c: c.judges.backend == "none", "a critic: set judges.backend to colocated, http or oracle"),
    "round_judge": (lambda c: c.judges.backend == "none", "a judge: set judges.backend to colocated, http or oracle"),
    "prm": (lambda c: not c.judges.prm, "a process reward model: set judges.prm"),
}


def check_needs(cfg: TrainConfig) -> None:
    """What ``cfg.credit.estimator`` declared it needs (:func:`fastcredit.credit.estimator_needs`) is configured;
    else a ConfigError naming the estimator and the key to set."""
    est = cfg.credit.estimator
    needs = estimator_needs(est)
    if needs.judge is not None:
        unmet, what = JUDGE_SETTINGS[needs.judge]
        if unmet(cfg):
            raise ConfigError(f"credit.estimator={est} needs {what}")
    if needs.proceed_rollout and not cfg.rollout.proceed.enabled:
        raise ConfigError(f"credit.estimator={est} needs rollout.proceed.enabled=true")
