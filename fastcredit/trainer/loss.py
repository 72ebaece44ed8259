"""The policy and value losses.

``policy_loss`` (the turn-level surrogate) runs the Triton kernel of
``fastcredit.kernels.turn_surrogate`` or its torch reference here, as
``fastcredit.kernels._dispatch`` decides from ``impl=``, ``$FASTCREDIT_LOSS_IMPL`` and
``loss.impl`` (the LM head's fused log-prob dispatches the same way, in
``fastcredit.models.logprob``). The torch reference here is what the kernel must match.

Legend (shape suffixes):
    N  packed tokens of one micro-batch (observations included; they never count)
    S  turns of that micro-batch, trajectory-major
    B  trajectories

Per counted action token (docs/methods.md §7):

    ρ      = exp(logπθ − logπold)
    pg     = max(−A·ρ, −A·clip(ρ, 1 − clip_low, 1 + clip_high))
    pg     = min(pg, −A·c)                          if A < 0 and loss.dual_clip = c
    kl     = clamp(exp(ref − logπθ) − (ref − logπθ) − 1, −kl_clamp, kl_clamp)      (k3)
    ℓ      = w · (pg + β·kl − η·H)                  w: per-token weight (masks, CHORD-φ)

``A`` is either a per-turn advantage gathered through ``seg_id_N`` (``adv_S``) or a
per-token one (``adv_N``). CHORD-φ ``p(1 − p)``, ``p = exp(logπθ)`` detached, multiplies
``w`` on ``phi_mask_N`` tokens. Aggregation (``loss.agg_mode``):

    token-mean            Σ_tokens ℓ / n_tokens
    seq-mean-token-mean   Σ_seqs (Σ_{tokens of seq} ℓ / n_tokens(seq)) / n_seqs
    seq-mean-token-sum    Σ_seqs (Σ_{tokens of seq} ℓ) / n_seqs
    turn-mean             Σ_turns (Σ_{tokens of turn} ℓ / n_tokens(turn)) / n_turns

The outer denominators are **global** counts (:class:`LossCounts`, summed over every
micro-batch and rank of the optimizer step) passed in as plain numbers, so summing the
gradients of any split of a batch gives the gradient of the whole batch. The inner
ones are per sequence / per turn, so a trajectory must not be split across
micro-batches. Weights scale a token's loss but never the counts; tokens outside
``loss_mask_N`` leave both. Data-parallel training averages gradients over ranks,
so each rank's loss is multiplied by ``dp_size``. Metrics are normalised by the global
token count too: summing them over micro-batches and ranks gives the batch's values.
This file never imports ``torch.distributed``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from fastcredit.credit.segments import gather_turns
from fastcredit.kernels._dispatch import pick_kernel, resolve
from fastcredit.config.loss import LossConfig

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "turn-mean")
# The fused ops: (module, function), each with the signature of its torch reference here.
KERNEL_MODULE, KERNEL_FN = "fastcredit.kernels.turn_surrogate", "turn_surrogate_loss"


@dataclass
class LossCounts:
    """Global denominators of one optimizer step: counted tokens, and sequences / turns with any."""

    tokens: float
    seqs: float
    turns: float

    def __add__(self, other: "LossCounts") -> "LossCounts":
        return LossCounts(self.tokens + other.tokens, self.seqs + other.seqs, self.turns + other.turns)


def loss_counts(seg_id_N: torch.Tensor, seg_traj_S: torch.Tensor, loss_mask_N: Optional[torch.Tensor] = None,
                num_trajectories: Optional[int] = None) -> LossCounts:
    """Counts of one (micro-)batch; add them up over the micro-batches and ranks of a step."""
    mask_N = _counted(seg_id_N, loss_mask_N)
    seg = seg_id_N.long()[mask_N]
    S = seg_traj_S.numel()
    B = num_trajectories if num_trajectories is not None else (int(seg_traj_S.max()) + 1 if S else 0)
    turn_has = torch.zeros(S, dtype=torch.bool, device=seg.device).index_fill_(0, seg, True)
    seq_has = torch.zeros(B, dtype=torch.bool, device=seg.device).index_fill_(0, seg_traj_S[seg], True)
    return LossCounts(float(mask_N.sum()), float(seq_has.sum()), float(turn_has.sum()))


def _counted(seg_id_N: torch.Tensor, loss_mask_N: Optional[torch.Tensor]) -> torch.Tensor:
    action_N = seg_id_N >= 0
    return action_N if loss_mask_N is None else action_N & loss_mask_N.bool()


def aggregate(loss_N: torch.Tensor, mask_N: torch.Tensor, seg_id_N: torch.Tensor, seg_traj_S: torch.Tensor,
              counts: LossCounts, mode: str) -> torch.Tensor:
    """Scalar: ``loss_N`` over the ``mask_N`` tokens in aggregation ``mode`` with global ``counts``."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss.agg_mode {mode!r}; valid: {', '.join(AGG_MODES)}")
    masked_N = torch.where(mask_N, loss_N, 0.0)
    if mode == "token-mean":
        return masked_N.sum() / max(counts.tokens, 1.0)
    if mode == "seq-mean-token-sum":
        return masked_N.sum() / max(counts.seqs, 1.0)
    seg_N = seg_id_N.long().clamp(min=0)
    S = seg_traj_S.numel()
    if mode == "turn-mean":
        group_N, size, denom = seg_N, S, counts.turns
    else:
        group_N = seg_traj_S[seg_N] if S else seg_N
        size, denom = (int(seg_traj_S.max()) + 1 if S else 0), counts.seqs
    total = torch.zeros(size, dtype=loss_N.dtype, device=loss_N.device).index_add(0, group_N, masked_N)
    n = torch.zeros(size, dtype=loss_N.dtype, device=loss_N.device).index_add(0, group_N, mask_N.to(loss_N.dtype))
    return (total / n.clamp(min=1)).sum() / max(denom, 1.0)


def chord_phi(logp_N: torch.Tensor) -> torch.Tensor:
    """CHORD-φ ``p·(1 − p)`` with ``p = exp(logp)``, detached (no gradient flows through the weight)."""
    p = torch.exp(logp_N.detach())
    return p * (1.0 - p)


def token_weights(logp_N: torch.Tensor, weight_N: Optional[torch.Tensor],
                  phi_mask_N: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Per-token weight ``w``: ``weight_N`` times CHORD-φ on ``phi_mask_N`` tokens (no gradient)."""
    w = None if weight_N is None else weight_N.to(logp_N.dtype)
    if phi_mask_N is not None and bool(phi_mask_N.any()):
        phi = torch.where(phi_mask_N.bool(), chord_phi(logp_N), torch.ones_like(logp_N))
        w = phi if w is None else w * phi
    return w


def _token_advantage(seg_id_N, adv_S, adv_N, dtype) -> torch.Tensor:
    if (adv_S is None) == (adv_N is None):
        raise ValueError("pass exactly one of adv_S (per turn, gathered through seg_id_N) and adv_N (per token)")
    if adv_N is not None:
        return adv_N.to(dtype)
    return gather_turns(adv_S.to(dtype), seg_id_N)


def clipped_surrogate(ratio_N: torch.Tensor, adv_N: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, dict]:
    """Per-token PPO surrogate with ``clip_low`` / ``clip_high`` and the optional dual clip; and which clip bound."""
    pg1 = -adv_N * ratio_N
    pg2 = -adv_N * ratio_N.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    flags = {"clipfrac_low": clipped & (adv_N < 0), "clipfrac_high": clipped & (adv_N > 0)}
    if cfg.dual_clip is not None:
        if cfg.dual_clip <= 1.0:
            raise ValueError(f"loss.dual_clip must be > 1, got {cfg.dual_clip}")
        pg3 = -adv_N * cfg.dual_clip
        dual = (adv_N < 0) & (pg3 < pg)
        pg = torch.where(dual, pg3, pg)
        flags["clipfrac_dual"] = dual
    return pg, flags


def k3_kl(logp_N: torch.Tensor, ref_logp_N: torch.Tensor, clamp: float) -> torch.Tensor:
    """k3 estimator of KL(πθ ‖ πref) per token, clamped to ``[−clamp, clamp]``."""
    d = ref_logp_N - logp_N
    return (torch.exp(d) - d - 1.0).clamp(-clamp, clamp)


def policy_loss_torch(logp_N: torch.Tensor, old_logp_N: torch.Tensor, seg_id_N: torch.Tensor,
                      seg_traj_S: torch.Tensor, counts: LossCounts, cfg: LossConfig, *,
                      adv_S: Optional[torch.Tensor] = None, adv_N: Optional[torch.Tensor] = None,
                      ref_logp_N: Optional[torch.Tensor] = None, entropy_N: Optional[torch.Tensor] = None,
                      weight_N: Optional[torch.Tensor] = None, phi_mask_N: Optional[torch.Tensor] = None,
                      loss_mask_N: Optional[torch.Tensor] = None, dp_size: int = 1) -> tuple[torch.Tensor, dict]:
    """The reference policy loss (scalar, times ``dp_size``) and detached, summable metrics."""
    mask_N = _counted(seg_id_N, loss_mask_N)
    # NOTE: tokens that do not count may hold anything (an observation's log-prob, -inf
    # padding); zero them first, else 0 · inf = NaN leaks into the gradient through where().
    logp_N, old_logp_N, ref_logp_N, entropy_N = (
        None if x is None else torch.where(mask_N, x, 0.0) for x in (logp_N, old_logp_N, ref_logp_N, entropy_N))
    A_N = _token_advantage(seg_id_N, adv_S, adv_N, logp_N.dtype)
    ratio_N = torch.exp(logp_N - old_logp_N)
    pg_N, flags = clipped_surrogate(ratio_N, A_N, cfg)
    w_N = token_weights(logp_N, weight_N, phi_mask_N)
    loss_N = pg_N
    metrics = {}
    if cfg.kl_coef or ref_logp_N is not None:
        if ref_logp_N is None:
            raise ValueError("loss.kl_coef > 0 needs ref_logp_N")
        kl_N = k3_kl(logp_N, ref_logp_N, cfg.kl_clamp)
        loss_N = loss_N + cfg.kl_coef * kl_N
        metrics["kl_ref"] = kl_N
    if cfg.entropy_coef or entropy_N is not None:
        if entropy_N is None:
            raise ValueError("loss.entropy_coef > 0 needs entropy_N")
        loss_N = loss_N - cfg.entropy_coef * entropy_N
        metrics["entropy"] = entropy_N
    if w_N is not None:
        loss_N, pg_N = loss_N * w_N, pg_N * w_N
    loss = aggregate(loss_N, mask_N, seg_id_N, seg_traj_S, counts, cfg.agg_mode)
    with torch.no_grad():
        metrics["approx_kl"] = old_logp_N - logp_N  # k1 estimate of KL(πold ‖ πθ)
        metrics.update({name: f.to(logp_N.dtype) for name, f in flags.items()})
        out = {name: _token_mean(v, mask_N, counts) for name, v in metrics.items()}
        out["pg_loss"] = aggregate(pg_N.detach(), mask_N, seg_id_N, seg_traj_S, counts, cfg.agg_mode)
    return loss * dp_size, out


def _token_mean(x_N: torch.Tensor, mask_N: torch.Tensor, counts: LossCounts) -> torch.Tensor:
    return torch.where(mask_N, x_N.detach(), 0.0).sum() / max(counts.tokens, 1.0)


def policy_loss(logp_N: torch.Tensor, old_logp_N: torch.Tensor, seg_id_N: torch.Tensor, seg_traj_S: torch.Tensor,
                counts: LossCounts, cfg: LossConfig, *, impl: Optional[str] = None,
                **kwargs) -> tuple[torch.Tensor, dict]:
    """The policy loss: the fused Triton kernel or :func:`policy_loss_torch`.

    ``impl`` (default: ``$FASTCREDIT_LOSS_IMPL`` if set, else ``cfg.impl``): ``torch`` always runs
    the reference; ``auto`` runs the kernel for CUDA tensors when it is installed; ``triton``
    insists on it. Keyword arguments are those of :func:`policy_loss_torch`.
    """
    kernel = pick_kernel(resolve(impl, cfg.impl), logp_N, KERNEL_MODULE, KERNEL_FN)
    fn = policy_loss_torch if kernel is None else kernel
    return fn(logp_N, old_logp_N, seg_id_N, seg_traj_S, counts, cfg, **kwargs)


def value_loss(values_N: torch.Tensor, old_values_N: torch.Tensor, returns_N: torch.Tensor, seg_id_N: torch.Tensor,
               seg_traj_S: torch.Tensor, counts: LossCounts, cfg: LossConfig, *,
               loss_mask_N: Optional[torch.Tensor] = None, agg_mode: str = "token-mean",
               dp_size: int = 1) -> tuple[torch.Tensor, dict]:
    """Clipped value loss (ppo, pica): ``vf_coef · agg(½·max((V − R)², (V_clip − R)²))`` times ``dp_size``.

    ``V_clip = V_old + clamp(V − V_old, −value_clip, value_clip)``.
    """
    mask_N = _counted(seg_id_N, loss_mask_N)
    values_N, old_values_N, returns_N = (torch.where(mask_N, x, 0.0) for x in (values_N, old_values_N, returns_N))
    v_clip = old_values_N + (values_N - old_values_N).clamp(-cfg.value_clip, cfg.value_clip)
    l1, l2 = (values_N - returns_N) ** 2, (v_clip - returns_N) ** 2
    loss_N = 0.5 * torch.maximum(l1, l2)
    vf = aggregate(loss_N, mask_N, seg_id_N, seg_traj_S, counts, agg_mode)
    metrics = {"vf_loss": vf.detach(), "vf_clipfrac": _token_mean((l2 > l1).to(values_N.dtype), mask_N, counts),
               "vpred_mean": _token_mean(values_N, mask_N, counts)}
    return cfg.vf_coef * vf * dp_size, metrics
