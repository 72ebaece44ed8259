"""The turn-level clipped surrogate, written out plainly: the ground truth of the Triton kernel.

Legend (shape suffixes): N packed tokens, S turns, B trajectories.

Same inputs, outputs and semantics as ``fastcredit.trainer.loss.policy_loss_torch`` (see that
module's docstring and ``README.md`` beside this file), but written independently, with
explicit loops over turns and sequences, so that the two can check each other. It
computes in the dtype of its inputs: the tests run it in float64 as the reference and
in bfloat16 to measure how far a plain bf16 implementation drifts.
"""
from __future__ import annotations

from typing import Optional

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "turn-mean")


def _per_token_advantage(seg_id_N, adv_S, adv_N, dtype):
    if (adv_S is None) == (adv_N is None):
        raise ValueError("pass exactly one of adv_S (per turn, gathered through seg_id_N) and adv_N (per token)")
    if adv_N is not None:
        return adv_N.to(dtype)
    A_N = torch.zeros(seg_id_N.shape, dtype=dtype, device=seg_id_N.device)
    for s in range(adv_S.numel()):
        A_N[seg_id_N == s] = adv_S[s].to(dtype)
    return A_N


def _surrogate(ratio_N, A_N, cfg):
    """Per-token clipped surrogate and the clip indicators (docs/methods.md §7)."""
    unclipped = -A_N * ratio_N
    clipped = -A_N * torch.clamp(ratio_N, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg_N = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    flags = {"clipfrac_low": is_clipped & (A_N < 0), "clipfrac_high": is_clipped & (A_N > 0)}
    if cfg.dual_clip is not None:
        if cfg.dual_clip <= 1.0:
            raise ValueError(f"loss.dual_clip must be > 1, got {cfg.dual_clip}")
        floor = -A_N * cfg.dual_clip
        dual = (A_N < 0) & (floor < pg_N)
        pg_N = torch.where(dual, floor, pg_N)
        flags["clipfrac_dual"] = dual
    return pg_N, flags


def _aggregate(loss_N, counted_N, seg_id_N, seg_traj_S, counts, mode):
    """Loop form of the four aggregation modes with the global denominators in ``counts``."""
    if mode == "token-mean":
        return loss_N[counted_N].sum() / max(counts.tokens, 1.0)
    if mode == "seq-mean-token-sum":
        return loss_N[counted_N].sum() / max(counts.seqs, 1.0)
    total = loss_N[counted_N].sum() * 0.0  # keeps the graph when nothing is counted
    if mode == "turn-mean":
        for s in range(seg_traj_S.numel()):
            in_turn = counted_N & (seg_id_N == s)
            if bool(in_turn.any()):
                total = total + loss_N[in_turn].mean()
        return total / max(counts.turns, 1.0)
    for b in sorted(set(seg_traj_S.tolist())):
        turns_of_b = torch.nonzero(seg_traj_S == b).flatten()
        in_seq = counted_N & torch.isin(seg_id_N.long(), turns_of_b)
        if bool(in_seq.any()):
            total = total + loss_N[in_seq].mean()
    return total / max(counts.seqs, 1.0)


def turn_surrogate_naive(logp_N: torch.Tensor, old_logp_N: torch.Tensor, seg_id_N: torch.Tensor,
                         seg_traj_S: torch.Tensor, counts, cfg, *, adv_S: Optional[torch.Tensor] = None,
                         adv_N: Optional[torch.Tensor] = None, ref_logp_N: Optional[torch.Tensor] = None,
                         entropy_N: Optional[torch.Tensor] = None, weight_N: Optional[torch.Tensor] = None,
                         phi_mask_N: Optional[torch.Tensor] = None, loss_mask_N: Optional[torch.Tensor] = None,
                         dp_size: int = 1) -> tuple[torch.Tensor, dict]:
    """Scalar loss (times ``dp_size``) and summable metrics; ``counts`` holds the global denominators.

    ``logp_N`` [N] and ``entropy_N`` [N] carry gradients; every other input is a constant.
    """
    if cfg.agg_mode not in AGG_MODES:
        raise ValueError(f"unknown loss.agg_mode {cfg.agg_mode!r}; valid: {', '.join(AGG_MODES)}")
    dtype = logp_N.dtype
    counted_N = seg_id_N >= 0
    if loss_mask_N is not None:
        counted_N = counted_N & loss_mask_N.bool()
    A_N = _per_token_advantage(seg_id_N, adv_S, adv_N, dtype)
    ratio_N = torch.exp(logp_N - old_logp_N)
    pg_N, flags = _surrogate(ratio_N, A_N, cfg)
    loss_N = pg_N
    per_token_metrics = {}
    if cfg.kl_coef or ref_logp_N is not None:
        if ref_logp_N is None:
            raise ValueError("loss.kl_coef > 0 needs ref_logp_N")
        d_N = ref_logp_N - logp_N
        kl_N = torch.clamp(torch.exp(d_N) - d_N - 1.0, -cfg.kl_clamp, cfg.kl_clamp)
        loss_N = loss_N + cfg.kl_coef * kl_N
        per_token_metrics["kl_ref"] = kl_N
    if cfg.entropy_coef or entropy_N is not None:
        if entropy_N is None:
            raise ValueError("loss.entropy_coef > 0 needs entropy_N")
        loss_N = loss_N - cfg.entropy_coef * entropy_N
        per_token_metrics["entropy"] = entropy_N
    w_N = torch.ones_like(logp_N) if weight_N is None else weight_N.to(dtype)
    if phi_mask_N is not None:
        p_N = torch.exp(logp_N.detach())
        w_N = torch.where(phi_mask_N.bool(), w_N * p_N * (1.0 - p_N), w_N)
    loss_N, pg_N = loss_N * w_N, pg_N * w_N
    loss = _aggregate(loss_N, counted_N, seg_id_N, seg_traj_S, counts, cfg.agg_mode)
    with torch.no_grad():
        per_token_metrics["approx_kl"] = old_logp_N - logp_N
        per_token_metrics.update({name: f.to(dtype) for name, f in flags.items()})
        metrics = {name: v.detach()[counted_N].sum() / max(counts.tokens, 1.0)
                   for name, v in per_token_metrics.items()}
        metrics["pg_loss"] = _aggregate(pg_N.detach(), counted_N, seg_id_N, seg_traj_S, counts, cfg.agg_mode)
    return loss * dp_size, metrics
