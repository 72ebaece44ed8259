"""Credit assignment: outcome rewards and judge outputs in, per-turn / per-token advantages out.

Pure tensor functions, chosen by name (docs/methods.md §1-6, §10, §11)::

    from fastcredit.credit import CreditInputs, compute_advantages, estimator_needs
    inputs = CreditInputs.from_batch(batch, reward_B, critic_label_S=..., values_N=...)
    result = compute_advantages(cfg.credit.estimator, inputs, cfg.credit)

    types.py       TurnKind, CreditInputs, CreditResult, Needs (what an estimator needs)
    registry.py    estimators by name, with their Needs; compute_advantages
    segments.py    vectorised group / segment reductions and the discounted scan
    grpo.py … pica.py   one estimator each; reference.py holds their loop-based references
    gigpo.py       GiGPO, its loop reference beside it; anchors.py builds its step groups
    igsearch.py    IG-Search: the information gain on the search queries over GRPO, its loop reference beside it
    dapo.py        DAPO dynamic sampling (which groups to drop, how many prompts to refill)
    metrics.py     the advantage statistics every estimator reports
    accuracy.py    credit accuracy per turn: turn AUC and miscredit against good / wasted search labels

``CreditConfig``, the ``credit.*`` config section, lives in ``fastcredit.config.credit`` (no torch) and is
exported here too. Names are imported lazily (PEP 562) so that the config loader, which reads that
section, stays free of torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "CreditInputs": "types", "CreditResult": "types", "Needs": "types", "TurnKind": "types",
    "ESTIMATORS": "registry", "REFERENCES": "registry", "compute_advantages": "registry",
    "estimator_names": "registry", "estimator_needs": "registry", "get_estimator": "registry",
    "register_estimator": "registry",
    "CreditConfig": "fastcredit.config.credit",
    "DynamicSamplingDecision": "dapo", "dynamic_sampling_step": "dapo", "take_groups": "dapo",
    "estimator_metrics": "metrics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fastcredit.credit' has no attribute {name!r}")
    where = _EXPORTS[name]
    module = importlib.import_module(where if "." in where else f"fastcredit.credit.{where}")
    if where == "registry":
        module.load_estimators()
    return getattr(module, name)
