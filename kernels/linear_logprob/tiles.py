"""Tiles shared by the log-prob kernels: the logits of a tile, its logit gradient, the grouped tile order.

Legend (shape suffixes): N tokens, H hidden size, V vocabulary. Derivation: README.md.
"""
import triton
import triton.language as tl


@triton.jit
def logits_tile(HID, W, rows, cols, N, v_hi, H, stride_hn, stride_wv, BLOCK_N: tl.constexpr,
                BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, EVEN_H: tl.constexpr, DOT_F32: tl.constexpr,
                PRECISION: tl.constexpr, TMA: tl.constexpr = False, WARP_SPEC: tl.constexpr = False):
    """fp32 [BLOCK_N, BLOCK_V] = hidden[rows] @ W[cols]ᵀ (rows, cols int64; out-of-range lanes read 0).

    TMA: HID and W are tensor descriptors (blocks [BLOCK_N, BLOCK_H] and [BLOCK_V, BLOCK_H]); the copy engine
    fills out-of-range lanes with 0, so no masks. Columns past v_hi are read: callers mask them after.
    """
    rmask = rows < N
    cmask = cols < v_hi
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_H, warp_specialize=WARP_SPEC):
        if TMA:
            a = HID.load([tl.min(rows, 0).to(tl.int32), k0])  # [BLOCK_N, BLOCK_H]
            b = W.load([tl.min(cols, 0).to(tl.int32), k0])  # [BLOCK_V, BLOCK_H]
        else:
            ks = k0 + tl.arange(0, BLOCK_H)
            if EVEN_H:
                amask = rmask[:, None]
                bmask = cmask[:, None]
            else:
                amask = rmask[:, None] & (ks < H)[None, :]
                bmask = cmask[:, None] & (ks < H)[None, :]
            a = tl.load(HID + rows[:, None] * stride_hn + ks[None, :], mask=amask, other=0.0)  # [BLOCK_N, BLOCK_H]
            b = tl.load(W + cols[:, None] * stride_wv + ks[None, :], mask=bmask, other=0.0)  # [BLOCK_V, BLOCK_H]
        if DOT_F32:
            # NOTE: the interpreter multiplies bf16 bit patterns in tl.dot; fp32 products of bf16 are exact.
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    return acc


@triton.jit
def dlogits_tile(z, rows, offs_v, v0, TGT, LSE, ENT, GLOGP, GENT, N, V,
                 HAS_GLOGP: tl.constexpr, HAS_GENT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """fp32 [BLOCK_N, BLOCK_V] d(loss)/dz of the logits z (already divided by T) of columns v0 + offs_v."""
    rmask = rows < N
    lse = tl.load(LSE + rows, mask=rmask, other=0.0)
    p = tl.exp(z - lse[:, None])  # [BLOCK_N, BLOCK_V] softmax probabilities
    dz = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    if HAS_GLOGP:
        tgt = tl.load(TGT + rows, mask=rmask, other=-1).to(tl.int64)
        g = tl.load(GLOGP + rows, mask=rmask & (tgt >= 0) & (tgt < V), other=0.0).to(tl.float32)
        tgt_v = tgt - v0  # [BLOCK_N]
        tgt_v = tl.where((tgt_v >= 0) & (tgt_v < BLOCK_V), tgt_v, -1).to(tl.int32)
        dz += g[:, None] * (tl.where(offs_v[None, :] == tgt_v[:, None], 1.0, 0.0) - p)
    if HAS_GENT:
        mu = lse - tl.load(ENT + rows, mask=rmask, other=0.0)  # Σ p z = lse - entropy
        g_ent = tl.load(GENT + rows, mask=rmask, other=0.0).to(tl.float32)
        dz -= g_ent[:, None] * p * (z - mu[:, None])
    return dz


@triton.jit
def grouped_tile(pid, N, n_cols, GROUP_N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """(row block, column block) of program ``pid``: GROUP_N row blocks sweep the columns together (L2 reuse of W)."""
    n_pid_n = tl.cdiv(N, BLOCK_N)
    n_pid_v = tl.cdiv(n_cols, BLOCK_V)
    group = pid // (GROUP_N * n_pid_v)
    first_n = group * GROUP_N
    group_size = tl.minimum(n_pid_n - first_n, GROUP_N)
    pid_n = first_n + (pid % (GROUP_N * n_pid_v)) % group_size
    pid_v = (pid % (GROUP_N * n_pid_v)) // group_size
    return pid_n, pid_v
