"""Policy and value models over packed trajectories, and the PPO update over mini- and micro-batches.

Legend (shape suffixes): B trajectories, L padded sequence length, N packed response
tokens (observations included), S turns, H hidden size.

A trajectory's model input is its prompt followed by its packed response tokens. The
models return one value per response token only (``[N]``): the log-prob and entropy of
token ``j`` read the hidden state at the position before it, through the fused linear
log-prob (``fastcredit.loss.linear_logprob``: never the ``[N, V]`` logits on a GPU);
the value of token ``j`` is the value head at the same position (the state in which ``j``
is generated, veRL's convention). The wrappers are the FSDP2 roots, so the LM head and
embeddings are gathered by the root's hooks before their use; under DeepSpeed ZeRO-3 the
LM head is registered as an external parameter of the wrapper (``external_params``).

The update follows ``optim.*``: ``ppo_epochs`` passes over the step's trajectories, split
into mini-batches of ``mini_batch_prompts`` groups (one optimizer step each) and into
micro-batches of at most ``micro_batch_tokens`` model tokens (a trajectory is never split:
the loss's per-turn / per-sequence means need whole trajectories). Loss denominators are
the mini-batch's global counts (summed over ranks), so the update is the same however the
mini-batch is split over ranks and micro-batches. The models train through a
``TrainEngine`` (``fastcredit.distributed.engine``: FSDP2 or DeepSpeed ZeRO): zero grads,
one ``backward`` per micro-batch, ``clip_and_step``; this file never sees the engine's kind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from fastcredit.credit.types import CreditResult
from fastcredit.loss import LossCounts, linear_logprob, loss_counts, policy_loss, value_loss
from fastcredit.rollout.trajectory import TrajectoryBatch, select, selection_index


@dataclass
class ModelInputs:
    """Padded prompt + response ids and where each packed response token's predictor sits."""

    input_ids: torch.Tensor  # int64 [B, L]
    attention_mask: torch.Tensor  # int64 [B, L]
    row_N: torch.Tensor  # int64 [N] sequence of response token n
    pos_N: torch.Tensor  # int64 [N] position whose hidden state predicts token n (its own position - 1)
    target_N: torch.Tensor  # int64 [N] the response tokens


def model_inputs(prompts: Sequence[Sequence[int]], batch: TrajectoryBatch, pad_id: int,
                 device: torch.device) -> ModelInputs:
    """Right-padded ``[B, L]`` inputs of ``prompt_b + response_b`` (prompts non-empty)."""
    B = batch.num_trajectories
    P_B = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    R_B = batch.seqlens_B.long()
    L = int((P_B + R_B).max()) if B else 0
    ids = torch.full((B, L), pad_id, dtype=torch.int64)
    mask = torch.zeros((B, L), dtype=torch.int64)
    for b, p in enumerate(prompts):  # one row copy per trajectory; the tokens themselves are tensors
        ids[b, :len(p)] = torch.as_tensor(p, dtype=torch.int64)
    row_N = torch.repeat_interleave(torch.arange(B), R_B)
    off_N = torch.arange(batch.num_tokens) - batch.cu_seqlens.long()[:-1][row_N]
    col_N = P_B[row_N] + off_N
    ids[row_N, col_N] = batch.tokens_N.long()
    mask[:, :] = (torch.arange(L)[None, :] < (P_B + R_B)[:, None]).long()
    return ModelInputs(ids.to(device), mask.to(device), row_N.to(device), (col_N - 1).to(device),
                       batch.tokens_N.long().to(device))


def _decode(lm: nn.Module, x: ModelInputs) -> torch.Tensor:
    """The decoder's last hidden states ``[B, L, H]``.

    NOTE: ``use_cache=False``: a KV cache is useless here, and under activation checkpointing
    the recomputed layers would append to it again (twice the keys; SDPA then fails on the mask).
    """
    return lm.get_decoder()(input_ids=x.input_ids, attention_mask=x.attention_mask, use_cache=False).last_hidden_state


class PolicyModel(nn.Module):
    """An HF causal LM returning per-token log-probs and entropies of the response tokens.

    ``impl``: the configured implementation of the fused log-prob (``loss.impl``)."""

    def __init__(self, lm: nn.Module, impl: str = "auto"):
        super().__init__()
        self.lm, self.impl = lm, impl

    def forward(self, x: ModelInputs, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_BLH = _decode(self.lm, x)
        hidden_NH = hidden_BLH[x.row_N, x.pos_N]
        head = self.lm.get_output_embeddings().weight
        return linear_logprob(hidden_NH, head, x.target_N, temperature, configured=self.impl)

    def external_params(self) -> list[nn.Parameter]:
        """Parameters this forward reads outside their own module's forward (the LM head)."""
        return [self.lm.get_output_embeddings().weight]


class ValueModel(nn.Module):
    """A decoder backbone with a scalar head: ``V`` of the state in which each response token is generated."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        hidden = lm.config.hidden_size
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, x: ModelInputs) -> torch.Tensor:
        hidden_BLH = _decode(self.lm, x)
        # the head's own dtype: bf16 under mixed precision, float32 otherwise (the value is float32 either way)
        hidden_NH = hidden_BLH[x.row_N, x.pos_N].to(self.value_head.weight.dtype)
        return self.value_head(hidden_NH).float().squeeze(-1)


def micro_batches(total_len_B: torch.Tensor, max_tokens: int, at_least: int = 0) -> list[list[int]]:
    """Greedy groups of consecutive trajectories with at most ``max_tokens`` tokens (one alone may exceed it).

    ``at_least``: the count every rank must reach. FSDP2 (and ZeRO-3) gathers parameters in every
    forward, so all ranks run the same number of passes; a rank with fewer micro-batches
    repeats its first one as a dummy (an empty list marks it: its outputs are discarded,
    its loss is multiplied by 0).
    """
    groups, cur, cur_tokens = [], [], 0
    for b, n in enumerate(total_len_B.tolist()):
        if cur and cur_tokens + n > max_tokens:
            groups.append(cur)
            cur, cur_tokens = [], 0
        cur.append(b)
        cur_tokens += n
    if cur:
        groups.append(cur)
    return groups + [[] for _ in range(at_least - len(groups))]


@torch.no_grad()
def forward_logprobs(model, prompts, batch: TrajectoryBatch, pad_id: int, device, max_tokens: int,
                     temperature: float = 1.0, max_over_ranks=lambda n: n) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp_N, entropy_N)`` float32 on the CPU, micro-batched (old / reference log-probs).

    ``model``: a PolicyModel, or the TrainEngine that trains one."""
    return _forward_packed(lambda x: model(x, temperature), prompts, batch, pad_id, device, max_tokens, 2,
                           max_over_ranks)


@torch.no_grad()
def forward_values(model, prompts, batch: TrajectoryBatch, pad_id: int, device,
                   max_tokens: int, max_over_ranks=lambda n: n) -> torch.Tensor:
    return _forward_packed(lambda x: (model(x),), prompts, batch, pad_id, device, max_tokens, 1, max_over_ranks)[0]


def _forward_packed(fn, prompts, batch, pad_id, device, max_tokens, n_out, max_over_ranks):
    outs = [torch.zeros(batch.num_tokens, dtype=torch.float32) for _ in range(n_out)]
    lens = torch.tensor([len(p) for p in prompts]) + batch.seqlens_B.long()
    groups = micro_batches(lens, max_tokens)
    for idx in micro_batches(lens, max_tokens, max_over_ranks(len(groups))):
        dummy = not idx
        idx = idx or groups[0][:1]
        sub = select(batch, torch.tensor(idx))
        tok, _ = selection_index(batch, torch.tensor(idx))
        res = fn(model_inputs([prompts[i] for i in idx], sub, pad_id, device))
        if not dummy:
            for o, r in zip(outs, res):
                o[tok] = r.float().cpu()
    return outs


@dataclass
class UpdateData:
    """Everything the update reads, aligned with one TrajectoryBatch (CPU tensors)."""

    prompts: list
    batch: TrajectoryBatch
    credit: CreditResult
    old_logp_N: torch.Tensor
    ref_logp_N: Optional[torch.Tensor] = None
    old_values_N: Optional[torch.Tensor] = None


def _cut(t: Optional[torch.Tensor], index: torch.Tensor, device) -> Optional[torch.Tensor]:
    return None if t is None else t[index].to(device)


def _sum_counts(counts: LossCounts, reduce) -> LossCounts:
    t = reduce(torch.tensor([counts.tokens, counts.seqs, counts.turns], dtype=torch.float64))
    return LossCounts(float(t[0]), float(t[1]), float(t[2]))


def ppo_update(policy, data: UpdateData, loss_cfg, optim_cfg, device, pad_id: int, *,
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
            m = _mini_step(policy, data, mini, loss_cfg, optim_cfg, device, pad_id, temperature, dp_size, reduce,
                           value, max_over_ranks)
            for k, v in m.items():
                totals[k] = totals.get(k, 0.0) + v
            steps += 1
    return {k: v / max(steps, 1) for k, v in totals.items()}


def _mini_step(policy, data: UpdateData, mini, loss_cfg, optim_cfg, device, pad_id, temperature, dp_size, reduce,
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
        x = model_inputs([data.prompts[int(mini[i])] for i in idx], micro, pad_id, device)
        logp, ent = policy(x, temperature)
        adv = {"adv_S": _cut(credit.adv_S, gseg, device)} if credit.adv_S is not None else \
            {"adv_N": _cut(credit.adv_N, gtok, device)}
        loss, m = policy_loss(
            logp, _cut(data.old_logp_N, gtok, device), micro.seg_id_N.to(device), micro.seg_traj_S.to(device), counts,
            loss_cfg, ref_logp_N=_cut(data.ref_logp_N, gtok, device) if loss_cfg.kl_coef else None,
            entropy_N=ent if loss_cfg.entropy_coef else None, weight_N=_cut(credit.weight_N, gtok, device),
            phi_mask_N=_cut(credit.phi_mask_N, gtok, device), loss_mask_N=_cut(credit.loss_mask_N, gtok, device),
            dp_size=dp_size, **adv)
        m = dict(m)
        m["entropy"] = _token_sum(ent.detach(), micro, credit.loss_mask_N, gtok) / max(counts.tokens, 1.0)
        if value is not None:
            v = value(x)
            vloss, vm = value_loss(v, _cut(data.old_values_N, gtok, device), _cut(credit.returns_N, gtok, device),
                                   micro.seg_id_N.to(device), micro.seg_traj_S.to(device), counts, loss_cfg,
                                   loss_mask_N=_cut(credit.loss_mask_N, gtok, device), dp_size=dp_size)
            value.backward(vloss * scale)
            m.update(vm)
        policy.backward(loss * scale)
        for k, val in m.items():
            metrics[k] = metrics.get(k, 0.0) + scale * float(val)
    summed = reduce(torch.tensor([metrics[k] for k in sorted(metrics)], dtype=torch.float64))
    out = {f"actor/{k}": float(v) for k, v in zip(sorted(metrics), summed)}
    out["actor/grad_norm"] = policy.clip_and_step(optim_cfg.grad_clip)
    if value is not None:
        out["critic/grad_norm"] = value.clip_and_step(optim_cfg.grad_clip)
    out["actor/clipfrac"] = out.get("actor/clipfrac_low", 0.0) + out.get("actor/clipfrac_high", 0.0)
    return out


def _token_sum(x_N: torch.Tensor, micro: TrajectoryBatch, loss_mask_N, gtok) -> float:
    counted = micro.seg_id_N.to(x_N.device) >= 0
    if loss_mask_N is not None:
        counted &= loss_mask_N[gtok].to(x_N.device)
    return float(x_N[counted].sum())
