"""The two retrieval ops, each with a torch reference and a CUDA kernel (``fastcredit._C``).

``merge_topk``            per-shard top-k lists → one global top-k (sharded indexes)
``assemble_observations`` top-k passage rows → packed ``<information>`` observations in token
                          space, from the pre-tokenized token store

Dispatch: CUDA tensors and the extension loaded → the kernel; otherwise the torch code
here, which defines the semantics (the kernels are tested against it).

Shapes: S shards, Q queries, K passages per query, N passages, T tokens in the store.
"""
from __future__ import annotations

from typing import Optional

import torch

from fastcredit._ext import cuda_ext, cuda_ext_status

_IMPLS = ("auto", "torch", "cuda")


def _use_cuda(impl: str, *tensors: torch.Tensor) -> bool:
    if impl not in _IMPLS:
        raise ValueError(f"impl {impl!r} is not one of {', '.join(_IMPLS)}")
    on_cuda = all(t.is_cuda for t in tensors)
    if impl == "torch":
        return False
    if impl == "cuda":
        if not on_cuda:
            raise ValueError("impl='cuda' needs CUDA tensors")
        if cuda_ext() is None:
            raise RuntimeError(cuda_ext_status())
        return True
    return on_cuda and cuda_ext() is not None


def merge_topk_torch(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: stable descending sort of the shard-major concatenation, first ``k``."""
    S, Q, K = scores.shape
    flat_s = scores.permute(1, 0, 2).reshape(Q, S * K)
    flat_i = ids.permute(1, 0, 2).reshape(Q, S * K)
    order = torch.sort(flat_s, dim=1, descending=True, stable=True).indices[:, :k]
    return flat_s.gather(1, order), flat_i.gather(1, order)


def merge_topk(scores: torch.Tensor, ids: torch.Tensor, k: int,
               impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-shard top-k results into a global top-k.

    scores float32 [S, Q, K], each row sorted descending (as FAISS and ``torch.topk`` return
    them); ids int64 [S, Q, K], already global. Returns ``(scores [Q, k], ids [Q, k])``.
    Ties keep the lower shard first, then the earlier position.
    NOTE: NaN scores have no defined place in the order.
    """
    if scores.dim() != 3 or scores.shape != ids.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and ids {tuple(ids.shape)} must both be [shards, queries, k]")
    if scores.dtype != torch.float32 or ids.dtype != torch.int64:
        raise ValueError(f"scores must be float32 and ids int64, got {scores.dtype} and {ids.dtype}")
    S, _, K = scores.shape
    if not 0 <= k <= S * K:
        raise ValueError(f"k={k} must lie in [0, shards * k_in = {S * K}]")
    if _use_cuda(impl, scores, ids):
        return torch.ops.fastcredit.merge_topk(scores, ids, k)
    return merge_topk_torch(scores, ids, k)


def _piece_table(offsets, rows, header_offsets, P: int, E: int, F: int, max_passage_tokens: int, budget: int):
    """Per query, the pieces [prefix, (sep, header, passage) × K, suffix] as (length, source start,
    from-token-store) tensors of shape [Q, 3K+2], lengths already clipped to the budget."""
    Q, K = rows.shape
    valid = rows >= 0
    v = valid.long().cumsum(1) - 1                                   # [Q, K] rank among valid rows
    safe = rows.clamp_min(0)
    p_start = offsets[safe]
    p_len = offsets[safe + 1] - p_start
    if max_passage_tokens >= 0:
        p_len = p_len.clamp_max(max_passage_tokens)
    vv = v.clamp_min(0)
    h_start = header_offsets[vv]
    h_len = header_offsets[vv + 1] - h_start
    zero = torch.zeros_like(p_len)
    s_len = torch.where(valid & (v > 0), torch.full_like(p_len, E), zero)
    lens = torch.stack([s_len, torch.where(valid, h_len, zero), torch.where(valid, p_len, zero)], 2).view(Q, 3 * K)
    # Small buffer layout: prefix | sep | suffix | headers.
    src = torch.stack([torch.full_like(p_len, P), P + E + F + h_start, p_start], 2).view(Q, 3 * K)
    body_start = lens.cumsum(1) - lens
    lens = ((body_start + lens).clamp_max(budget) - body_start).clamp_min(0)
    from_store = torch.zeros(Q, 3 * K + 2, dtype=torch.bool, device=rows.device)
    from_store[:, 3:3 * K + 1:3] = True
    col = torch.ones(Q, 1, dtype=torch.long, device=rows.device)
    lens = torch.cat([col * P, lens, col * F], 1)
    src = torch.cat([col * 0, src, col * (P + E)], 1)
    return lens, src, from_store


def assemble_observations_torch(tokens, offsets, rows, headers, header_offsets, prefix, sep, suffix,
                                max_passage_tokens: int = -1, max_obs_tokens: int = -1):
    """Reference for :func:`assemble_observations`, vectorised (one gather, no Python loop over queries)."""
    P, E, F = prefix.numel(), sep.numel(), suffix.numel()
    budget = (1 << 62) if max_obs_tokens < 0 else max_obs_tokens - P - F
    lens, src, from_store = _piece_table(offsets, rows, header_offsets, P, E, F, max_passage_tokens, budget)
    Q = rows.shape[0]
    cu_seqlens = torch.zeros(Q + 1, dtype=torch.int64, device=rows.device)
    cu_seqlens[1:] = lens.sum(1).cumsum(0)
    total = int(cu_seqlens[-1])
    flat_len, flat_src, flat_store = lens.reshape(-1), src.reshape(-1), from_store.reshape(-1)
    piece = torch.repeat_interleave(torch.arange(flat_len.numel(), device=rows.device), flat_len, output_size=total)
    piece_start = flat_len.cumsum(0) - flat_len
    pos = flat_src[piece] + torch.arange(total, device=rows.device) - piece_start[piece]
    store_mask = flat_store[piece]
    small = torch.cat([prefix, sep, suffix, headers]).to(torch.int32)
    out = torch.empty(total, dtype=torch.int32, device=rows.device)
    out[store_mask] = tokens[pos[store_mask]].to(torch.int32)
    out[~store_mask] = small[pos[~store_mask]]
    return out, cu_seqlens


def _as(t, dtype, device, name: str) -> torch.Tensor:
    t = torch.as_tensor(t)
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    return t.to(device)


def assemble_observations(tokens: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor, headers: torch.Tensor,
                          header_offsets: torch.Tensor, prefix: torch.Tensor, sep: torch.Tensor, suffix: torch.Tensor,
                          max_passage_tokens: Optional[int] = None, max_obs_tokens: Optional[int] = None,
                          impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Assemble one observation per query from pre-tokenized passages, packed.

    tokens int32 [T], offsets int64 [N+1]: the token store. rows int64 [Q, K]: passage rows
    by rank, ``< 0`` = none (skipped; later passages are numbered without a gap).
    headers int32 [H] with header_offsets int64 [>= K+1]: the tokens of ``Doc 1``, ``Doc 2``, ….
    prefix / sep / suffix int32: ``\\n\\n<information>``, ``\\n``, ``</information>\\n\\n``.

    Observation q = prefix + body[:budget] + suffix, where body joins, for its valid passages,
    ``Doc v`` + passage[:max_passage_tokens] with ``sep`` between them, and
    budget = max_obs_tokens - len(prefix) - len(suffix) (the wrappers are never cut).
    Everything runs where ``tokens`` lives (the other inputs are small and are moved there).
    Returns ``(out int32 [sum of lengths], cu_seqlens int64 [Q+1])`` on that device.
    """
    device = torch.as_tensor(tokens).device
    rows = _as(rows, torch.int64, device, "rows")
    if rows.dim() != 2:
        raise ValueError(f"rows must be [queries, k], got {tuple(rows.shape)}")
    header_offsets = _as(header_offsets, torch.int64, device, "header_offsets")
    if header_offsets.numel() < rows.shape[1] + 1:
        raise ValueError(f"header_offsets has {header_offsets.numel()} entries; "
                         f"k={rows.shape[1]} needs {rows.shape[1] + 1}")
    tokens, offsets = _as(tokens, torch.int32, device, "tokens"), _as(offsets, torch.int64, device, "offsets")
    headers = _as(headers, torch.int32, device, "headers")
    prefix, sep, suffix = (_as(x, torch.int32, device, n)
                           for x, n in ((prefix, "prefix"), (sep, "sep"), (suffix, "suffix")))
    cap = -1 if max_passage_tokens is None else int(max_passage_tokens)
    limit = -1 if max_obs_tokens is None else int(max_obs_tokens)
    if max_passage_tokens is not None and cap < 0:
        raise ValueError(f"max_passage_tokens must be >= 0 or None, got {max_passage_tokens}")
    if max_obs_tokens is not None and limit < prefix.numel() + suffix.numel():
        raise ValueError(f"max_obs_tokens={max_obs_tokens} cannot hold the wrappers "
                         f"({prefix.numel() + suffix.numel()} tokens)")
    if _use_cuda(impl, tokens, rows):
        return torch.ops.fastcredit.assemble_observations(tokens, offsets, rows, headers, header_offsets,
                                                          prefix, sep, suffix, cap, limit)
    return assemble_observations_torch(tokens, offsets, rows, headers, header_offsets, prefix, sep, suffix, cap, limit)
