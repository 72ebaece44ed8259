"""One training step, each phase timed (``PhaseTimer``) and inside an NVTX range ``step``.

Legend (shape suffixes): B trajectories, N packed response tokens.

rollout (async agent loop; ProCeed rewinds) → outcome rewards → dynamic sampling (DAPO)
(``fastcredit.trainer.sampling``) → judges (critic / judge / PRM) → old log-probs,
reference log-probs, values (three phases) → IG-Search's answer scores when the estimator declares
them (``ig_score``, ``fastcredit.trainer.igscore``) → estimator by name (and its credit accuracy against good / wasted
search labels, ``fastcredit.trainer.credit_labels``) → PPO epochs over mini- and
micro-batches (``fastcredit.trainer.update``; the learning rate set before each optimizer
step) → weight sync into the rollout engine at the next rollout. Each rank rolls out its
own share of the prompts; the update's denominators are global. A phase takes what it
needs: the rank's parts (``fastcredit.trainer.parts``), the config, and plain values.

The step has two halves: :func:`collect` (rollouts to judges and credit labels, into a
:class:`Collected`; it takes the :class:`~fastcredit.trainer.parts.RolloutParts`) and :func:`learn` (log-probs to
the update; the :class:`~fastcredit.trainer.parts.TrainingParts`). The Trainer runs :func:`learn` on what its batch
source gives it: :func:`collect` on the same rank colocated, a rollout rank's in a split placement
(``fastcredit.trainer.placement``, ``fastcredit.trainer.split``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from fastcredit.config import TrainConfig
from fastcredit.credit.registry import estimator_needs
from fastcredit.distributed.process_group import DistInfo, all_reduce_sum, max_over_ranks, mean_over_ranks
from fastcredit.runtime.profiling import PhaseTimer
from fastcredit.trainer.credit_labels import credit_accuracy, search_label_metrics, turn_labels
from fastcredit.trainer.offpolicy import behaviour_correction
from fastcredit.trainer.parts import RolloutParts, TrainingParts
from fastcredit.trainer.sampling import sample_batch
from fastcredit.trainer.schedule import LRSchedule


@dataclass
class Collected:
    """One step's scored trajectories: everything the training side needs from the rollout side (the same
    process when colocated; a message from a rollout rank in a split placement)."""

    prompt_ids: list  # [B] list[int]
    batch: Any  # TrajectoryBatch, outcome scores written in
    reward_B: torch.Tensor
    extras: dict  # the judge phase's CreditInputs fields
    labels: Optional[tuple]  # (label_S, source) good / wasted search labels (credit_labels.turn_labels)
    metrics: dict  # the rollout's, rewards', DAPO's and judges' metrics (this rank's)
    tokens: float  # prompt + response tokens
    golds: Optional[list] = None  # [B] each trajectory's gold answers, when the estimator needs them (IG-Search)
    ig_draws: Optional[dict] = None  # IG-Search: each scored turn's observations (igscore.draw_observations)
    ig_thinks: Optional[dict] = None  # IG-Search, opening=policy: the policy's think after each (igscore.policy_thinks)


def collect(parts: RolloutParts, cfg: TrainConfig, info: DistInfo, timer: PhaseTimer, sampler, step: int,
            between_steps: Optional[Callable[[], None]] = None) -> Collected:
    """Step ``step``'s rollouts, outcome rewards, dynamic sampling and judges, and its credit labels.
    ``between_steps``: the engine calls it between two of its steps while the policy rolls out (in-flight weight
    loads; never while a critic's weights are switched in)."""
    engine, judges = parts.rollout.engine, parts.rollout.judges
    engine.between_steps = between_steps
    try:
        result, examples, reward, metrics = sample_batch(parts, cfg, info, timer, sampler, step)
    finally:
        engine.between_steps = None
    with timer.phase("judge"), parts.phases.judge():
        extras, jm = judges.score(result, examples, reward) if judges is not None else ({}, {})
    metrics.update(jm)
    labels = turn_labels(result.batch, reward, result.episodes, examples, extras)
    metrics.update(search_label_metrics(result.episodes, examples))
    tokens = float(result.batch.num_tokens + sum(len(p) for p in result.prompt_ids))
    golds = [list(ex.golden_answers) for ex in examples] if estimator_needs(cfg.credit.estimator).gold_answers \
        else None
    draws, thinks = None, None
    if estimator_needs(cfg.credit.estimator).answer_scoring:
        draws, thinks = answer_contexts(parts, cfg, info, timer, result, step)
    return Collected(result.prompt_ids, result.batch, reward, extras, labels, metrics, tokens, golds, draws, thinks)


def answer_contexts(parts: RolloutParts, cfg: TrainConfig, info: DistInfo, timer: PhaseTimer, result, step: int):
    """IG-Search's contexts, drawn where the rollout is: ``(draws, thinks)``, each scored turn's observations
    (seeded by the run's seed, the step and the rank) and, with ``credit.igsearch.opening=policy``, the think the
    policy writes after each, by the rollout engine on the weights it rolled out with (timed as ``ig_openings``)."""
    import random

    from fastcredit.trainer.igscore import draw_observations, policy_thinks

    seed = cfg.seed * 1_000_003 + step * 10_007 + info.rank * 7_000_001
    draws = draw_observations(result.batch, cfg.credit.igsearch.n_random, random.Random(seed))
    if cfg.credit.igsearch.opening != "policy":
        return draws, None
    with timer.phase("ig_openings"), parts.phases.rollout(weights=parts.weights):
        thinks = policy_thinks(parts.rollout.engine.generate, result.prompt_ids, result.batch, draws,
                               cfg.rollout.max_action_tokens)
    return draws, thinks


def learn(parts: TrainingParts, cfg: TrainConfig, info: DistInfo, timer: PhaseTimer, got: Collected, step: int,
          lr: LRSchedule, bound: int) -> dict:
    """Train step ``step`` on ``got``: log-probs (and IG-Search's answer scores), the decoupled correction of turns
    up to ``bound`` versions old (StalenessError beyond), advantages, credit accuracy, the update; the policy's
    version is then ``step + 1``. Returns the step's metrics (this rank's; the actor's and critic's already global)."""
    metrics = dict(got.metrics)
    from_rollout = old_from_rollout(cfg, info, got.batch, step)
    metrics["old_logprobs/from_rollout"] = float(from_rollout)
    old, ref, values = score_tokens(parts, cfg, info, timer, got.prompt_ids, got.batch, from_rollout)
    extras = got.extras
    if estimator_needs(cfg.credit.estimator).answer_scoring:
        scored, sm = score_answers(parts, cfg, info, timer, got, step)
        extras = {**extras, **scored}
        metrics.update(sm)
    behaviour_N, om = behaviour_correction(got.batch, old, step, bound, cfg.loss.behaviour_weight_cap,
                                           cfg.loss.behaviour_weight_mode)
    metrics.update(om)
    with timer.phase("advantage"):
        credit = advantages(cfg, info, got.batch, got.reward_B, old, ref, values, extras)
    metrics.update({f"credit/{k}": v for k, v in credit.metrics.items()})
    metrics.update(credit_accuracy(got.batch, got.reward_B, extras, credit, got.labels))
    with timer.phase("update"), parts.phases.train():
        metrics.update(update(parts, cfg, info, lr, got.prompt_ids, got.batch, credit, old, ref, values,
                              behaviour_N))
    parts.phases.mark_updated(step + 1)  # the policy's version: updates done
    return metrics


def old_from_rollout(cfg: TrainConfig, info: DistInfo, batch, version: int) -> bool:
    """Whether pi_old's log-probs are the rollout's (``loss.old_logprobs``: ``auto`` on the HF engine computing in
    float32, a CPU or ``model.dtype=float32``): asked, the engine returned them, every
    turn came from the policy at ``version`` (a lagging turn's are the behaviour policy's, not pi_old's) and none was
    refined (a demonstration's tokens were not sampled by the policy). Agreed over ranks, which then all skip the
    recompute or all run it. ``rollout`` raises where a batch does not qualify."""
    from fastcredit.rollout.build import rollout_old_logprobs

    if not rollout_old_logprobs(cfg):
        return False
    if cfg.loss.old_logprobs == "auto" and info.device.type != "cpu" and cfg.model.dtype != "float32":
        return False  # a GPU engine in half precision: its decode's rounding is not the packed forward's
    why = None
    if batch.rollout_logp_N is None:
        why = "the engine returned no log-probs for some action"
    elif batch.seg_version_S is None and cfg.rollout.max_staleness > 0:
        why = "the batch does not say which policy generated its turns"
    elif batch.seg_version_S is not None and bool((batch.seg_version_S != version).any()):
        why = f"some turns came from a policy other than version {version} (rollout.max_staleness)"
    elif bool(batch.demo_mask_N.any()):
        why = "some turns were refined by ProCeed (their tokens were not sampled by the policy)"
    ok = max_over_ranks(int(why is not None), info) == 0
    if not ok and cfg.loss.old_logprobs == "rollout":
        raise ValueError(f"loss.old_logprobs=rollout: {why or 'another rank cannot'}; use recompute or auto")
    return ok


def score_tokens(parts: TrainingParts, cfg: TrainConfig, info: DistInfo, timer: PhaseTimer, prompts, batch,
                 from_rollout: bool = False):
    """``(old_logp_N, ref_logp_N, values_N)`` of the batch's response tokens, float32 on the CPU: the policy's
    log-probs before the update (the rollout's with ``from_rollout``, :func:`old_from_rollout`; else a forward),
    the reference policy's (None without one) and the value model's (None without one), each its own timed phase."""
    from fastcredit.models.packed import forward_logprobs, forward_values

    mt, temperature = cfg.optim.micro_batch_tokens, cfg.rollout.temperature

    def most(n: int) -> int:
        return max_over_ranks(n, info)

    models, ref, values = parts.training, None, None
    with parts.phases.train():  # its moves (engines to sleep, training state back) are timed by the phases
        with timer.phase("old_logprobs"):
            if from_rollout:
                old = batch.rollout_logp_N.float().cpu()
            else:
                old = forward_logprobs(models.policy, prompts, batch, info.device, mt, temperature, most)[0]
        if models.ref is not None:
            with timer.phase("ref_logprobs"), parts.phases.using(models.ref):
                ref = forward_logprobs(models.ref, prompts, batch, info.device, mt, temperature, most)[0]
        if models.value is not None:
            with timer.phase("values"):
                values = forward_values(models.value, prompts, batch, info.device, mt, most)
    return old, ref, values


def score_answers(parts: TrainingParts, cfg: TrainConfig, info: DistInfo, timer: PhaseTimer, got: Collected,
                  step: int) -> tuple[dict, dict]:
    """IG-Search's scoring phase (``ig_score``, timed on its own, beside the old log-probs with the training state
    where it is): each search turn's information gain under the policy and its query span, as CreditInputs
    fields, and the phase's metrics (``fastcredit.trainer.igscore``). The counterfactual draws are seeded by the
    run's seed, the step and the rank."""
    from fastcredit.trainer.igscore import score_information_gain

    seed = cfg.seed * 1_000_003 + step * 10_007 + info.rank * 7_000_001
    with parts.phases.train(), timer.phase("ig_score"):
        return score_information_gain(parts.training.policy, got.prompt_ids, got.batch, got.golds,
                                      parts.shared.tokenizer, cfg.credit.igsearch, info.device,
                                      cfg.optim.micro_batch_tokens, cfg.rollout.temperature, seed,
                                      lambda n: max_over_ranks(n, info), draws=got.ig_draws, thinks=got.ig_thinks)


def advantages(cfg: TrainConfig, info: DistInfo, batch, reward_B: torch.Tensor, old_logp_N, ref_logp_N, values_N,
               extras: dict):
    """The estimator ``credit.estimator`` names over the batch: its CreditResult (advantages, returns, masks).
    ``extras``: the judges' CreditInputs fields."""
    from fastcredit.credit import CreditInputs, compute_advantages

    def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(t, info)

    inputs = CreditInputs.from_batch(batch, reward_B, values_N=values_N, old_logp_N=old_logp_N, ref_logp_N=ref_logp_N,
                                     sum_over_ranks=sum_over_ranks if info.distributed else None, **extras)
    return compute_advantages(cfg.credit.estimator, inputs, cfg.credit)


def update(parts: TrainingParts, cfg: TrainConfig, info: DistInfo, lr: LRSchedule, prompts, batch, credit, old_logp_N,
           ref_logp_N, values_N, behaviour_weight_N=None) -> dict:
    """The PPO update of the policy (and value model) on the batch (``fastcredit.trainer.update.ppo_update``);
    its metrics, summed over ranks. ``behaviour_weight_N``: the decoupled correction's weights (None: none)."""
    from fastcredit.trainer.update import UpdateData, ppo_update

    per_mini = max(cfg.optim.mini_batch_prompts // info.world_size, 1)
    data = UpdateData(prompts, batch, credit, old_logp_N, ref_logp_N, values_N, behaviour_weight_N)
    policy, value = parts.training.policy, parts.training.value
    return ppo_update(policy, data, cfg.loss, cfg.optim, info.device, temperature=cfg.rollout.temperature,
                      dp_size=info.world_size, reduce=lambda t: all_reduce_sum(t, info),
                      max_over_ranks=lambda n: max_over_ranks(n, info), value=value, groups_per_mini=per_mini,
                      on_step=lambda: lr.before_step(policy, value))


def step_metrics(parts: TrainingParts, info: DistInfo, timer: PhaseTimer, metrics: dict, tokens: float,
                 t0: float) -> dict:
    """The step's metrics as logged: rank means (the actor's and critic's are already global sums), the seconds of
    each phase and colocation move, of the step since ``t0`` (``time.perf_counter``), tokens per second over all
    ranks, and GPU memory at the phase boundaries."""
    local = {k: v for k, v in metrics.items() if not k.startswith("actor/") and not k.startswith("critic/")}
    metrics = {**metrics, **mean_over_ranks(local, info)}
    metrics.update({f"time/{k}": v for k, v in timer.reset().items()})
    metrics.update({f"time/colocate/{k}": v for k, v in parts.phases.take_timings().items()})
    metrics["time/step"] = time.perf_counter() - t0
    all_tokens = float(all_reduce_sum(torch.tensor([tokens], dtype=torch.float64), info))
    metrics["tokens/trained"] = all_tokens  # prompt + response tokens every pass and the update run over
    metrics["tokens_per_s"] = all_tokens / metrics["time/step"]
    metrics.update(parts.memory)
    parts.memory.clear()
    return metrics
