"""The policy and value models over packed trajectories: their inputs, wrappers and micro-batched forwards.

Legend (shape suffixes): B trajectories, T packed model tokens (prompts and responses of a
micro-batch back to back), N packed response tokens (observations included), H hidden size.

A trajectory's model input is its prompt followed by its packed response tokens. A
micro-batch is one padding-free row ``[1, T]`` holding these sequences back to back, with
position ids restarting at 0 for each and their ``cu_seqlens``; attention is causal within
each sequence and never crosses one (``fastcredit.models.varlen``: flash-attention's varlen
path, or a registered per-sequence SDPA; no pad token and no ``[T, T]`` mask anywhere).
The models return one value per response token only (``[N]``): the log-prob and entropy of
token ``j`` read the hidden state at the position before it (``pred_N``, a flat index into
``[T]``), through the fused linear log-prob (``fastcredit.models.logprob.linear_logprob``: never the
``[N, V]`` logits on a GPU); the value of token ``j`` is the value head at the same position
(the state in which ``j`` is generated, veRL's convention). The wrappers are the FSDP2
roots, so the LM head and embeddings are gathered by the root's hooks before their use;
under DeepSpeed ZeRO-3 the LM head is registered as an external parameter of the wrapper
(``external_params``). The PPO update over these models is ``fastcredit.trainer.update``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from fastcredit.models.varlen import packed_attention_kwargs, packed_positions, use_packed_attention
from fastcredit.rollout.trajectory import TrajectoryBatch, select, selection_index
from fastcredit.models.logprob import linear_logprob


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


def model_inputs(prompts: Sequence[Sequence[int]], batch: TrajectoryBatch,
                 device: torch.device = "cpu") -> ModelInputs:
    """The packed ``[1, T]`` row of ``prompt_b + response_b`` (prompts non-empty): nothing is padded."""
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
def forward_logprobs(model, prompts, batch: TrajectoryBatch, device, max_tokens: int,
                     temperature: float = 1.0, max_over_ranks=lambda n: n) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp_N, entropy_N)`` float32 on the CPU, micro-batched (old / reference log-probs).

    ``model``: a PolicyModel, or the TrainEngine that trains one."""
    return _forward_packed(lambda x: model(x, temperature), prompts, batch, device, max_tokens, 2, max_over_ranks)


@torch.no_grad()
def forward_values(model, prompts, batch: TrajectoryBatch, device, max_tokens: int,
                   max_over_ranks=lambda n: n) -> torch.Tensor:
    """``values_N`` float32 on the CPU, micro-batched (the value model's old values).

    ``model``: a ValueModel, or the TrainEngine that trains one."""
    return _forward_packed(lambda x: (model(x),), prompts, batch, device, max_tokens, 1, max_over_ranks)[0]


def _forward_packed(fn, prompts, batch, device, max_tokens, n_out, max_over_ranks):
    lens = torch.tensor([len(p) for p in prompts]) + batch.seqlens_B.long()
    groups = micro_batches(lens, max_tokens)
    toks, results = [], []
    for idx in micro_batches(lens, max_tokens, max_over_ranks(len(groups))):
        dummy = not idx
        idx = idx or groups[0][:1]
        sub = select(batch, torch.tensor(idx))
        tok, _ = selection_index(batch, torch.tensor(idx))
        res = fn(model_inputs([prompts[i] for i in idx], sub, device))
        if not dummy:  # kept on the device: one transfer at the end, not one sync per micro-batch
            toks.append(tok)
            results.append([r.float() for r in res])
    outs = [torch.zeros(batch.num_tokens, dtype=torch.float32) for _ in range(n_out)]
    if toks:
        tok = torch.cat(toks)
        for i, o in enumerate(outs):
            o[tok] = torch.cat([r[i] for r in results]).cpu()
    return outs
