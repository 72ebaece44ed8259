"""Fused turn-level clipped surrogate: one pass forward, one pass backward over the packed stream.

Legend (shape suffixes): N packed tokens, S turns, B trajectories, P programs (blocks of
tokens), K = NUM_SLOTS partial sums per program.

The per-token advantage and aggregation scale are gathered from per-turn arrays through
``seg_id_N`` inside the kernels; no per-token advantage tensor is written. Reductions are
deterministic: every program writes its K partial sums, which are then summed in a fixed
order (no float atomics). The only atomics are integer ones in the turn-count pre-pass.
Derivation: README.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import SurrogateLaunch, default_block, gpu_block, resident_programs  # noqa: F401
from .naive import AGG_MODES

# Columns of the [P, K] partial-sum buffer.
LOSS, PG, APPROX_KL, CLIP_LOW, CLIP_HIGH, CLIP_DUAL, KL_REF, ENTROPY = range(8)
NUM_SLOTS = 8


@triton.jit
def _turn_count_kernel(SEG, LMASK, CNT, N, HAS_LMASK: tl.constexpr, BLOCK: tl.constexpr):
    """CNT[s] += counted tokens of turn s: one integer atomic per run of equal seg_id in the block."""
    idx = tl.arange(0, BLOCK)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + idx  # [BLOCK]
    inb = offs < N
    seg = tl.load(SEG + offs, mask=inb, other=-1)
    # -2 never equals a seg_id, so the block's first and last tokens always close a run.
    prev = tl.load(SEG + offs - 1, mask=inb & (idx > 0), other=-2)
    nxt = tl.load(SEG + offs + 1, mask=(offs + 1 < N) & (idx < BLOCK - 1), other=-2)
    action = inb & (seg >= 0)
    counted = action
    if HAS_LMASK:
        counted = counted & (tl.load(LMASK + offs, mask=inb, other=0) != 0)
    c = counted.to(tl.int32)
    upto = tl.cumsum(c, 0)  # [BLOCK] counted tokens in the block up to and including this one
    seg_safe = tl.where(action, seg, 0)
    # A run adds (count at its end) - (count before its start): its own counted tokens.
    tl.atomic_add(CNT + seg_safe, upto, mask=action & (seg != nxt), sem="relaxed")
    tl.atomic_add(CNT + seg_safe, c - upto, mask=action & (seg != prev), sem="relaxed")


@triton.jit
def _ld(PTR, offs, inb, counted, STREAM: tl.constexpr):
    """fp32 PTR[offs] on counted tokens, 0 elsewhere. STREAM: load every in-bounds token (a mask that does not
    depend on seg_id: 128-bit loads, issued before seg_id arrives) and zero the rest after (README.md)."""
    if STREAM:
        return tl.where(counted, tl.load(PTR + offs, mask=inb, other=0.0).to(tl.float32), 0.0)
    return tl.load(PTR + offs, mask=counted, other=0.0).to(tl.float32)


@triton.jit
def _load_token(LOGP, OLD, SEG, LMASK, ADV, CNT, offs, N, inv_denom,
                HAS_LMASK: tl.constexpr, ADV_PER_TOKEN: tl.constexpr, SEG_COUNT: tl.constexpr,
                STREAM: tl.constexpr):
    """Counted-token mask, logp, old logp, advantage and aggregation scale of a block, all [BLOCK]."""
    inb = offs < N
    seg = tl.load(SEG + offs, mask=inb, other=-1)
    counted = inb & (seg >= 0)
    if HAS_LMASK:
        counted = counted & (tl.load(LMASK + offs, mask=inb, other=0) != 0)
    seg_safe = tl.where(counted, seg, 0).to(tl.int64)
    logp = _ld(LOGP, offs, inb, counted, STREAM)
    old = _ld(OLD, offs, inb, counted, STREAM)
    if ADV_PER_TOKEN:
        adv = _ld(ADV, offs, inb, counted, STREAM)
    else:
        adv = tl.load(ADV + seg_safe, mask=counted, other=0.0).to(tl.float32)
    if SEG_COUNT:  # mean modes: 1 / (counted tokens of the token's turn or trajectory * global count)
        n = tl.maximum(tl.load(CNT + seg_safe, mask=counted, other=1), 1).to(tl.float32)
        coef = tl.where(counted, inv_denom / n, 0.0)
    else:
        coef = tl.where(counted, inv_denom, 0.0)
    return counted, logp, old, adv, coef


@triton.jit
def _token_weight(W, PHI, offs, N, counted, logp, HAS_W: tl.constexpr, HAS_PHI: tl.constexpr,
                  STREAM: tl.constexpr):
    """Per-token weight w (constant: no gradient), CHORD-phi p(1 - p) folded in; [BLOCK]."""
    w = tl.where(counted, 1.0, 0.0)
    if HAS_W:
        w = w * _ld(W, offs, offs < N, counted, STREAM)
    if HAS_PHI:
        p = tl.exp(logp)
        w = tl.where(_ld(PHI, offs, offs < N, counted, STREAM) != 0, w * (p * (1.0 - p)), w)
    return w


@triton.jit
def _surrogate_terms(logp, old, adv, REF, offs, N, counted, clip_low, clip_high, dual_clip, kl_clamp,
                     HAS_REF: tl.constexpr, HAS_DUAL: tl.constexpr, STREAM: tl.constexpr):
    """Surrogate pg, its d/dlogp, the clip flag, the dual-clip flag (0/1), k3 KL and its d/dlogp; all [BLOCK]."""
    ratio = tl.exp(logp - old)
    unclipped = -adv * ratio
    clipped = -adv * tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high)
    is_clipped = clipped > unclipped
    pg = tl.maximum(unclipped, clipped)
    # Where the clip binds the surrogate is constant in logp; elsewhere d(-A*rho)/dlogp = -A*rho.
    dpg = tl.where(is_clipped, 0.0, unclipped)
    dual = tl.zeros_like(logp)  # 1.0 where the dual clip binds
    if HAS_DUAL:
        floor = -adv * dual_clip
        is_dual = (adv < 0) & (floor < pg)
        pg = tl.where(is_dual, floor, pg)
        dpg = tl.where(is_dual, 0.0, dpg)
        dual = is_dual.to(tl.float32)
    kl = tl.zeros_like(logp)
    dkl = tl.zeros_like(logp)
    if HAS_REF:
        d = _ld(REF, offs, offs < N, counted, STREAM) - logp
        ed = tl.exp(d)
        raw = ed - d - 1.0
        kl = tl.minimum(tl.maximum(raw, -kl_clamp), kl_clamp)
        dkl = tl.where((raw >= -kl_clamp) & (raw <= kl_clamp), 1.0 - ed, 0.0)
    return pg, dpg, is_clipped, dual, kl, dkl


@triton.jit
def _fwd_block(LOGP, OLD, SEG, LMASK, ADV, CNT, REF, ENT, W, PHI, blk, N, inv_denom,
               clip_low, clip_high, dual_clip, kl_clamp, beta, eta,
               HAS_LMASK: tl.constexpr, ADV_PER_TOKEN: tl.constexpr, SEG_COUNT: tl.constexpr,
               HAS_REF: tl.constexpr, HAS_ENT: tl.constexpr, HAS_W: tl.constexpr, HAS_PHI: tl.constexpr,
               HAS_DUAL: tl.constexpr, STREAM: tl.constexpr, BLOCK: tl.constexpr):
    """Block ``blk``'s sums of the loss, pg, approx KL, clip flags, KL and entropy (8 fp32 scalars)."""
    offs = blk * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    counted, logp, old, adv, coef = _load_token(LOGP, OLD, SEG, LMASK, ADV, CNT, offs, N, inv_denom,
                                                HAS_LMASK, ADV_PER_TOKEN, SEG_COUNT, STREAM)
    pg, dpg, is_clipped, dual, kl, dkl = _surrogate_terms(logp, old, adv, REF, offs, N, counted, clip_low,
                                                             clip_high, dual_clip, kl_clamp, HAS_REF, HAS_DUAL,
                                                             STREAM)
    ent = tl.zeros_like(logp)
    if HAS_ENT:
        ent = _ld(ENT, offs, offs < N, counted, STREAM)
    w = _token_weight(W, PHI, offs, N, counted, logp, HAS_W, HAS_PHI, STREAM)
    scale = coef * w  # [BLOCK], zero on tokens that do not count
    return (tl.sum(scale * (pg + beta * kl - eta * ent), 0), tl.sum(scale * pg, 0),
            tl.sum(tl.where(counted, old - logp, 0.0), 0), tl.sum((counted & is_clipped & (adv < 0)).to(tl.float32), 0),
            tl.sum((counted & is_clipped & (adv > 0)).to(tl.float32), 0), tl.sum(tl.where(counted, dual, 0.0), 0),
            tl.sum(tl.where(counted, kl, 0.0), 0), tl.sum(ent, 0))


@triton.jit
def _fwd_kernel(LOGP, OLD, SEG, LMASK, ADV, CNT, REF, ENT, W, PHI, PART, N, inv_denom,
                clip_low, clip_high, dual_clip, kl_clamp, beta, eta,
                HAS_LMASK: tl.constexpr, ADV_PER_TOKEN: tl.constexpr, SEG_COUNT: tl.constexpr,
                HAS_REF: tl.constexpr, HAS_ENT: tl.constexpr, HAS_W: tl.constexpr, HAS_PHI: tl.constexpr,
                HAS_DUAL: tl.constexpr, NUM_SLOTS: tl.constexpr, BLOCK: tl.constexpr, STREAM: tl.constexpr,
                PERSISTENT: tl.constexpr):
    """PART[pid, :] = the sums of this program's blocks: block pid, or (PERSISTENT) blocks pid, pid + P, ..."""
    pid = tl.program_id(0).to(tl.int64)
    loss, pg, approx_kl, clip_low_n, clip_high_n, dual_n, kl, ent = _fwd_block(
        LOGP, OLD, SEG, LMASK, ADV, CNT, REF, ENT, W, PHI, pid, N, inv_denom, clip_low, clip_high, dual_clip,
        kl_clamp, beta, eta, HAS_LMASK, ADV_PER_TOKEN, SEG_COUNT, HAS_REF, HAS_ENT, HAS_W, HAS_PHI, HAS_DUAL,
        STREAM, BLOCK)
    if PERSISTENT:
        # One program per resident slot walks blocks pid, pid + P, ... in a fixed order (the grid never exceeds
        # the blocks): a P-row partial buffer (P ~ SMs x blocks per SM) and no tail wave. Deterministic.
        for blk in range(pid + tl.num_programs(0), tl.cdiv(N, BLOCK), tl.num_programs(0)):
            b_loss, b_pg, b_akl, b_low, b_high, b_dual, b_kl, b_ent = _fwd_block(
                LOGP, OLD, SEG, LMASK, ADV, CNT, REF, ENT, W, PHI, blk, N, inv_denom, clip_low, clip_high,
                dual_clip, kl_clamp, beta, eta, HAS_LMASK, ADV_PER_TOKEN, SEG_COUNT, HAS_REF, HAS_ENT, HAS_W,
                HAS_PHI, HAS_DUAL, STREAM, BLOCK)
            loss += b_loss
            pg += b_pg
            approx_kl += b_akl
            clip_low_n += b_low
            clip_high_n += b_high
            dual_n += b_dual
            kl += b_kl
            ent += b_ent
    out = PART + pid * NUM_SLOTS
    tl.store(out + 0, loss)
    tl.store(out + 1, pg)
    tl.store(out + 2, approx_kl)
    tl.store(out + 3, clip_low_n)
    tl.store(out + 4, clip_high_n)
    tl.store(out + 5, dual_n)
    tl.store(out + 6, kl)
    tl.store(out + 7, ent)


@triton.jit
def _bwd_block(DLOSS, LOGP, OLD, SEG, LMASK, ADV, CNT, REF, W, PHI, DLOGP, DENT, blk, N, inv_denom, grad_scale,
               clip_low, clip_high, dual_clip, kl_clamp, beta, eta,
               HAS_LMASK: tl.constexpr, ADV_PER_TOKEN: tl.constexpr, SEG_COUNT: tl.constexpr,
               HAS_REF: tl.constexpr, HAS_DENT: tl.constexpr, HAS_W: tl.constexpr, HAS_PHI: tl.constexpr,
               HAS_DUAL: tl.constexpr, STREAM: tl.constexpr, BLOCK: tl.constexpr):
    """DLOGP (and DENT) of block ``blk``; clip branches are recomputed from the inputs, not stored."""
    offs = blk * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    counted, logp, old, adv, coef = _load_token(LOGP, OLD, SEG, LMASK, ADV, CNT, offs, N, inv_denom,
                                                HAS_LMASK, ADV_PER_TOKEN, SEG_COUNT, STREAM)
    pg, dpg, is_clipped, dual, kl, dkl = _surrogate_terms(logp, old, adv, REF, offs, N, counted, clip_low,
                                                             clip_high, dual_clip, kl_clamp, HAS_REF, HAS_DUAL,
                                                             STREAM)
    w = _token_weight(W, PHI, offs, N, counted, logp, HAS_W, HAS_PHI, STREAM)
    g = tl.load(DLOSS).to(tl.float32) * grad_scale
    scale = g * coef * w  # [BLOCK]
    inb = offs < N
    tl.store(DLOGP + offs, (scale * (dpg + beta * dkl)).to(DLOGP.dtype.element_ty), mask=inb)
    if HAS_DENT:
        tl.store(DENT + offs, (-eta * scale).to(DENT.dtype.element_ty), mask=inb)


@triton.jit
def _bwd_kernel(DLOSS, LOGP, OLD, SEG, LMASK, ADV, CNT, REF, W, PHI, DLOGP, DENT, N, inv_denom, grad_scale,
                clip_low, clip_high, dual_clip, kl_clamp, beta, eta,
                HAS_LMASK: tl.constexpr, ADV_PER_TOKEN: tl.constexpr, SEG_COUNT: tl.constexpr,
                HAS_REF: tl.constexpr, HAS_DENT: tl.constexpr, HAS_W: tl.constexpr, HAS_PHI: tl.constexpr,
                HAS_DUAL: tl.constexpr, BLOCK: tl.constexpr, STREAM: tl.constexpr, PERSISTENT: tl.constexpr):
    """DLOGP (and DENT) of block pid, or (PERSISTENT) of blocks pid, pid + P, ..."""
    pid = tl.program_id(0).to(tl.int64)
    if PERSISTENT:
        for blk in range(pid, tl.cdiv(N, BLOCK), tl.num_programs(0)):
            _bwd_block(DLOSS, LOGP, OLD, SEG, LMASK, ADV, CNT, REF, W, PHI, DLOGP, DENT, blk, N, inv_denom,
                       grad_scale, clip_low, clip_high, dual_clip, kl_clamp, beta, eta, HAS_LMASK, ADV_PER_TOKEN,
                       SEG_COUNT, HAS_REF, HAS_DENT, HAS_W, HAS_PHI, HAS_DUAL, STREAM, BLOCK)
    else:
        _bwd_block(DLOSS, LOGP, OLD, SEG, LMASK, ADV, CNT, REF, W, PHI, DLOGP, DENT, pid, N, inv_denom,
                   grad_scale, clip_low, clip_high, dual_clip, kl_clamp, beta, eta, HAS_LMASK, ADV_PER_TOKEN,
                   SEG_COUNT, HAS_REF, HAS_DENT, HAS_W, HAS_PHI, HAS_DUAL, STREAM, BLOCK)


@triton.jit
def _finish_kernel(PART, P, LOSS_OUT, MET_OUT, loss_scale, metric_scale, PG_SLOT: tl.constexpr,
                   NUM_SLOTS: tl.constexpr, BLOCK_P: tl.constexpr):
    """Sum the [P, K] partials in a fixed order (fp64); LOSS_OUT = scaled loss, MET_OUT[k - 1] = metric k."""
    cols = tl.arange(0, NUM_SLOTS)  # [K]
    acc = tl.zeros([BLOCK_P, NUM_SLOTS], dtype=tl.float64)
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P).to(tl.int64)  # [BLOCK_P]
        acc += tl.load(PART + rows[:, None] * NUM_SLOTS + cols[None, :], mask=(rows < P)[:, None],
                       other=0.0).to(tl.float64)
    total = tl.sum(acc, 0)  # [K]
    loss = (tl.sum(tl.where(cols == 0, total, 0.0), 0) * loss_scale).to(tl.float32)
    tl.store(LOSS_OUT, loss.to(LOSS_OUT.dtype.element_ty))
    metric = (total * tl.where(cols == PG_SLOT, 1.0, metric_scale)).to(tl.float32)
    tl.store(MET_OUT + cols - 1, metric.to(MET_OUT.dtype.element_ty), mask=cols > 0)


@dataclass(frozen=True)
class SurrogateParams:
    """Scalars and flags of one call (from LossConfig, the counts and the optional inputs)."""

    clip_low: float
    clip_high: float
    dual_clip: Optional[float]
    kl_clamp: float
    beta: float
    eta: float
    inv_denom: float  # 1 / the global count of the aggregation mode
    tokens: float  # global counted tokens: the metrics' denominator
    dp_size: float
    adv_per_token: bool  # adv is [N] per token rather than [S] per turn
    block: int
    launch: Optional[SurrogateLaunch] = None  # None: SurrogateLaunch() (the "masked" kernels, 8 warps)


def turn_counts(seg_id_N: torch.Tensor, loss_mask_N: Optional[torch.Tensor], S: int, block: int) -> torch.Tensor:
    """int32 [S]: counted tokens of every turn (integer atomics: exact and order-independent)."""
    cnt_S = torch.zeros(max(S, 1), dtype=torch.int32, device=seg_id_N.device)
    N = seg_id_N.numel()
    if N and S:
        _turn_count_kernel[(triton.cdiv(N, block),)](
            seg_id_N, loss_mask_N, cnt_S, N, HAS_LMASK=loss_mask_N is not None, BLOCK=block, num_warps=4)
    return cnt_S[:S]


def segment_counts(seg_id_N, seg_traj_S, loss_mask_N, counts, mode: str, block: int):
    """``(cnt_S int32 [S] or None, 1 / global count)``: the token scale is inv_denom / cnt_S[seg] (or inv_denom)."""
    if mode == "token-mean":
        return None, 1.0 / max(counts.tokens, 1.0)
    if mode == "seq-mean-token-sum":
        return None, 1.0 / max(counts.seqs, 1.0)
    S = seg_traj_S.numel()
    n_S = turn_counts(seg_id_N, loss_mask_N, S, block)
    if mode == "turn-mean":
        return n_S, 1.0 / max(counts.turns, 1.0)
    # NOTE: sizing the per-trajectory buffer reads seg_traj_S.max() (one device sync), as loss.py does.
    B = int(seg_traj_S.max()) + 1 if S else 0
    n_B = torch.zeros(B, dtype=torch.int32, device=n_S.device).index_add_(0, seg_traj_S, n_S)
    return n_B[seg_traj_S], 1.0 / max(counts.seqs, 1.0)


def _flags(opt: dict, p: SurrogateParams) -> dict:
    launch = p.launch or SurrogateLaunch()
    return dict(STREAM=launch.variant != "masked", PERSISTENT=launch.variant == "persistent",
                num_warps=launch.num_warps, HAS_LMASK=opt["loss_mask"] is not None, ADV_PER_TOKEN=p.adv_per_token,
                SEG_COUNT=opt["cnt_S"] is not None, HAS_REF=opt["ref"] is not None,
                HAS_W=opt["weight"] is not None, HAS_PHI=opt["phi_mask"] is not None,
                HAS_DUAL=p.dual_clip is not None)


def _scalars(p: SurrogateParams) -> tuple:
    return (p.clip_low, p.clip_high, 0.0 if p.dual_clip is None else p.dual_clip, p.kl_clamp, p.beta, p.eta)


def _programs(N: int, p: SurrogateParams, device) -> int:
    """Grid of the forward and backward kernels: a program per block, or (persistent) at most the resident ones."""
    blocks = triton.cdiv(N, p.block)
    launch = p.launch or SurrogateLaunch()
    return min(blocks, resident_programs(device, launch.programs_per_sm)) if launch.variant == "persistent" \
        else blocks


def turn_surrogate_fwd(logp_N, old_logp_N, seg_id_N, adv, opt: dict, p: SurrogateParams):
    """``(loss, metrics_M)``: the scalar loss (times dp_size) and the K - 1 metric slots, float32."""
    N = logp_N.numel()
    P = _programs(N, p, logp_N.device)
    dev = logp_N.device
    part_PK = torch.empty((max(P, 1), NUM_SLOTS), dtype=torch.float32, device=dev)
    if P:
        _fwd_kernel[(P,)](
            logp_N, old_logp_N, seg_id_N, opt["loss_mask"], adv, opt["cnt_S"], opt["ref"], opt["entropy"],
            opt["weight"], opt["phi_mask"], part_PK, N, p.inv_denom, *_scalars(p),
            HAS_ENT=opt["entropy"] is not None, NUM_SLOTS=NUM_SLOTS, BLOCK=p.block, **_flags(opt, p))
    # The scalars leave in fp32 whatever the input dtype: rounding a sum of millions of terms
    # to bf16 would add up to half a bf16 ulp to the loss and to every logged metric.
    loss = torch.empty((), dtype=torch.float32, device=dev)
    metrics_M = torch.empty(NUM_SLOTS - 1, dtype=torch.float32, device=dev)
    # One program sums the per-block partials in a fixed order: deterministic, no float atomics.
    # The new variants' finish reads all its rows in one step (persistent: a row per program).
    block_p = 256 if (p.launch or SurrogateLaunch()).variant == "masked" else min(1024, triton.next_power_of_2(P))
    _finish_kernel[(1,)](part_PK, P, loss, metrics_M, p.dp_size, 1.0 / max(p.tokens, 1.0), PG_SLOT=PG,
                         NUM_SLOTS=NUM_SLOTS, BLOCK_P=block_p, num_warps=4)
    return loss, metrics_M


def turn_surrogate_bwd(dloss, logp_N, old_logp_N, seg_id_N, adv, opt: dict, p: SurrogateParams, need_dent: bool):
    """``(dlogp_N, dentropy_N or None)`` for the upstream gradient ``dloss`` of the scalar loss."""
    N = logp_N.numel()
    dlogp_N = torch.empty_like(logp_N)
    dent_N = torch.empty_like(opt["entropy"]) if need_dent else None
    if N:
        _bwd_kernel[(_programs(N, p, logp_N.device),)](
            dloss, logp_N, old_logp_N, seg_id_N, opt["loss_mask"], adv, opt["cnt_S"], opt["ref"],
            opt["weight"], opt["phi_mask"], dlogp_N, dent_N, N, p.inv_denom, p.dp_size, *_scalars(p),
            HAS_DENT=need_dent, BLOCK=p.block, **_flags(opt, p))
    return dlogp_N, dent_N


class TurnSurrogateFunction(torch.autograd.Function):
    """Differentiable in ``logp_N`` and ``entropy_N``; returns (loss, metrics [K - 1]) in float32."""

    @staticmethod
    def forward(ctx, logp_N, entropy_N, old_logp_N, seg_id_N, adv, ref_logp_N, weight_N, phi_mask_N,
                loss_mask_N, cnt_S, p: SurrogateParams):
        opt = dict(entropy=entropy_N, ref=ref_logp_N, weight=weight_N, phi_mask=phi_mask_N,
                   loss_mask=loss_mask_N, cnt_S=cnt_S)
        loss, metrics_M = turn_surrogate_fwd(logp_N, old_logp_N, seg_id_N, adv, opt, p)
        ctx.save_for_backward(logp_N, entropy_N, old_logp_N, seg_id_N, adv, ref_logp_N, weight_N, phi_mask_N,
                              loss_mask_N, cnt_S)
        ctx.p = p
        ctx.mark_non_differentiable(metrics_M)
        return loss, metrics_M

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dloss, _dmetrics):
        logp_N, entropy_N, old_logp_N, seg_id_N, adv, ref_logp_N, weight_N, phi_mask_N, loss_mask_N, cnt_S = (
            ctx.saved_tensors)
        opt = dict(entropy=entropy_N, ref=ref_logp_N, weight=weight_N, phi_mask=phi_mask_N,
                   loss_mask=loss_mask_N, cnt_S=cnt_S)
        need_dent = entropy_N is not None and ctx.needs_input_grad[1]
        dlogp_N, dent_N = turn_surrogate_bwd(dloss.contiguous(), logp_N, old_logp_N, seg_id_N, adv, opt, ctx.p,
                                             need_dent)
        return (dlogp_N if ctx.needs_input_grad[0] else None, dent_N) + (None,) * 9


def _as_flat(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if t is None:
        return None
    t = t.reshape(-1).contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _check_inputs(cfg, adv_S, adv_N, ref_logp_N, entropy_N, tensors: dict) -> None:
    """The errors of fastcredit.trainer.loss, plus one for constants that would silently lose a gradient."""
    if cfg.agg_mode not in AGG_MODES:
        raise ValueError(f"unknown loss.agg_mode {cfg.agg_mode!r}; valid: {', '.join(AGG_MODES)}")
    if (adv_S is None) == (adv_N is None):
        raise ValueError("pass exactly one of adv_S (per turn, gathered through seg_id_N) and adv_N (per token)")
    if cfg.dual_clip is not None and cfg.dual_clip <= 1.0:
        raise ValueError(f"loss.dual_clip must be > 1, got {cfg.dual_clip}")
    if cfg.kl_coef and ref_logp_N is None:
        raise ValueError("loss.kl_coef > 0 needs ref_logp_N")
    if cfg.entropy_coef and entropy_N is None:
        raise ValueError("loss.entropy_coef > 0 needs entropy_N")
    if torch.is_grad_enabled():
        for name, t in tensors.items():
            if t is not None and t.requires_grad:
                raise ValueError(f"{name} requires grad, but the kernel treats it as a constant: detach it")


def turn_surrogate_loss(logp_N: torch.Tensor, old_logp_N: torch.Tensor, seg_id_N: torch.Tensor,
                        seg_traj_S: torch.Tensor, counts, cfg, *, adv_S: Optional[torch.Tensor] = None,
                        adv_N: Optional[torch.Tensor] = None, ref_logp_N: Optional[torch.Tensor] = None,
                        entropy_N: Optional[torch.Tensor] = None, weight_N: Optional[torch.Tensor] = None,
                        phi_mask_N: Optional[torch.Tensor] = None, loss_mask_N: Optional[torch.Tensor] = None,
                        dp_size: int = 1, block: Optional[int] = None,
                        launch: Optional[SurrogateLaunch] = None) -> tuple[torch.Tensor, dict]:
    """The fused policy loss: same inputs and outputs as ``fastcredit.trainer.loss.policy_loss_torch``.

    ``logp_N`` [N] and ``entropy_N`` [N] get gradients; ``counts`` (tokens, seqs, turns)
    are the global denominators of the step; ``block`` overrides the tokens per program and ``launch`` the
    kernel variant and warps (:class:`SurrogateLaunch`).
    """
    _check_inputs(cfg, adv_S, adv_N, ref_logp_N, entropy_N,
                  {"old_logp_N": old_logp_N, "ref_logp_N": ref_logp_N, "adv_S": adv_S, "adv_N": adv_N,
                   "weight_N": weight_N})
    N = logp_N.numel()
    block = block or default_block(N)
    seg_id_N, loss_mask_N = _as_flat(seg_id_N), _as_flat(loss_mask_N)
    cnt_S, inv_denom = segment_counts(seg_id_N, seg_traj_S, loss_mask_N, counts, cfg.agg_mode, block)
    if adv_S is not None and adv_S.numel() == 0:
        adv_S = torch.zeros(1, dtype=torch.float32, device=logp_N.device)  # never read: no token has a turn
    if cnt_S is not None and cnt_S.numel() == 0:
        cnt_S = torch.zeros(1, dtype=torch.int32, device=logp_N.device)
    p = SurrogateParams(clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
                        kl_clamp=cfg.kl_clamp, beta=float(cfg.kl_coef), eta=float(cfg.entropy_coef),
                        inv_denom=inv_denom, tokens=float(counts.tokens), dp_size=float(dp_size),
                        adv_per_token=adv_N is not None, block=block, launch=launch)
    adv = _as_flat(adv_N if adv_N is not None else adv_S)
    loss, metrics_M = TurnSurrogateFunction.apply(
        logp_N.reshape(-1).contiguous(), _as_flat(entropy_N), _as_flat(old_logp_N), seg_id_N, adv,
        _as_flat(ref_logp_N), _as_flat(weight_N), _as_flat(phi_mask_N), loss_mask_N, cnt_S, p)
    return loss, _metrics(metrics_M, cfg, ref_logp_N is not None, entropy_N is not None)


def _metrics(metrics_M: torch.Tensor, cfg, has_ref: bool, has_ent: bool) -> dict:
    """The metric dict of fastcredit.trainer.loss (0-dim views of one buffer: no extra kernels)."""
    names = (["kl_ref"] if has_ref else []) + (["entropy"] if has_ent else []) + [
        "approx_kl", "clipfrac_low", "clipfrac_high"] + (["clipfrac_dual"] if cfg.dual_clip is not None else [])
    slot = {"kl_ref": KL_REF, "entropy": ENTROPY, "approx_kl": APPROX_KL, "clipfrac_low": CLIP_LOW,
            "clipfrac_high": CLIP_HIGH, "clipfrac_dual": CLIP_DUAL}
    out = {name: metrics_M[slot[name] - 1] for name in names}
    out["pg_loss"] = metrics_M[PG - 1]
    return out
