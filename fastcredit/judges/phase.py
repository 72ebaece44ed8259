"""The judge phase of a training step: critic labels, CW-GRPO verdicts or PRM outputs for the estimator.

    backend = make_backend(cfg, policy_engine, device)
    judges = build_judge_phase(cfg, backend, policy_engine)      # None when no judge runs
    extras, metrics = judges.score(result, examples, reward_B)   # extra CreditInputs fields
    hook = build_proceed_hook(cfg, backend, policy_engine, tokenizer)   # ProCeed rollouts, or None

Which judge runs is what the estimator declared when it registered
(``fastcredit.credit.estimator_needs``: ``critic``, ``round_judge`` or ``prm``); the backend
is ``judges.backend`` (``oracle`` / ``http`` / ``colocated``). Everything comes in as an
argument: the policy's rollout engine (the colocated self-critic and the ProCeed refiner),
the device, the tokenizer and the config.
"""
from __future__ import annotations

from typing import Optional

import torch

from fastcredit.config import TrainConfig
from fastcredit.credit.registry import estimator_needs


def make_backend(cfg: TrainConfig, policy_engine, device: torch.device, policy_config=None):
    """The judge backend of ``judges.backend`` (None for ``none``).

    ``colocated`` with a ``judges.model`` of the policy's architecture (``policy_config``)
    switches the critic's weights into the policy's engine for the judge phase
    (``fastcredit.judges.switch``); a critic of another architecture, or one ProCeed needs
    during the rollout itself, gets an HF engine of its own, and with ``rollout.engine=vllm``
    is refused with the command that serves it in its own process instead.
    """
    from fastcredit.judges.backends import EngineBackend, HTTPBackend

    j = cfg.judges
    if j.backend == "none":
        return None
    s = dict(constrained=j.constrained, retry_temperature=j.retry_temperature)
    if j.backend == "oracle":
        if cfg.data.source != "toy":
            raise ValueError("judges.backend=oracle answers from the toy world's gold facts: it needs data.source=toy")
        from fastcredit.judges.oracle import OracleBackend

        return OracleBackend(j.oracle_noise, cfg.seed)
    if j.backend == "http":
        return HTTPBackend(j.url, j.model or "judge", j.temperature, j.max_tokens, j.concurrency, j.timeout_s, **s)
    if not j.model:  # colocated self-critic: the policy's own engine
        return EngineBackend(policy_engine, j.temperature, j.max_tokens, **s)
    from fastcredit.judges.switch import CriticWeights, architecture_mismatch, read_config

    mismatch = architecture_mismatch(policy_config, read_config(j.model)) if policy_config is not None \
        else "the policy's configuration is unknown"
    during_rollout = cfg.rollout.proceed.enabled  # ProCeed asks its critic between the policy's own turns
    if mismatch is None and not during_rollout:
        weights = CriticWeights.load(j.model, policy_engine.weight_dtype, pin=device.type == "cuda")
        return EngineBackend(policy_engine, j.temperature, j.max_tokens, tokenizer=weights.tokenizer,
                             weights=weights, **s)
    why = "ProCeed's critic answers during the rollout" if during_rollout else \
        f"its architecture differs from the policy's ({mismatch})"
    if cfg.rollout.engine == "vllm":
        raise ValueError(
            f"judges.model={j.model}: {why}, so it cannot share the policy's vLLM engine, and a second vLLM engine "
            "with sleep mode cannot run in the trainer's process. Serve it in its own process, e.g. "
            f"`vllm serve {j.model} --host 127.0.0.1 --port 8001 --gpu-memory-utilization 0.3`, and set "
            "judges.backend=http judges.url=http://127.0.0.1:8001/v1")
    from fastcredit.rollout.engines import make_engine
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(j.model, local_files_only=True)
    lm = AutoModelForCausalLM.from_pretrained(j.model, local_files_only=True, torch_dtype=policy_engine.weight_dtype)
    return EngineBackend(make_engine("hf", lm.eval(), tok, cfg.rollout, device), j.temperature, j.max_tokens,
                         tokenizer=tok, **s)


class JudgePhase:
    """Runs the judge the estimator needs after each rollout.

    ``engine``: the judge's own colocated engine, which the phase manager wakes for this
    phase (None when the judge is the policy's engine, an HTTP server or the oracle).
    """

    def __init__(self, cfg: TrainConfig, backend, policy_engine, device: torch.device = torch.device("cpu")):
        from fastcredit.judges.runner import CriticSearchCritic, CWGRPOJudge

        kind = estimator_needs(cfg.credit.estimator).judge
        self.engine = getattr(backend, "engine", None)
        if self.engine is policy_engine:
            self.engine = None  # the policy's engine: the phase manager already keeps it awake for rollouts
        self.critic = CriticSearchCritic(backend, cfg.credit.critic.retries, cfg.credit.criticsearch.gold_answer) \
            if kind == "critic" else None
        self.judge = CWGRPOJudge(backend, cfg.credit.critic.retries) if kind == "round_judge" else None
        self.credit = cfg.credit  # who the CW-GRPO judge is asked about: the estimator's successes
        self.prm = cfg.judges.prm if kind == "prm" else None
        self.oracle_noise, self.seed = cfg.judges.oracle_noise, cfg.seed
        self._totals: dict = {}  # the runners' running totals at the last step, so each step logs its own counts
        self.prm_scorer = None  # a trained PRM folder (PRMScorer) or PiCA's reward server (PiCARewardClient)
        if self.prm is not None and self.prm != "oracle":
            self.prm_scorer = build_prm_scorer(cfg, device)
            if self.engine is None and hasattr(self.prm_scorer, "wake_up"):
                self.engine = self.prm_scorer  # the phase manager wakes its weights for the judge phase only

    def _this_step(self, prefix: str, stats: dict) -> dict:
        """``<prefix>/<key>`` metrics of one step: the runner's running counts (``runner.COUNTS``) as this step's
        increase, the rest (``failure_rate``) as they are."""
        from fastcredit.judges.runner import COUNTS

        out = {}
        for k, v in stats.items():
            if k in COUNTS:
                last, self._totals[prefix, k] = self._totals.get((prefix, k), 0), v
                v -= last
            out[f"{prefix}/{k}"] = float(v)
        return out

    def score(self, result, examples, reward: torch.Tensor) -> tuple[dict, dict]:
        """``(extras, metrics)``: the judge's CreditInputs fields and its parse / failure statistics."""
        from fastcredit.judges.runner import run_sync
        from fastcredit.judges.types import items_from_rollout

        extras, metrics = {}, {}
        if self.critic is None and self.judge is None and self.prm is None:
            return extras, metrics
        items = items_from_rollout(result.episodes, examples, result.batch.em_B.tolist(), result.batch.predictions)
        if self.critic is not None:
            label, ok, stats = run_sync(self.critic.score(items))
            extras.update(critic_label_S=label, critic_ok_B=ok)
            metrics.update(self._this_step("critic", stats))
        if self.judge is not None:
            from fastcredit.credit.cwgrpo import cwgrpo_success

            # Only the trajectories whose rounds the estimator weights, by its own test on the reward as
            # CreditInputs.from_batch reads it (float32): a format-only or partial reward is not asked about.
            reward_B = torch.as_tensor(reward, dtype=torch.float32)
            success = cwgrpo_success(reward_B, result.batch.group_id_B, self.credit).tolist()
            u, v, ok, stats = run_sync(self.judge.score(items, success))
            extras.update(judge_u_S=u, judge_v_S=v, judge_ok_B=ok)
            metrics.update(self._this_step("judge", stats))
        if self.prm == "oracle":
            from fastcredit.judges.oracle import oracle_prm
            from fastcredit.judges.prm import scores_to_inputs

            f0, f = oracle_prm(examples, result.episodes, self.oracle_noise, self.seed)
            metrics["prm/requests"] = float(len(examples))  # one scoring per trajectory, as a trained PRM's
            extras.update(zip(("prm_f0_B", "prm_f_S", "prm_hazard_S"), scores_to_inputs(split_turns(f0, f, result))))
        elif self.prm_scorer is not None:
            f0, f, h = self.prm_scorer.score(examples, result.episodes)
            extras.update(prm_f0_B=f0, prm_f_S=f, prm_hazard_S=h)
            metrics.update({f"prm/{k}": float(v) for k, v in getattr(self.prm_scorer, "take_stats", dict)().items()})
            if len(f):
                last = torch.cumsum(torch.tensor([len(e.steps) for e in result.episodes]), 0) - 1
                metrics.update({"prm/f0_mean": float(f0.mean()), "prm/f_last_mean": float(f[last].mean())})
        return extras, metrics


def split_turns(f0_B: torch.Tensor, f_S: torch.Tensor, result) -> list:
    """Per trajectory ``[f0, f(1), …, f(T)]`` from the flat ``(f0_B, f_S)`` of ``result``'s episodes."""
    out, i = [], 0
    for b, e in enumerate(result.episodes):
        n = len(e.steps)
        out.append(torch.cat([f0_B[b:b + 1], f_S[i:i + n]]))
        i += n
    return out


def build_prm_scorer(cfg: TrainConfig, device: torch.device):
    """``judges.prm``: an ``http(s)://`` URL is PiCA's reward server (``fastcredit.judges.prm_client``), anything else
    a PRM folder (``fastcredit.judges.prm``)."""
    j = cfg.judges
    if j.prm.startswith(("http://", "https://")):
        from fastcredit.judges.prm_client import PiCARewardClient

        return PiCARewardClient(j.prm, timeout_s=j.timeout_s, concurrency=j.concurrency)
    from fastcredit.judges.prm import PRMScorer

    return PRMScorer.load(j.prm, device, micro_batch_tokens=cfg.optim.micro_batch_tokens)


def build_judge_phase(cfg: TrainConfig, backend, policy_engine,
                      device: torch.device = torch.device("cpu")) -> Optional[JudgePhase]:
    """The run's judge phase, or None when there is neither a backend nor a PRM."""
    return JudgePhase(cfg, backend, policy_engine, device) if backend is not None or cfg.judges.prm else None


def build_proceed_hook(cfg: TrainConfig, backend, policy_engine, tokenizer):
    """The agent loop's ProCeed rewind-and-refine hook (``rollout.proceed.enabled``), or None.

    The process critic asks ``backend`` (the policy's own engine when there is none); the
    refiner is the policy's engine (``refiner=self``) or the judge's (``external``).
    """
    if not cfg.rollout.proceed.enabled:
        return None
    from fastcredit.judges.backends import EngineBackend
    from fastcredit.judges.prompts import refine_prompt
    from fastcredit.judges.runner import ProcessCritic
    from fastcredit.judges.types import item_from_episode
    from fastcredit.rollout.proceed import ProceedHook

    j = cfg.judges
    critic_backend = backend or EngineBackend(policy_engine, j.temperature, j.max_tokens, constrained=j.constrained,
                                              retry_temperature=j.retry_temperature)
    p = cfg.rollout.proceed
    self_refine = p.refiner == "self"
    refiner = policy_engine if self_refine else getattr(critic_backend, "engine", None)
    if refiner is None:
        raise ValueError("rollout.proceed.refiner=external needs a colocated judges.model to write refinements")
    return ProceedHook(ProcessCritic(critic_backend, cfg.credit.critic.retries), refine_prompt, refiner, tokenizer,
                       p.tau, p.max_rewinds, self_refine, describe=item_from_episode)
