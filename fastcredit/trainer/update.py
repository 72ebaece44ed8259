"""The PPO update: epochs over the step's trajectories in mini- and micro-batches.

Legend (shape suffixes): B trajectories, N packed response tokens (observations included),
S turns.

The update follows ``optim.*``: ``ppo_epochs`` passes over the step's trajectories, split
into mini-batches of ``mini_batch_prompts`` groups (one optimizer step each) and into
micro-batches of at most ``micro_batch_tokens`` model tokens (a trajectory is never split:
the loss's per-turn / per-sequence means need whole trajectories). A micro-batch is one
packed row (``fastcredit.models.packed``: the models, their inputs and forwards). Loss denominators are
the mini-batch's global counts (summed over ranks), so the update is the same however the
mini-batch is split over ranks and micro-batches. Metrics stay on the device until the
mini-batch's one all-reduce and host transfer. The models train through a
``TrainEngine`` (``fastcredit.distributed.engine``: FSDP2 or DeepSpeed ZeRO): zero grads,
one ``backward`` per micro-batch, ``clip_and_step``; this file never sees the engine's kind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from fastcredit.credit.types import CreditResult
from fastcredit.models.packed import micro_batches, model_inputs
from fastcredit.rollout.trajectory import TrajectoryBatch, select, selection_index
from fastcredit.trainer.loss import LossCounts, loss_counts, policy_loss, value_loss


@dataclass
class UpdateData:
    """Everything the update reads, aligned with one TrajectoryBatch (CPU tensors)."""

    prompts: list
    batch: TrajectoryBatch
    credit: CreditResult
    old_logp_N: torch.Tensor
    ref_logp_N: Optional[torch.Tensor] = None
    old_values_N: Optional[torch.Tensor] = None
    # The decoupled PPO correction's importance weights (fastcredit.trainer.offpolicy); None: no stale turn.
    behaviour_weight_N: Optional[torch.Tensor] = None


def token_weight(data: UpdateData) -> Optional[torch.Tensor]:
    """The loss's per-token weight: the estimator's (``credit.weight_N``) times the behaviour weight."""
    w, b = data.credit.weight_N, data.behaviour_weight_N
    if b is None:
        return w
    return b if w is None else w * b


def _cut(t: Optional[torch.Tensor], index: torch.Tensor, device) -> Optional[torch.Tensor]:
    return None if t is None else t[index].to(device)


def _sum_counts(counts: LossCounts, reduce) -> LossCounts:
    t = reduce(torch.tensor([counts.tokens, counts.seqs, counts.turns], dtype=torch.float64))
    return LossCounts(float(t[0]), float(t[1]), float(t[2]))


def ppo_update(policy, data: UpdateData, loss_cfg, optim_cfg, device, *,
               temperature: float = 1.0, dp_size: int = 1, reduce=lambda t: t, max_over_ranks=lambda n: n,
               value=None, groups_per_mini: Optional[int] = None, on_step=None) -> dict:
    """PPO epochs over mini- and micro-batches; returns summed metrics averaged over optimizer steps.

    ``policy`` and ``value`` are TrainEngines over a PolicyModel / ValueModel. ``reduce``
    sums a tensor over ranks and ``max_over_ranks`` takes an int's maximum over ranks
    (identities on one process); ``dp_size`` scales each rank's loss so that the
    ranks' averaged gradients equal the global batch's gradient. ``on_step()`` runs before
    each optimizer step (the trainer sets the learning rate there).
    """
    batch = data.batch
    B = batch.num_trajectories
    order = torch.arange(B)
    weight_N = token_weight(data)
    groups = torch.unique(batch.group_id_B, return_inverse=True)[1]
    n_groups = int(groups.max()) + 1 if B else 0
    per_mini = groups_per_mini or n_groups
    totals: dict = {}
    steps = 0
    for _ in range(optim_cfg.ppo_epochs):
        for g0 in range(0, max(n_groups, 1), max(per_mini, 1)):
            mini = order[(groups >= g0) & (groups < g0 + per_mini)]
            if mini.numel() == 0:
                continue
            if on_step is not None:
                on_step()
            m = _mini_step(policy, data, weight_N, mini, loss_cfg, optim_cfg, device, temperature, dp_size, reduce,
                           value, max_over_ranks)
            for k, v in m.items():
                totals[k] = totals.get(k, 0.0) + v
            steps += 1
    return {k: v / max(steps, 1) for k, v in totals.items()}


def _mini_step(policy, data: UpdateData, weight_N, mini, loss_cfg, optim_cfg, device, temperature, dp_size, reduce,
               value, max_over_ranks) -> dict:
    batch, credit = data.batch, data.credit
    sub = select(batch, mini)
    tok, seg = selection_index(batch, mini)
    mask = None if credit.loss_mask_N is None else credit.loss_mask_N[tok]
    counts = _sum_counts(loss_counts(sub.seg_id_N, sub.seg_traj_S, mask, sub.num_trajectories), reduce)
    lens = torch.tensor([len(data.prompts[int(i)]) for i in mini]) + sub.seqlens_B.long()
    policy.zero_grad()
    if value is not None:
        value.zero_grad()
    metrics: dict = {}
    groups = micro_batches(lens, optim_cfg.micro_batch_tokens)
    for idx in micro_batches(lens, optim_cfg.micro_batch_tokens, max_over_ranks(len(groups))):
        scale = 0.0 if not idx else 1.0  # a dummy pass keeps the ranks' collectives in step
        idx = idx or groups[0][:1]
        idx_t = torch.tensor(idx)
        micro = select(sub, idx_t)
        mtok, mseg = selection_index(sub, idx_t)
        gtok, gseg = tok[mtok], seg[mseg]  # indices into the step's batch
        x = model_inputs([data.prompts[int(mini[i])] for i in idx], micro, device)
        logp, ent = policy(x, temperature)
        adv = {"adv_S": _cut(credit.adv_S, gseg, device)} if credit.adv_S is not None else \
            {"adv_N": _cut(credit.adv_N, gtok, device)}
        loss, m = policy_loss(
            logp, _cut(data.old_logp_N, gtok, device), micro.seg_id_N.to(device), micro.seg_traj_S.to(device), counts,
            loss_cfg, ref_logp_N=_cut(data.ref_logp_N, gtok, device) if loss_cfg.kl_coef else None,
            entropy_N=ent if loss_cfg.entropy_coef else None, weight_N=_cut(weight_N, gtok, device),
            phi_mask_N=_cut(credit.phi_mask_N, gtok, device), loss_mask_N=_cut(credit.loss_mask_N, gtok, device),
            dp_size=dp_size, **adv)
        m = dict(m)
        m["entropy"] = _token_sum(ent.detach(), micro, credit.loss_mask_N, gtok).double() / max(counts.tokens, 1.0)
        if value is not None:
            v = value(x)
            vloss, vm = value_loss(v, _cut(data.old_values_N, gtok, device), _cut(credit.returns_N, gtok, device),
                                   micro.seg_id_N.to(device), micro.seg_traj_S.to(device), counts, loss_cfg,
                                   loss_mask_N=_cut(credit.loss_mask_N, gtok, device), dp_size=dp_size)
            value.backward(vloss * scale)
            m.update(vm)
        policy.backward(loss * scale)
        for k, val in m.items():  # float64 on the device, as float(val) was: no host sync per micro-batch
            metrics[k] = metrics.get(k, 0.0) + scale * torch.as_tensor(val, dtype=torch.float64, device=device).detach()
    keys = sorted(metrics)
    summed = reduce(torch.stack([metrics[k] for k in keys])) if keys else torch.zeros(0, dtype=torch.float64)
    out = {f"actor/{k}": v for k, v in zip(keys, summed.tolist())}  # the mini-batch's one host sync
    out["actor/grad_norm"] = policy.clip_and_step(optim_cfg.grad_clip)
    if value is not None:
        out["critic/grad_norm"] = value.clip_and_step(optim_cfg.grad_clip)
    out["actor/clipfrac"] = out.get("actor/clipfrac_low", 0.0) + out.get("actor/clipfrac_high", 0.0)
    return out


def _token_sum(x_N: torch.Tensor, micro: TrajectoryBatch, loss_mask_N, gtok) -> torch.Tensor:
    """``x_N`` summed over the counted tokens, a device scalar (no host sync: no boolean indexing)."""
    counted = micro.seg_id_N >= 0
    if loss_mask_N is not None:
        counted &= loss_mask_N[gtok]
    return torch.where(counted.to(x_N.device), x_N, 0.0).sum()
