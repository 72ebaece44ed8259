"""The step's trajectories: rollouts, their outcome rewards, and DAPO's dynamic-sampling refill.

Legend (shape suffixes): B trajectories.

Each rank rolls out its own share of the step's prompts (``optim.batch_prompts`` over the
ranks, ``rollout.n_samples`` trajectories each: one group per prompt). With
``credit.dynamic_sampling`` groups whose rewards are all equal are dropped and more prompts
are drawn until enough groups are kept (``fastcredit.credit.dapo``); every rank draws the
same number of prompts each round, so the shared prompt order stays in step.
"""
from __future__ import annotations

import torch

from fastcredit.config import TrainConfig
from fastcredit.config.credit import outcome_reward
from fastcredit.data.lookup import turn_budget
from fastcredit.distributed.process_group import DistInfo, max_over_ranks
from fastcredit.rollout.proceed import proceed_flags
from fastcredit.rollout.build import agent_loop, prompt_ids
from fastcredit.trainer.parts import RolloutParts


def rollout(parts: RolloutParts, cfg: TrainConfig, idx: list[int], examples_from: list, greedy: bool = False,
            group_size: int = 1, hook=None, seed_base: int = 0, group_base: int = 0, searcher=None):
    """Roll out ``group_size`` trajectories for each of ``examples_from[idx]``; returns (result, examples).
    ``searcher``: what the searches go to (None: the rollout side's; an evaluation's closed-book control passes its
    own).

    Group ids are ``group_base + prompt index``: a refill round passes its own base, so a
    prompt drawn again in the same step forms a separate group.
    """
    examples = [examples_from[i] for i in idx for _ in range(group_size)]
    prompts = prompt_ids(cfg, parts.shared.tokenizer, examples)
    groups = [group_base + i for i in idx for _ in range(group_size)]
    flags = proceed_flags(groups, cfg.rollout.proceed.fraction) if hook is not None else [False] * len(groups)
    metas = [{"question": ex.question, "golds": ex.golden_answers, "example": ex, "proceed": f,
              "seed": None if greedy else seed_base + j, "max_turns": turn_budget(ex)}
             for j, (ex, f) in enumerate(zip(examples, flags))]
    with parts.phases.rollout(weights=parts.weights):
        loop = agent_loop(cfg, parts.rollout.engine, searcher or parts.rollout.searcher, greedy, hook)
        result = loop.run(prompts, group_id=groups, metas=metas)
    return result, examples


def outcome_rewards(cfg: TrainConfig, result, examples) -> tuple[torch.Tensor, dict]:
    """Outcome rewards (``credit.reward``) of the batch, EM / F1 / format written into it; ``(reward_B, metrics)``."""
    from fastcredit.credit.rewards import score_trajectory
    from fastcredit.rollout.trajectory import replace

    c = cfg.credit
    outs = [score_trajectory(e.action_texts, ex.golden_answers, kind=outcome_reward(cfg), lambda_f=c.lambda_f,
                             format_bonus=c.format_bonus) for e, ex in zip(result.episodes, examples)]
    result.batch = replace(result.batch, em_B=torch.tensor([o.em for o in outs], dtype=torch.float32),
                           f1_B=torch.tensor([o.f1 for o in outs], dtype=torch.float32),
                           format_ok_B=torch.tensor([o.format_ok for o in outs]),
                           predictions=[o.prediction for o in outs])
    reward = torch.tensor([o.reward for o in outs], dtype=torch.float32)
    return reward, {"reward": float(reward.mean()), "em": float(result.batch.em_B.mean()),
                    "f1": float(result.batch.f1_B.mean()),
                    "format_ok": float(result.batch.format_ok_B.float().mean())}


def sample_batch(parts: RolloutParts, cfg: TrainConfig, info: DistInfo, timer, sampler, step: int):
    """Rollouts + rewards (+ DAPO refill rounds) of training step ``step``: ``(result, examples, reward_B, metrics)``.

    ``sampler``: the PromptSampler the prompts are drawn from; ``timer``: the PhaseTimer of the
    ``rollout`` and ``reward`` phases."""
    from fastcredit.credit.dapo import dynamic_sampling_step

    per_rank = cfg.optim.batch_prompts // info.world_size
    ds, train, hook = cfg.credit.dynamic_sampling, parts.shared.data.train, parts.rollout.proceed_hook
    rounds, round_metrics, kept, seen = [], [], 0, 0
    want = per_rank
    while True:
        idx_all = sampler.take(want * info.world_size)  # the same draw on every rank
        idx = idx_all[info.rank * want:(info.rank + 1) * want]
        seed = cfg.seed * 1_000_003 + step * 10_007 + len(rounds) * 101 + info.rank * 7_000_001
        with timer.phase("rollout"):
            result, examples = rollout(parts, cfg, idx, train, group_size=cfg.rollout.n_samples, hook=hook,
                                       seed_base=seed, group_base=len(rounds) * len(train))
        with timer.phase("reward"):
            reward, m = outcome_rewards(cfg, result, examples)
        round_metrics.append({**m, **result.stats})
        decision = dynamic_sampling_step(reward, result.batch.group_id_B, ds, target_groups=per_rank,
                                         kept_before=kept, seen_before=seen, refill_round=len(rounds))
        rounds.append((result, examples, reward, decision.keep_B))
        kept, seen = kept + decision.kept_groups, seen + decision.kept_groups + decision.dropped_groups
        # Every rank refills the same number of prompts, so the shared prompt order stays in step.
        want = max_over_ranks(0 if decision.done else decision.refill_prompts, info)
        if want == 0:
            break
    metrics = {k: sum(r[k] for r in round_metrics) / len(rounds) for k in round_metrics[0]}
    if ds.enabled:
        metrics.update({f"dapo/{k}": v for k, v in decision.metrics.items()})
    if hook is not None:
        metrics.update({f"proceed/{k}": float(v) for k, v in hook.take_stats().items()})
    if len(rounds) == 1 and not ds.enabled:
        return result, examples, reward, metrics
    return (*merge_rounds(rounds, per_rank), metrics)


def merge_rounds(rounds: list, groups: int):
    """The kept trajectories of the refill rounds ``[(result, examples, reward_B, keep_B)]`` as one batch of at most
    ``groups`` groups: ``(result, examples, reward_B)``. When none is kept (nothing to learn from) it trains on
    every trajectory sampled, with all advantages 0."""
    from fastcredit.credit.dapo import take_groups
    from fastcredit.rollout.agent import RolloutResult
    from fastcredit.rollout.trajectory import concat, select

    batch = concat([r[0].batch for r in rounds])
    keep = take_groups(torch.cat([r[3] for r in rounds]), batch.group_id_B, groups)
    if not bool(keep.any()):
        keep = torch.ones_like(keep)
    index = torch.nonzero(keep).flatten()
    episodes = [e for r in rounds for e in r[0].episodes]
    examples = [ex for r in rounds for ex in r[1]]
    merged = RolloutResult(select(batch, index), [episodes[i].prompt_ids for i in index],
                           [episodes[i] for i in index], sum(r[0].seconds for r in rounds), rounds[-1][0].stats)
    return merged, [examples[i] for i in index], torch.cat([r[2] for r in rounds])[index]
