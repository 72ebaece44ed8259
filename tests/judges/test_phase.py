"""The judge phase and the Needs check read an estimator's declared Needs, never its name."""
import pytest

from fastcredit.config import ConfigError, load_config
from fastcredit.credit.needs import check_needs
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
    cfg = load_config(None, ["credit.estimator=grpo"])
    check_needs(cfg)
    grpo_needs(judge="prm")
    with pytest.raises(ConfigError, match="credit.estimator=grpo needs a process reward model"):
        check_needs(cfg)
    grpo_needs(judge="critic")
    with pytest.raises(ConfigError, match="needs a critic"):
        check_needs(cfg)
    grpo_needs(proceed_rollout=True)
    with pytest.raises(ConfigError, match="rollout.proceed.enabled=true"):
        check_needs(cfg)


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
    with pytest.raises(ValueError, match="judges.prm=some/folder: no such folder"):
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


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """A policy, a critic of the same architecture and one of another (HF folders)."""
    from fastcredit.data.tokenizer import build_tiny_tokenizer
    from fastcredit.models.tiny import build_tiny_policy, save_tiny_policy

    tok = build_tiny_tokenizer(["hello world where is the river"] * 20, vocab_size=300)
    out = {}
    for name, hidden, seed in (("policy", 32, 0), ("same", 32, 1), ("other", 64, 2)):
        out[name] = str(tmp_path_factory.mktemp(name))
        save_tiny_policy(build_tiny_policy(tok, hidden=hidden, layers=1, heads=2, seed=seed), tok, out[name])
    return tok, out


class _PolicyEngine:
    weight_dtype = __import__("torch").float32


def _colocated(folder, *extra):
    return load_config(None, ["credit.estimator=criticsearch", "credit.reward=criticsearch", "judges.backend=colocated",
                              f"judges.model={folder}", *extra])


def test_a_critic_of_the_policy_architecture_switches_into_the_policy_engine(tiny_folders):
    import torch
    from transformers import AutoConfig

    from fastcredit.distributed.colocate import PhaseManager

    tok, f = tiny_folders
    policy, conf = _PolicyEngine(), AutoConfig.from_pretrained(f["policy"])
    backend = make_backend(_colocated(f["same"]), policy, torch.device("cpu"), policy_config=conf)
    assert backend.engine is policy and backend.weights is not None and backend.tokenizer is not None
    assert build_judge_phase(_colocated(f["same"]), backend, policy).engine is None  # no second engine to wake
    PhaseManager(policy, None, judge_weights=backend.weights)  # what the trainer builds from it


def test_a_critic_of_another_architecture_gets_its_own_hf_engine_and_is_refused_beside_vllm(tiny_folders):
    import torch
    from transformers import AutoConfig

    tok, f = tiny_folders
    policy, conf = _PolicyEngine(), AutoConfig.from_pretrained(f["policy"])
    backend = make_backend(_colocated(f["other"]), policy, torch.device("cpu"), policy_config=conf)
    assert backend.engine is not policy and backend.weights is None
    assert build_judge_phase(_colocated(f["other"]), backend, policy).engine is backend.engine
    with pytest.raises(ValueError, match=r"hidden_size: policy 32, critic 64.*vllm serve .* judges.backend=http"):
        make_backend(_colocated(f["other"], "rollout.engine=vllm"), policy, torch.device("cpu"), policy_config=conf)
    # ProCeed asks its critic during the rollout: the weights cannot be switched in then
    proceed = ["credit.estimator=proceed", "credit.reward=em", "rollout.proceed.enabled=true", "rollout.engine=vllm"]
    with pytest.raises(ValueError, match="ProCeed's critic answers during the rollout"):
        make_backend(load_config(None, [*proceed, "judges.backend=colocated", f"judges.model={f['same']}"]), policy,
                     torch.device("cpu"), policy_config=conf)


def test_each_step_logs_its_own_judge_counts():
    # the runners count over their whole life; a step's metrics are that step's increase (failure_rate as it is)
    cfg = load_config(None, ["credit.estimator=criticsearch", "judges.backend=oracle"])
    phase = build_judge_phase(cfg, make_backend(cfg, policy_engine=None, device=None), policy_engine=None)
    first = phase._this_step("critic", {"requests": 32, "parse_failures": 2, "retries": 2, "failed": 0,
                                        "failure_rate": 0.0})
    second = phase._this_step("critic", {"requests": 60, "parse_failures": 3, "retries": 3, "failed": 1,
                                         "failure_rate": 0.25})
    assert first == {"critic/requests": 32.0, "critic/parse_failures": 2.0, "critic/retries": 2.0,
                     "critic/failed": 0.0, "critic/failure_rate": 0.0}
    assert second == {"critic/requests": 28.0, "critic/parse_failures": 1.0, "critic/retries": 1.0,
                      "critic/failed": 1.0, "critic/failure_rate": 0.25}
    assert phase._this_step("judge", {"requests": 5})["judge/requests"] == 5.0  # counted apart per judge
