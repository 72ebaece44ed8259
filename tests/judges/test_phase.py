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


class _CountingJudge:
    """A CW-GRPO judge backend that records what it is asked: round 0 of a trajectory is contributive, others not."""

    def __init__(self):
        self.asked = []  # (question, round) of every request

    async def complete(self, requests):
        self.asked += [(r.item.question, r.turn) for r in requests]
        return ['{"thinking_reward": 1, "retrieval_reward": %d}' % (r.turn == 0) for r in requests]


# (reward, group, search rounds before the answer) per trajectory: a success, a format-only 0.2, a failure in
# group 0; a format-only 0.2 and a failure in group 1.
_CW_BATCH = [(1.0, 0, 3), (0.2, 0, 2), (0.0, 0, 1), (0.2, 1, 1), (0.0, 1, 1)]


def _cw_rollout():
    import types

    import torch

    from fastcredit.credit.types import TurnKind
    from fastcredit.rollout.trajectory import Turn, from_turns

    def step(kind, b, t):
        return types.SimpleNamespace(kind=kind, action_text=f"<search>q{b} round {t}</search>",
                                     obs_text=f"<information>doc {b}.{t}</information>", query=f"q{b}",
                                     retrieved_ids=[])

    episodes = [types.SimpleNamespace(steps=[step(TurnKind.SEARCH, b, t) for t in range(n)]
                                      + [step(TurnKind.ANSWER, b, n)]) for b, (_, _, n) in enumerate(_CW_BATCH)]
    batch = from_turns([[Turn([1], "search", [2])] * n + [Turn([1], "answer")] for _, _, n in _CW_BATCH],
                       group_id=[g for _, g, _ in _CW_BATCH], em=[float(r == 1.0) for r, _, _ in _CW_BATCH],
                       predictions=["B"] * len(_CW_BATCH))
    examples = [types.SimpleNamespace(question=f"question {b}", golden_answers=["B"]) for b in range(len(_CW_BATCH))]
    reward = torch.tensor([r for r, _, _ in _CW_BATCH])
    return types.SimpleNamespace(episodes=episodes, batch=batch), examples, reward


@pytest.mark.parametrize("success_by, judged", [("reward", [0]), ("advantage", [0, 3])])
def test_cwgrpo_judges_only_the_trajectories_its_estimator_weights(success_by, judged):
    # reward: only R = 1 is a success, the format-only 0.2 rewards are not; advantage: Â ≥ 0, so trajectory 3
    # (0.2 against 0.0) is one and trajectory 1 (0.2 against 1.0) is not. Asking about every r > 0 would send 6.
    import asyncio

    import torch

    from fastcredit.credit import CreditInputs, compute_advantages
    from fastcredit.judges.runner import CWGRPOJudge
    from fastcredit.judges.types import items_from_rollout

    cfg = load_config(None, ["credit.estimator=cwgrpo", f"credit.cwgrpo.success_by={success_by}"])
    backend = _CountingJudge()
    phase = build_judge_phase(cfg, backend, policy_engine=None)
    result, examples, reward = _cw_rollout()
    extras, metrics = phase.score(result, examples, reward)
    want = [(f"question {b}", t) for b in judged for t in range(_CW_BATCH[b][2])]
    assert sorted(backend.asked) == want
    assert metrics["judge/requests"] == len(want)
    # Verdicts on every trajectory change nothing the estimator computes: it reads only those it was given.
    items = items_from_rollout(result.episodes, examples, result.batch.em_B.tolist(), result.batch.predictions)
    u, v, ok, _ = asyncio.run(CWGRPOJudge(_CountingJudge()).score(items, [True] * len(items)))
    every = compute_advantages("cwgrpo", CreditInputs.from_batch(result.batch, reward, judge_u_S=u, judge_v_S=v,
                                                                 judge_ok_B=ok), cfg.credit)
    asked = compute_advantages("cwgrpo", CreditInputs.from_batch(result.batch, reward, **extras), cfg.credit)
    assert torch.equal(asked.adv_S, every.adv_S) and asked.metrics == every.metrics
    assert asked.metrics["contributive_round_frac"] == pytest.approx(len(judged) / len(want))  # round 0 of each
