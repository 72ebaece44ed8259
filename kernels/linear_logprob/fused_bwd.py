"""The fused log-prob's one-kernel backward (``LogprobConfig(bwd="fused")``): dH and dW from each logits tile.

Legend (shape suffixes): N tokens, H hidden size, V vocabulary, C vocabulary chunk.

Each program recomputes one [BLOCK_N, BLOCK_V] logits tile, turns it into dZ, rounds dZ to the inputs'
dtype (as the chunked backward stores it), and multiplies it at once into both gradients, BLOCK_HO
columns of H at a time: ``dH[rows] += dZ·W[cols]`` and ``dW[cols] += dZᵀ·H[rows]``, added with fp32
atomics into an fp32 ``[N, H]`` accumulator and an fp32 ``[C, H]`` chunk of dW (split-K over the row
blocks for dW, over the vocabulary tiles for dH). No ``[N, C]`` dZ is written or read back. The
atomics make the fp32 sums' order, and so their last bits, vary between runs on a GPU.
With ``skip_eps > 0`` a tile whose every |dZ| is below it skips both products (README.md, "Variants").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import dlogits_tile, grouped_tile, logits_tile


@triton.jit
def _fused_bwd_kernel(HID, W, TGT, LSE, ENT, GLOGP, GENT, DH, DW, N, V, H, c0, c_hi, stride_hn, stride_wv,
                      inv_temp, skip_eps, HAS_GLOGP: tl.constexpr, HAS_GENT: tl.constexpr, NEED_DH: tl.constexpr,
                      NEED_DW: tl.constexpr, SKIP: tl.constexpr, GROUP_N: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HO: tl.constexpr, EVEN_H: tl.constexpr,
                      DOT_F32: tl.constexpr, PRECISION: tl.constexpr, WARP_SPEC: tl.constexpr = False):
    """DH[rows] += dZ·W[cols] and DW[cols - c0] += dZᵀ·HID[rows] for one tile of columns [c0, c_hi)."""
    pid_n, pid_v = grouped_tile(tl.program_id(0), N, c_hi - c0, GROUP_N, BLOCK_N, BLOCK_V)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_v = tl.arange(0, BLOCK_V)  # [BLOCK_V] int32
    v0 = c0 + pid_v.to(tl.int64) * BLOCK_V
    cols = v0 + offs_v  # [BLOCK_V] int64
    rmask = rows < N
    cmask = cols < c_hi
    z = logits_tile(HID, W, rows, cols, N, c_hi, H, stride_hn, stride_wv, BLOCK_N, BLOCK_V, BLOCK_H, EVEN_H,
                    DOT_F32, PRECISION, False, WARP_SPEC) * inv_temp
    dz = dlogits_tile(z, rows, offs_v, v0, TGT, LSE, ENT, GLOGP, GENT, N, V, HAS_GLOGP, HAS_GENT, BLOCK_N, BLOCK_V)
    dz = tl.where(rmask[:, None] & cmask[None, :], dz * inv_temp, 0.0)  # padding rows / columns contribute 0
    h_end = H
    if SKIP:
        # A zero-trip loop rather than an if around it: sm_100's tensor-memory pass fails on the if (Triton 3.7.1).
        h_end = tl.where(tl.max(tl.max(tl.abs(dz), 1), 0) >= skip_eps, H, 0)
    dz_lp = dz.to(HID.dtype.element_ty)  # [BLOCK_N, BLOCK_V], rounded as the chunked backward stores dZ
    if DOT_F32:
        dz_lp = dz_lp.to(tl.float32)  # NOTE: the interpreter's tl.dot on bf16 (see logits_tile)
    for h0 in range(0, h_end, BLOCK_HO):
        hs = h0 + tl.arange(0, BLOCK_HO)  # [BLOCK_HO]
        hmask = hs < H
        if NEED_DH:
            w_blk = tl.load(W + cols[:, None] * stride_wv + hs[None, :], mask=cmask[:, None] & hmask[None, :],
                            other=0.0)  # [BLOCK_V, BLOCK_HO]
            if DOT_F32:
                w_blk = w_blk.to(tl.float32)
            dh = tl.dot(dz_lp, w_blk, input_precision=PRECISION)  # [BLOCK_N, BLOCK_HO]
            tl.atomic_add(DH + rows[:, None] * H + hs[None, :], dh, mask=rmask[:, None] & hmask[None, :],
                          sem="relaxed")
        if NEED_DW:
            h_blk = tl.load(HID + rows[:, None] * stride_hn + hs[None, :], mask=rmask[:, None] & hmask[None, :],
                            other=0.0)  # [BLOCK_N, BLOCK_HO]
            if DOT_F32:
                h_blk = h_blk.to(tl.float32)
            dw = tl.dot(tl.trans(dz_lp), h_blk, input_precision=PRECISION)  # [BLOCK_V, BLOCK_HO]
            tl.atomic_add(DW + (cols - c0)[:, None] * H + hs[None, :], dw, mask=cmask[:, None] & hmask[None, :],
                          sem="relaxed")


def linear_logprob_bwd_fused(g_logp_N, g_ent_N, hidden_NH, weight_VH, target_N, lse_N, entropy_N,
                             temperature: float, cfg, flags: dict, need_dh: bool = True, need_dw: bool = True):
    """``(dhidden_NH or None, dweight_VH or None)``, as ``linear_logprob_bwd``, from one kernel per chunk.

    ``cfg`` is a ``LogprobConfig``; ``flags`` its tl.dot flags and launch options (``launch_flags``).
    Extra memory: the fp32 [N, H] dH accumulator (as the chunked backward) and an fp32 [C, H] dW chunk.
    """
    N, H = hidden_NH.shape
    V = weight_VH.shape[0]
    dev = hidden_NH.device
    dh_NH = torch.zeros((N, H), dtype=torch.float32, device=dev) if need_dh else None
    dw_VH = torch.empty_like(weight_VH) if need_dw else None
    chunk = min(cfg.chunk_v, triton.cdiv(V, cfg.block_v) * cfg.block_v)
    dw_CH = torch.empty((chunk, H), dtype=torch.float32, device=dev) if need_dw else None
    for c0 in range(0, V, chunk):
        c_hi = min(c0 + chunk, V)
        if need_dw:
            dw_CH.zero_()
        if N:
            grid = (triton.cdiv(N, cfg.block_n) * triton.cdiv(c_hi - c0, cfg.block_v),)
            _fused_bwd_kernel[grid](
                hidden_NH, weight_VH, target_N, lse_N, entropy_N, g_logp_N, g_ent_N, dh_NH, dw_CH, N, V, H, c0,
                c_hi, hidden_NH.stride(0), weight_VH.stride(0), 1.0 / temperature, cfg.skip_eps,
                HAS_GLOGP=g_logp_N is not None, HAS_GENT=g_ent_N is not None, NEED_DH=need_dh, NEED_DW=need_dw,
                SKIP=cfg.skip_eps > 0, GROUP_N=cfg.group_n, BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v,
                BLOCK_H=cfg.block_h, BLOCK_HO=cfg.block_ho, EVEN_H=H % cfg.block_h == 0, **flags)
        if need_dw:
            dw_VH[c0:c_hi] = dw_CH[: c_hi - c0]
    return (dh_NH.to(hidden_NH.dtype) if need_dh else None), dw_VH
