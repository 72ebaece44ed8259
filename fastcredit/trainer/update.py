"""Policy and value models over packed trajectories, and the PPO update over mini- and micro-batches.

Legend (shape suffixes): B trajectories, T packed model tokens (prompts and responses of a
micro-batch back to back), N packed response tokens (observations included), S turns,
H hidden size.

A trajectory's model input is its prompt followed by its packed response tokens. A
micro-batch is one padding-free row ``[1, T]`` holding these sequences back to back, with
position ids restarting at 0 for each and their ``cu_seqlens``; attention is causal within
each sequence and never crosses one (``fastcredit.models.varlen``: flash-attention's varlen
path, or a registered per-sequence SDPA; no pad token and no ``[T, T]`` mask anywhere).
The models return one value per response token only (``[N]``): the log-prob and entropy of
token ``j`` read the hidden state at the position before it (``pred_N``, a flat index into
``[T]``), through the fused linear log-prob (``fastcredit.trainer.loss.linear_logprob``: never the
``[N, V]`` logits on a GPU); the value of token ``j`` is the value head at the same position
(the state in which ``j`` is generated, veRL's convention). The wrappers are the FSDP2
roots, so the LM head and embeddings are gathered by the root's hooks before their use;
under DeepSpeed ZeRO-3 the LM head is registered as an external parameter of the wrapper
(``external_params``).

The update follows ``optim.*``: ``ppo_epochs`` passes over the step's trajectories, split
into mini-batches of ``mini_batch_prompts`` groups (one optimizer step each) and into
micro-batches of at most ``micro_batch_tokens`` model tokens (a trajectory is never split:
the loss's per-turn / per-sequence means need whole trajectories). Loss denominators are
the mini-batch's global counts (summed over ranks), so the update is the same however the
mini-batch is split over ranks and micro-batches. Metrics stay on the device until the
mini-batch's one all-reduce and host transfer. The models train through a
``TrainEngine`` (``fastcredit.distributed.engine``: FSDP2 or DeepSpeed ZeRO): zero grads,
one ``backward`` per micro-batch, ``clip_and_step``; this file never sees the engine's kind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from fastcredit.credit.types import CreditResult
from fastcredit.trainer.loss import LossCounts, linear_logprob, loss_counts, policy_loss, value_loss
from fastcredit.models.varlen import packed_attention_kwargs, packed_positions, use_packed_attention
from fastcredit.rollout.trajectory import TrajectoryBatch, select, selection_index


@dataclass
class ModelInputs:
    """One padding-free row of ``prompt_b + response_b`` per trajectory, back to back, and where each
    packed response token's predictor sits."""

    input_ids: torch.Tensor  # int64 [1, T] on the device
    position_ids: torch.Tensor  # int64 [1, T] on the device: 0 at each sequence's first token
    cu_seqlens: torch.Tensor  # int32 [B+1] on the host: sequence b is packed tokens cu[b]:cu[b+1]
    max_seqlen: int  # the longest sequence
    pred_N: torch.Tensor  # int64 [N] on the device: index into [T] whose hidden state predicts token n
    target_N: torch.Tensor  # int64 [N] on the device: the response tokens

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def model_inputs(prompts: Sequence[Sequence[int]], batch: TrajectoryBatch, pad_id: Optional[int] = None,
                 device: torch.device = "cpu") -> ModelInputs:
    """The packed ``[1, T]`` row of ``prompt_b + response_b`` (prompts non-empty).

    ``pad_id`` is unused (nothing is padded); it stays in the signature for the callers."""
    B = batch.num_trajectories
    P_B = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    if B and int(P_B.min()) < 1:
        raise ValueError("every prompt needs a token: the first response token's predictor")
    R_B = batch.seqlens_B.long()
    L_B = P_B + R_B
    cu = torch.zeros(B + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(L_B, 0)
    pos_T = packed_positions(L_B.tolist())
    ids = torch.empty(int(cu[-1]), dtype=torch.int64)
    row_N = torch.repeat_interleave(torch.arange(B), R_B)
    off_N = torch.arange(batch.num_tokens) - batch.cu_seqlens.long()[:-1][row_N]
    col_N = cu[:-1][row_N] + P_B[row_N] + off_N  # packed index of response token n
    if B:  # prompts first, in order: the positions before each sequence's prompt length
        ids[pos_T < torch.repeat_interleave(P_B, L_B)] = torch.cat([torch.as_tensor(p, dtype=torch.int64)
                                                                   for p in prompts])
    ids[col_N] = batch.tokens_N.long()
    return ModelInputs(ids[None].to(device), pos_T[None].to(device), cu.to(torch.int32),
                       int(L_B.max()) if B else 0, (col_N - 1).to(device), batch.tokens_N.long().to(device))


def _decode(lm: nn.Module, x: ModelInputs) -> torch.Tensor:
    """The decoder's last hidden states of the packed row, ``[T, H]``.

    The embeddings are computed first: the attention backend (``fastcredit.models.varlen``)
    follows the device and dtype the decoder computes in (bf16 under FSDP2 mixed precision).
    NOTE: ``use_cache=False``: a KV cache is useless here, and under activation checkpointing
    the recomputed layers would append to it again (twice the keys; SDPA then fails on the mask).
    """
    embeds = lm.get_input_embeddings()(x.input_ids)
    impl = use_packed_attention(lm, embeds.device, embeds.dtype)
    kw = packed_attention_kwargs(impl, x.cu_seqlens, x.max_seqlen, embeds.device)
    out = lm.get_decoder()(inputs_embeds=embeds, position_ids=x.position_ids, use_cache=False, **kw)
    return out.last_hidden_state[0]


class PolicyModel(nn.Module):
    """An HF causal LM returning per-token log-probs and entropies of the response tokens.

    ``impl``: the configured implementation of the fused log-prob (``loss.impl``). The LM's
    attention is switched to a packed backend on its first forward (its own config only)."""

    def __init__(self, lm: nn.Module, impl: str = "auto"):
        super().__init__()
        self.lm, self.impl = lm, impl

    def forward(self, x: ModelInputs, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_NH = _decode(self.lm, x)[x.pred_N]
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
        # the head's own dtype: bf16 under mixed precision, float32 otherwise (the value is float32 either way)
        hidden_NH = _decode(self.lm, x)[x.pred_N].to(self.value_head.weight.dtype)
        # NOTE: not a view of the head's [N, 1] output: FSDP2 registers its pre-backward hook on the module's output,
        # and a view returned from an FSDP2 module is what it warns may lose that hook
        return self.value_head(hidden_NH).float().squeeze(-1).clone()


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
    lens = torch.tensor([len(p) for p in prompts]) + batch.seqlens_B.long()
    groups = micro_batches(lens, max_tokens)
    toks, results = [], []
    for idx in micro_batches(lens, max_tokens, max_over_ranks(len(groups))):
        dummy = not idx
        idx = idx or groups[0][:1]
        sub = select(batch, torch.tensor(idx))
        tok, _ = selection_index(batch, torch.tensor(idx))
        res = fn(model_inputs([prompts[i] for i in idx], sub, pad_id, device))
        if not dummy:  # kept on the device: one transfer at the end, not one sync per micro-batch
            toks.append(tok)
            results.append([r.float() for r in res])
    outs = [torch.zeros(batch.num_tokens, dtype=torch.float32) for _ in range(n_out)]
    if toks:
        tok = torch.cat(toks)
        for i, o in enumerate(outs):
            o[tok] = torch.cat([r[i] for r in results]).cpu()
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
