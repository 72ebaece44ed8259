"""Fused linear log-prob: ``hidden @ headᵀ / T`` → log-prob of the target and entropy, never ``[N, V]``.

Legend (shape suffixes): N tokens, H hidden size, V vocabulary, K vocabulary splits of
the forward, C vocabulary chunk of the backward.

Forward: one Triton kernel tiles tokens (BLOCK_N) × vocabulary (BLOCK_V), runs the
matmul over H in BLOCK_H steps, and keeps an online max / sum-exp / sum-exp·z per row
over its slice of the vocabulary; a second kernel merges the K slices. Backward: the
vocabulary is walked in chunks of C columns; a Triton kernel recomputes the logits of a
chunk tile by tile and writes dlogits ``[N, C]``; two GEMMs then give ``dW[chunk] =
dlogitsᵀ @ hidden`` (complete: no accumulation across chunks) and ``dH += dlogits @
W[chunk]`` (fp32, chunks in a fixed order). Derivation: README.md.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .._dispatch import interpreted
from .fused_bwd import linear_logprob_bwd_fused
from .tiles import dlogits_tile, grouped_tile, logits_tile


@triton.jit
def _fwd_item(HID, W, TGT, PART, item, N, V, H, stride_hn, stride_wv, inv_temp, v_per_split, n_splits, plane,
              BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, EVEN_H: tl.constexpr,
              DOT_F32: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr, WARP_SPEC: tl.constexpr):
    """PART[:, split, rows] = (max z, Σ e^(z-max), Σ e^(z-max)(z-max), target z) over one vocabulary slice."""
    # Splits vary fastest: programs running together share hidden rows and walk their W slices in step.
    pid_n = item // n_splits
    pid_s = item % n_splits
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    tgt = tl.load(TGT + rows, mask=rows < N, other=-1).to(tl.int64)
    v_lo = pid_s.to(tl.int64) * v_per_split
    v_hi = tl.minimum(v_lo + v_per_split, V)
    m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    t = tl.zeros([BLOCK_N], dtype=tl.float32)
    zt = tl.zeros([BLOCK_N], dtype=tl.float32)
    offs_v = tl.arange(0, BLOCK_V)  # [BLOCK_V] int32
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + offs_v  # [BLOCK_V] int64, for the addresses only
        # The [BLOCK_N, BLOCK_V] epilogue compares int32 offsets within the tile: int64 column indices held
        # per element were most of this kernel's register pressure (README.md, "Launch shapes on a GPU").
        valid = (offs_v < tl.minimum(v_hi - v0, BLOCK_V).to(tl.int32))[None, :]
        tgt_v = tgt - v0  # [BLOCK_N]
        tgt_v = tl.where((tgt_v >= 0) & (tgt_v < BLOCK_V), tgt_v, -1).to(tl.int32)
        z = logits_tile(HID, W, rows, cols, N, v_hi, H, stride_hn, stride_wv, BLOCK_N, BLOCK_V, BLOCK_H,
                        EVEN_H, DOT_F32, PRECISION, TMA, WARP_SPEC) * inv_temp
        z = tl.where(valid, z, float("-inf"))  # [BLOCK_N, BLOCK_V]
        m_new = tl.maximum(m, tl.max(z, 1))
        alpha = tl.exp(m - m_new)
        shift = tl.where(s > 0, m - m_new, 0.0)  # s == 0 while m is still -inf
        d = z - m_new[:, None]  # <= 0; -inf on padding columns
        e = tl.exp(d)
        t = alpha * (t + shift * s) + tl.sum(e * tl.where(valid, d, 0.0), 1)
        s = alpha * s + tl.sum(e, 1)
        zt += tl.sum(tl.where(offs_v[None, :] == tgt_v[:, None], z, 0.0), 1)
        m = m_new
    out = PART + pid_s.to(tl.int64) * N + rows  # PART is [4, K, N]; plane = K * N
    rmask = rows < N
    tl.store(out, m, mask=rmask)
    tl.store(out + plane, s, mask=rmask)
    tl.store(out + 2 * plane, t, mask=rmask)
    tl.store(out + 3 * plane, zt, mask=rmask)


@triton.jit
def _fwd_kernel(HID, W, TGT, PART, N, V, H, stride_hn, stride_wv, inv_temp, v_per_split, n_splits, plane,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, EVEN_H: tl.constexpr,
                DOT_F32: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr = False,
                WARP_SPEC: tl.constexpr = False, PERSISTENT: tl.constexpr = False):
    """One (row block, vocabulary slice) item per program, or (PERSISTENT) items pid, pid + P, ... in order."""
    pid = tl.program_id(0)
    if PERSISTENT:
        n_items = tl.cdiv(N, BLOCK_N) * n_splits
        for item in range(pid, n_items, tl.num_programs(0)):
            _fwd_item(HID, W, TGT, PART, item, N, V, H, stride_hn, stride_wv, inv_temp, v_per_split, n_splits,
                      plane, BLOCK_N, BLOCK_V, BLOCK_H, EVEN_H, DOT_F32, PRECISION, TMA, WARP_SPEC)
    else:
        _fwd_item(HID, W, TGT, PART, pid, N, V, H, stride_hn, stride_wv, inv_temp, v_per_split, n_splits, plane,
                  BLOCK_N, BLOCK_V, BLOCK_H, EVEN_H, DOT_F32, PRECISION, TMA, WARP_SPEC)


@triton.jit
def _combine_kernel(PART, TGT, LOGP, ENT, LSE, N, V, n_splits, plane, BLOCK: tl.constexpr):
    """Merge the K slices of each row: lse = M + log S, entropy = log S - T/S, logp = z_target - lse."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    rmask = rows < N
    big_m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for k in range(0, n_splits):
        big_m = tl.maximum(big_m, tl.load(PART + k * N + rows, mask=rmask, other=0.0))
    big_s = tl.zeros([BLOCK], dtype=tl.float32)
    big_t = tl.zeros([BLOCK], dtype=tl.float32)
    zt = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, n_splits):
        p = PART + k * N + rows
        m_k = tl.load(p, mask=rmask, other=0.0)
        s_k = tl.load(p + plane, mask=rmask, other=1.0)  # rows past N: finite, never stored
        a = tl.exp(m_k - big_m)  # 0 for an empty slice (m_k = -inf)
        big_s += a * s_k
        big_t += a * (tl.load(p + 2 * plane, mask=rmask, other=0.0) + tl.where(s_k > 0, m_k - big_m, 0.0) * s_k)
        zt += tl.load(p + 3 * plane, mask=rmask, other=0.0)
    log_s = tl.log(big_s)
    lse = big_m + log_s
    tgt = tl.load(TGT + rows, mask=rmask, other=-1)
    tl.store(LOGP + rows, tl.where((tgt >= 0) & (tgt < V), zt - lse, 0.0), mask=rmask)
    tl.store(ENT + rows, log_s - big_t / big_s, mask=rmask)
    tl.store(LSE + rows, lse, mask=rmask)


@triton.jit
def _dlogits_kernel(HID, W, TGT, LSE, ENT, GLOGP, GENT, DZ, N, V, H, c0, c_hi, stride_hn, stride_wv, stride_dz,
                    inv_temp, HAS_GLOGP: tl.constexpr, HAS_GENT: tl.constexpr, GROUP_N: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, EVEN_H: tl.constexpr,
                    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr = False,
                    WARP_SPEC: tl.constexpr = False):
    """DZ[rows, cols - c0] = d(loss)/d(hidden @ Wᵀ) for vocabulary columns [c0, c_hi), logits recomputed."""
    pid_n, pid_v = grouped_tile(tl.program_id(0), N, c_hi - c0, GROUP_N, BLOCK_N, BLOCK_V)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_v = tl.arange(0, BLOCK_V)  # [BLOCK_V] int32, as in the forward's epilogue
    v0 = c0 + pid_v.to(tl.int64) * BLOCK_V
    cols = v0 + offs_v  # [BLOCK_V] int64, for the addresses only
    rmask = rows < N
    z = logits_tile(HID, W, rows, cols, N, c_hi, H, stride_hn, stride_wv, BLOCK_N, BLOCK_V, BLOCK_H, EVEN_H,
                    DOT_F32, PRECISION, TMA, WARP_SPEC) * inv_temp
    dz = dlogits_tile(z, rows, offs_v, v0, TGT, LSE, ENT, GLOGP, GENT, N, V, HAS_GLOGP, HAS_GENT, BLOCK_N, BLOCK_V)
    col_dz = pid_v * BLOCK_V + offs_v  # [BLOCK_V] int32 column in the chunk
    out = DZ + rows[:, None] * stride_dz + col_dz[None, :]
    tl.store(out, (dz * inv_temp).to(DZ.dtype.element_ty), mask=rmask[:, None] & (col_dz < c_hi - c0)[None, :])


@dataclass(frozen=True)
class LogprobConfig:
    """Tiles and launch shape. ``n_splits``: vocabulary slices of the forward; ``chunk_v``: C."""

    block_n: int = 128
    block_v: int = 128
    block_h: int = 64
    n_splits: int = 16
    chunk_v: int = 8192
    group_n: int = 8
    num_warps: int = 8
    num_stages: int = 3
    max_registers: Optional[int] = None  # ptxas's cap per thread (Triton's ``maxnreg``); None: ptxas decides
    fp32_precision: str = "ieee"  # tl.dot input_precision for fp32 inputs on a GPU: "ieee" (FMA) or "tf32x3"
    # Candidates for the Hopper anchor (README.md, "Variants"); the defaults are the kernels measured so far.
    bwd: str = "chunked"  # "chunked": dZ chunk + two cuBLAS GEMMs; "fused": one Triton kernel per tile, fp32 atomics
    skip_eps: float = 0.0  # fused only: skip a tile's dH / dW products when every |dZ| < skip_eps (0: never)
    block_ho: int = 64  # fused only: H columns of the dH / dW output tiles
    tma: bool = False  # operand tiles of the forward and dlogits kernels through TMA descriptors (sm_90+)
    warp_specialize: bool = False  # Triton's automatic warp specialisation of the H loop
    persistent: bool = False  # forward: programs_per_sm programs per SM walk the (row block, slice) items
    programs_per_sm: int = 2
    persistent_max_registers: Optional[int] = None  # the persistent forward's cap (None: ptxas decides)
    fused_max_registers: Optional[int] = None  # the fused backward's cap (None: ptxas decides)

    def __post_init__(self):
        if self.bwd not in BWD_VARIANTS:
            raise ValueError(f"unknown log-prob backward {self.bwd!r}; valid: {', '.join(BWD_VARIANTS)}")
        if self.skip_eps and self.bwd != "fused":
            raise ValueError("skip_eps needs bwd='fused' (the chunked backward's GEMMs cannot skip tiles)")


BWD_VARIANTS = ("chunked", "fused")


def gpu_config(N: int, V: int, H: int, dtype: torch.dtype, arch: int = 90) -> LogprobConfig:
    """Launch shape on an ``sm_<arch>`` GPU (default 90: H100), whether or not Triton is interpreted.

    The figures behind each choice (registers, spills, shared memory, blocks per SM, from
    ``tools/gpu/gpu_preflight_kernels.py``) are in README.md, "Launch shapes on a GPU".
    """
    if dtype != torch.float32:
        # sm_90: two blocks of 8 warps per SM (128 registers each, no spill), so one block's softmax
        # epilogue overlaps the other's wgmma main loop.
        cfg = LogprobConfig(num_stages=2, max_registers=128) if arch == 90 else LogprobConfig()
    elif arch >= 90:
        cfg = LogprobConfig(block_h=32, num_stages=2, fp32_precision="tf32x3")  # 3xTF32 on the tensor cores
    elif arch >= 80:
        cfg = LogprobConfig(block_v=64, block_h=32, fp32_precision="tf32x3")  # 3xTF32 at 128 x 128 spills here
    else:
        cfg = LogprobConfig(block_h=32, num_stages=2)
    # NOTE: dlogits chunk C × N elements; at most ~1 GiB so the backward stays far below the unfused peak.
    elt = torch.finfo(dtype).bits // 8
    chunk = max(cfg.block_v, min(cfg.chunk_v, (1 << 30) // max(N * elt, 1)) // cfg.block_v * cfg.block_v)
    return replace(cfg, chunk_v=chunk)


# Candidate variants of issue 46 (README.md, "Variants"), each a set of fields over gpu_config's choice. The
# register caps are sm_90's: at the default cap of 128 the persistent forward spills 8 B and the fused backward
# 516 B there (bench/results/gpu_preflight); "default" is the measured kernel and stays the default until a GPU
# timing says otherwise.
VARIANTS = ("default", "tma", "persistent", "tma+persistent", "warp_specialize", "fused", "fused_skip")
SKIP_EPS = 2.0 ** -20  # fused_skip's threshold on |dZ| (README.md: the error bound it gives)


def variant_config(name: str, N: int, V: int, H: int, dtype: torch.dtype, arch: Optional[int] = None) -> LogprobConfig:
    """:func:`gpu_config` (for ``arch``, default the GPU Triton compiles for) with variant ``name``'s fields; on the
    interpreter with no ``arch``, its own tiles (:func:`default_config`) with sm_90's fields.

    TMA exists from sm_90 (below, "tma" is the default kernel); ``fused_skip`` does not compile for sm_100 with
    Triton 3.7.1 (its tensor-memory layout pass fails) and raises there.
    """
    if name not in VARIANTS:
        raise ValueError(f"unknown log-prob variant {name!r}; valid: {', '.join(VARIANTS)}")
    on_interpreter = arch is None and interpreted()
    arch = 90 if on_interpreter else _target_arch() if arch is None else arch
    if name == "fused_skip" and arch >= 100:
        raise ValueError("log-prob variant fused_skip does not compile for sm_100 with Triton 3.7.1")
    cfg = default_config(N, V, H, dtype) if on_interpreter else gpu_config(N, V, H, dtype, arch)
    tma = dict(tma=arch >= 90)
    persistent = dict(persistent=True, programs_per_sm=1, **({"persistent_max_registers": 168} if arch == 90 else {}))
    fused = dict(bwd="fused", **({"block_ho": 32} if arch >= 100 else {}))
    fields = {"default": {}, "tma": tma, "persistent": persistent, "tma+persistent": dict(**tma, **persistent),
              "warp_specialize": dict(warp_specialize=True), "fused": fused,
              "fused_skip": dict(skip_eps=SKIP_EPS, **fused)}[name]
    return replace(cfg, **fields)


def _target_arch() -> int:
    """The compute capability (e.g. 90) Triton compiles for now; 0 for a GPU that is not CUDA."""
    target = triton.runtime.driver.active.get_current_target()
    return target.arch if target.backend == "cuda" and isinstance(target.arch, int) else 0


def default_config(N: int, V: int, H: int, dtype: torch.dtype) -> LogprobConfig:
    """Launch shape for these sizes: large tiles on the interpreter, where every program costs ~ms; else
    :func:`gpu_config` for the GPU Triton compiles for."""
    if interpreted():
        return LogprobConfig(block_n=min(512, triton.next_power_of_2(max(N, 16))), block_v=1024,
                             block_h=min(64, triton.next_power_of_2(max(H, 16))), n_splits=2, chunk_v=4096)
    return gpu_config(N, V, H, dtype, _target_arch())


def launch_flags(dtype: torch.dtype, cfg: LogprobConfig, kernel: str = "") -> dict:
    """tl.dot flags and launch options of the matmul kernels (``kernel``: "fwd", "dlogits" or "fused")."""
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.warp_specialize:
        opts["WARP_SPEC"] = True
    regs = cfg.max_registers
    if kernel == "fwd" and cfg.persistent:
        regs = cfg.persistent_max_registers
    elif kernel == "fused":
        regs = cfg.fused_max_registers
    if regs:
        opts["maxnreg"] = regs
    if interpreted():
        return dict(DOT_F32=True, PRECISION="ieee", **opts)
    return dict(DOT_F32=False, PRECISION=cfg.fp32_precision if dtype == torch.float32 else "tf32", **opts)


def use_tma(t: torch.Tensor, cfg: LogprobConfig) -> bool:
    """Whether ``cfg.tma`` applies to ``t`` [rows, H]: TMA needs 16-byte aligned row strides and base (H = 2,048
    or 3,584 qualify); otherwise the kernels fall back to pointer loads."""
    return cfg.tma and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0 and t.stride(1) == 1


def operands(hidden_NH, weight_VH, cfg: LogprobConfig) -> tuple:
    """(HID, W, flags): the tensors themselves, or TMA descriptors of their [BLOCK, BLOCK_H] tiles."""
    if not (use_tma(hidden_NH, cfg) and use_tma(weight_VH, cfg)):
        return hidden_NH, weight_VH, {}
    return (TensorDescriptor.from_tensor(hidden_NH, [cfg.block_n, cfg.block_h]),
            TensorDescriptor.from_tensor(weight_VH, [cfg.block_v, cfg.block_h]), {"TMA": True})


def resident_programs(device: torch.device, per_sm: int) -> int:
    """Programs of a persistent grid: ``per_sm`` per SM of a CUDA device (132, an H100's, for a compile without
    one) and 5 on the interpreter, so that a small test walks several items per program."""
    if interpreted():
        return 5
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return sms * per_sm


def linear_logprob_fwd(hidden_NH, weight_VH, target_N, temperature: float, cfg: LogprobConfig):
    """``(logp_N, entropy_N, lse_N)``, all fp32; ``hidden_NH`` and ``weight_VH`` row-major."""
    N, H = hidden_NH.shape
    V = weight_VH.shape[0]
    dev = hidden_NH.device
    logp_N = torch.empty(N, dtype=torch.float32, device=dev)
    entropy_N = torch.empty(N, dtype=torch.float32, device=dev)
    lse_N = torch.empty(N, dtype=torch.float32, device=dev)
    if N == 0:
        return logp_N, entropy_N, lse_N
    n_tiles = triton.cdiv(V, cfg.block_v)
    n_splits = max(1, min(cfg.n_splits, n_tiles))
    v_per_split = triton.cdiv(n_tiles, n_splits) * cfg.block_v
    part = torch.empty((4, n_splits, N), dtype=torch.float32, device=dev)  # [4, K, N]
    items = triton.cdiv(N, cfg.block_n) * n_splits
    grid = (min(items, resident_programs(dev, cfg.programs_per_sm)) if cfg.persistent else items,)
    hid, w, tma = operands(hidden_NH, weight_VH, cfg)
    flags = dict(PERSISTENT=True) if cfg.persistent else {}
    _fwd_kernel[grid](hid, w, target_N, part, N, V, H, hidden_NH.stride(0), weight_VH.stride(0),
                      1.0 / temperature, v_per_split, n_splits, n_splits * N, BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v,
                      BLOCK_H=cfg.block_h, EVEN_H=H % cfg.block_h == 0, **tma, **flags,
                      **launch_flags(hidden_NH.dtype, cfg, "fwd"))
    block = 1024
    _combine_kernel[(triton.cdiv(N, block),)](part, target_N, logp_N, entropy_N, lse_N, N, V, n_splits,
                                              n_splits * N, BLOCK=block, num_warps=4)
    return logp_N, entropy_N, lse_N


@functools.lru_cache(maxsize=None)
def _addmm_fp32_out_works(device: str) -> bool:
    """Whether this torch/device does bf16 × bf16 + fp32 → fp32 in one cuBLAS call (``out_dtype``)."""
    try:
        a = torch.ones((2, 2), dtype=torch.bfloat16, device=device)
        torch.addmm(torch.zeros((2, 2), device=device), a, a, out_dtype=torch.float32)
        return True
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _accumulate_mm(acc_NH: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 ``acc + a @ b`` without rounding ``a @ b`` to a's dtype first."""
    if a.dtype == torch.float32:
        return acc_NH.addmm_(a, b)
    if a.is_cuda and _addmm_fp32_out_works(str(a.device)):
        return torch.addmm(acc_NH, a, b, out_dtype=torch.float32)
    return acc_NH.addmm_(a.float(), b.float())


def linear_logprob_bwd(g_logp_N, g_ent_N, hidden_NH, weight_VH, target_N, lse_N, entropy_N, temperature: float,
                       cfg: LogprobConfig, need_dh: bool = True, need_dw: bool = True):
    """``(dhidden_NH or None, dweight_VH or None)`` for upstream grads of logp and entropy (either may be None)."""
    if cfg.bwd == "fused":
        return linear_logprob_bwd_fused(g_logp_N, g_ent_N, hidden_NH, weight_VH, target_N, lse_N, entropy_N,
                                        temperature, cfg, launch_flags(hidden_NH.dtype, cfg, "fused"), need_dh,
                                        need_dw)
    N, H = hidden_NH.shape
    V = weight_VH.shape[0]
    dh_NH = torch.zeros((N, H), dtype=torch.float32, device=hidden_NH.device) if need_dh else None
    dw_VH = torch.empty_like(weight_VH) if need_dw else None
    hid, w, tma = operands(hidden_NH, weight_VH, cfg)
    chunk = min(cfg.chunk_v, triton.cdiv(V, cfg.block_v) * cfg.block_v)
    dz_NC = torch.empty((N, chunk), dtype=hidden_NH.dtype, device=hidden_NH.device)
    for c0 in range(0, V, chunk):
        c_hi = min(c0 + chunk, V)
        grid = (triton.cdiv(N, cfg.block_n) * triton.cdiv(c_hi - c0, cfg.block_v),)
        if N:
            _dlogits_kernel[grid](
                hid, w, target_N, lse_N, entropy_N, g_logp_N, g_ent_N, dz_NC, N, V, H, c0, c_hi,
                hidden_NH.stride(0), weight_VH.stride(0), dz_NC.stride(0), 1.0 / temperature,
                HAS_GLOGP=g_logp_N is not None, HAS_GENT=g_ent_N is not None, GROUP_N=cfg.group_n,
                BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, EVEN_H=H % cfg.block_h == 0, **tma,
                **launch_flags(hidden_NH.dtype, cfg, "dlogits"))
        dz = dz_NC[:, : c_hi - c0]  # [N, C]
        if need_dw:
            torch.mm(dz.t(), hidden_NH, out=dw_VH[c0:c_hi])
        if need_dh:
            dh_NH = _accumulate_mm(dh_NH, dz, weight_VH[c0:c_hi])
    return (dh_NH.to(hidden_NH.dtype) if need_dh else None), dw_VH


class LinearLogprobFunction(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], target [N]) → (logp [N] fp32, entropy [N] fp32)."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, target_N, temperature: float, cfg: LogprobConfig):
        logp_N, entropy_N, lse_N = linear_logprob_fwd(hidden_NH, weight_VH, target_N, temperature, cfg)
        ctx.save_for_backward(hidden_NH, weight_VH, target_N, lse_N, entropy_N)
        ctx.temperature, ctx.cfg = temperature, cfg
        ctx.set_materialize_grads(False)
        return logp_N, entropy_N

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp_N, g_ent_N):
        hidden_NH, weight_VH, target_N, lse_N, entropy_N = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logp_N is None and g_ent_N is None) or not (need_dh or need_dw):
            return None, None, None, None, None
        g_logp_N = None if g_logp_N is None else g_logp_N.contiguous()
        g_ent_N = None if g_ent_N is None else g_ent_N.contiguous()
        dh, dw = linear_logprob_bwd(g_logp_N, g_ent_N, hidden_NH, weight_VH, target_N, lse_N, entropy_N,
                                    ctx.temperature, ctx.cfg, need_dh, need_dw)
        return dh, dw, None, None, None


def linear_logprob_triton(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, target_N: torch.Tensor,
                          temperature: float = 1.0, config: Optional[LogprobConfig] = None):
    """The fused kernels: ``(logp_N, entropy_N)`` in fp32, differentiable in hidden and weight."""
    if hidden_NH.dim() != 2 or weight_VH.dim() != 2 or hidden_NH.shape[1] != weight_VH.shape[1]:
        raise ValueError(f"need hidden [N, H] and weight [V, H], got {list(hidden_NH.shape)} and "
                         f"{list(weight_VH.shape)}")
    if hidden_NH.dtype != weight_VH.dtype:
        raise ValueError(f"hidden is {hidden_NH.dtype} but weight is {weight_VH.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    N, H = hidden_NH.shape
    cfg = config or default_config(N, weight_VH.shape[0], H, hidden_NH.dtype)
    return LinearLogprobFunction.apply(hidden_NH.contiguous(), weight_VH.contiguous(),
                                       target_N.reshape(-1).contiguous(), float(temperature), cfg)
