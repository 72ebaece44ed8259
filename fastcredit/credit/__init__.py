"""Credit assignment: outcome rewards and judge outputs in, per-turn / per-token advantages out.

Pure tensor functions, chosen by name (METHODS.md §1-6)::

    from fastcredit.credit import CreditInputs, compute_advantages
    inputs = CreditInputs.from_batch(batch, reward_B, critic_label_S=..., values_N=...)
    result = compute_advantages(cfg.credit.estimator, inputs, cfg.credit)

Names are imported lazily (PEP 562) so that ``fastcredit.credit.config``, which the
config loader reads, stays free of torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "CreditInputs": "registry", "CreditResult": "registry", "ESTIMATORS": "registry", "REFERENCES": "registry",
    "VALUE_MODEL_ESTIMATORS": "registry", "compute_advantages": "registry", "get_estimator": "registry",
    "register_estimator": "registry", "estimator_names": "registry",
    "CreditConfig": "config", "LossConfig": "config",
    "DynamicSamplingDecision": "dapo", "dynamic_sampling_step": "dapo", "take_groups": "dapo",
    "estimator_metrics": "metrics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fastcredit.credit' has no attribute {name!r}")
    module = importlib.import_module(f"fastcredit.credit.{_EXPORTS[name]}")
    if _EXPORTS[name] == "registry":
        module.load_estimators()
    return getattr(module, name)
