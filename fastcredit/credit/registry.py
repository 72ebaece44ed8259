"""The registry of estimators by name, with what each one needs.

    @register_estimator("cwgrpo", needs=Needs(judge="round_judge", inputs=("judge_u_S", "judge_v_S")))
    def compute_cwgrpo_advantage(inputs: CreditInputs, cfg: CreditConfig) -> CreditResult: ...

    result = compute_advantages("cwgrpo", inputs, cfg)

Every module of this package is imported once (:func:`load_estimators`), so an estimator
registers itself by living here: adding one touches its own file, its config switches
and its tests. :func:`estimator_needs` is the one table the judge phase, model
construction and config validation read.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
from typing import Callable, Optional

from fastcredit.config.credit import CreditConfig
from fastcredit.credit.metrics import estimator_metrics
from fastcredit.credit.types import CreditInputs, CreditResult, Needs

Estimator = Callable[[CreditInputs, CreditConfig], CreditResult]
ESTIMATORS: dict[str, Estimator] = {}
REFERENCES: dict[str, Estimator] = {}
NEEDS: dict[str, Needs] = {}
_loaded = False


def register_estimator(name: str, registry: Optional[dict] = None, *, needs: Optional[Needs] = None):
    """Decorator: ``@register_estimator("grpo")`` adds ``compute_grpo_advantage`` to the registry.

    ``registry=REFERENCES`` registers a loop-based reference instead; ``needs`` is declared
    with the vectorised estimator (default: nothing beyond the batch layout).
    """
    table = ESTIMATORS if registry is None else registry

    def wrap(fn: Estimator) -> Estimator:
        if name in table:
            raise ValueError(f"estimator {name!r} is already registered")
        table[name] = fn
        if table is ESTIMATORS:
            NEEDS[name] = needs or Needs()
        return fn

    return wrap


def load_estimators() -> None:
    """Import every module of the package once; their decorators fill ESTIMATORS, REFERENCES and NEEDS."""
    global _loaded
    if _loaded:
        return
    for module in pkgutil.iter_modules([os.path.dirname(__file__)]):
        importlib.import_module(f"fastcredit.credit.{module.name}")
    _loaded = True


def estimator_names() -> list[str]:
    """The registered estimator names, sorted."""
    load_estimators()
    return sorted(ESTIMATORS)


def _lookup(table: dict, name: str):
    load_estimators()
    if name not in table:
        raise KeyError(f"unknown credit estimator {name!r}; valid: {', '.join(sorted(table))}")
    return table[name]


def get_estimator(name: str, reference: bool = False) -> Estimator:
    """The vectorised estimator ``name`` (or its loop-based reference); unknown names list the valid ones."""
    return _lookup(REFERENCES if reference else ESTIMATORS, name)


def estimator_needs(name: str) -> Needs:
    """What estimator ``name`` needs (judge kind, value model, ProCeed rollouts, inputs)."""
    return _lookup(NEEDS, name)


def compute_advantages(name: str, inputs: CreditInputs, cfg: CreditConfig, reference: bool = False) -> CreditResult:
    """Validate the inputs, run estimator ``name`` and merge the common logging metrics into ``result.metrics``."""
    estimator = get_estimator(name, reference)
    inputs.validate()
    inputs.require(*NEEDS[name].inputs, who=name)
    result = estimator(inputs, cfg)
    result.metrics = {**estimator_metrics(inputs, result), **result.metrics}
    return result
