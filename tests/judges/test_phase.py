"""The judge phase and the config read an estimator's declared Needs, never its name."""
import pytest

from fastcredit.config import ConfigError, load_config
from fastcredit.credit.registry import NEEDS, estimator_needs
from fastcredit.credit.types import Needs
from fastcredit.judges.oracle import OracleBackend
from fastcredit.judges.phase import build_judge_phase, build_proceed_hook, make_backend


@pytest.fixture
def grpo_needs(monkeypatch):
    """Let grpo declare other needs for one test (the registry is restored afterwards)."""
    estimator_needs("grpo")  # load the registry before patching it

    def declare(**kw):
        monkeypatch.setitem(NEEDS, "grpo", Needs(**kw))

    return declare


def test_validation_follows_the_declaration(grpo_needs):
    load_config(None, ["credit.estimator=grpo"])
    grpo_needs(judge="prm")
    with pytest.raises(ConfigError, match="credit.estimator=grpo needs a process reward model"):
        load_config(None, ["credit.estimator=grpo"])
    grpo_needs(judge="critic")
    with pytest.raises(ConfigError, match="needs a critic"):
        load_config(None, ["credit.estimator=grpo"])
    grpo_needs(proceed_rollout=True)
    with pytest.raises(ConfigError, match="rollout.proceed.enabled=true"):
        load_config(None, ["credit.estimator=grpo"])


def test_the_judge_phase_builds_the_declared_judge(grpo_needs):
    assert build_judge_phase(load_config(None, ["credit.estimator=grpo"]), None, None) is None  # nothing to run
    cfg = load_config(None, ["credit.estimator=grpo", "judges.backend=oracle"])
    backend = make_backend(cfg, policy_engine=None, device=None)
    assert isinstance(backend, OracleBackend)
    phase = build_judge_phase(cfg, backend, policy_engine=None)
    assert (phase.critic, phase.judge, phase.prm, phase.engine) == (None, None, None, None)
    grpo_needs(judge="round_judge")
    phase = build_judge_phase(cfg, backend, policy_engine=None)
    assert phase.judge is not None and phase.critic is None
    grpo_needs(judge="critic")
    assert build_judge_phase(cfg, backend, policy_engine=None).critic is not None
    grpo_needs(judge="prm")
    cfg.judges.prm = "some/folder"
    with pytest.raises(ValueError, match="judges.prm='some/folder'"):
        build_judge_phase(cfg, backend, policy_engine=None)
    assert build_proceed_hook(cfg, backend, None, None) is None


def test_an_external_refiner_needs_a_judge_engine():
    cfg = load_config(None, ["credit.estimator=proceed", "rollout.proceed.enabled=true", "judges.backend=oracle",
                             "rollout.proceed.refiner=external"])
    with pytest.raises(ValueError, match="refiner=external needs a colocated judges.model"):
        build_proceed_hook(cfg, OracleBackend(), policy_engine=object(), tokenizer=None)
    cfg.rollout.proceed.refiner = "self"
    policy = object()
    hook = build_proceed_hook(cfg, OracleBackend(), policy_engine=policy, tokenizer=None)
    assert hook.refiner is policy and hook.describe is not None
