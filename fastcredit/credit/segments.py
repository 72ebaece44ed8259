"""Vectorised building blocks over packed segments: group statistics, segment reductions, scans.

Legend (shape suffixes):
    N  packed response tokens (observations included)
    A  action tokens only: the packed stream with observation tokens removed, same order
    S  turns, trajectory-major and in order
    B  trajectories
    G  groups (prompts)

Nothing here loops in Python over trajectories, turns or tokens. The one scan,
:func:`discounted_suffix_sum`, works on blocks whose size depends only on the discount and
on rows given by their lengths.
"""
from __future__ import annotations

import functools
import math
import threading
from typing import Callable, Optional

import torch

# c^(-K) for a chunk of K elements stays below this; see discounted_prefix_sum_.
_SCALE_LOG_LIMIT = 100.0 * math.log(10.0)
_CHUNK = 64  # elements per chunk of the scan (at most)
_SCRATCH = threading.local()


def scratch(tag: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable buffer of ``n`` elements with undefined contents, kept per thread and tag.

    On the CPU a fresh multi-megabyte tensor costs a page fault per 4 KiB on first touch, which
    at 2M tokens takes longer than the arithmetic on it (measured: ~10 of ~25 ms of the GAE
    scan); the estimators run once per step on similar sizes, so their scratch is kept and only
    grows. CUDA's caching allocator already does this: there a plain ``torch.empty`` is returned.
    The buffer is valid until the next call with the same tag on this thread.
    """
    device = torch.device(device)
    if device.type != "cpu":
        return torch.empty(n, dtype=dtype, device=device)
    pool = getattr(_SCRATCH, "pool", None)
    if pool is None:
        pool = _SCRATCH.pool = {}
    buf = pool.get((tag, dtype))
    if buf is None or buf.numel() < n:
        buf = pool[(tag, dtype)] = torch.empty(n, dtype=dtype)
    return buf[:n]


@functools.lru_cache(maxsize=64)
def _column_scales(c: float, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(c^(-q), c^q)`` for ``q = 0..K-1`` in float64 (CPU; moved by the caller when needed)."""
    col_K = torch.arange(K, dtype=torch.float64)
    return torch.pow(c, -col_K), torch.pow(c, col_K)


def group_index(group_id_B: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense group index ``[B]`` in ``0..G-1`` for arbitrary int64 group ids, and ``G``."""
    if group_id_B.numel() == 0:
        return torch.zeros(0, dtype=torch.int64, device=group_id_B.device), 0
    _, inv_B = torch.unique(group_id_B, return_inverse=True)
    return inv_B, int(inv_B.max()) + 1


def seg_sum(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """Sum of ``values`` per bucket of ``index`` (``[size]``, same dtype as ``values``)."""
    out = torch.zeros(size, dtype=values.dtype, device=values.device)
    return out.index_add_(0, index, values)


def seg_max(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """Max of ``values`` per bucket (``-inf`` for an empty bucket)."""
    out = torch.full((size,), -math.inf, dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, index, values, reduce="amax", include_self=True)


def seg_min(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """Min of ``values`` per bucket (``+inf`` for an empty bucket)."""
    out = torch.full((size,), math.inf, dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, index, values, reduce="amin", include_self=True)


def group_advantage(reward_B: torch.Tensor, group_id_B: torch.Tensor, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO ``Â_i = (r_i - mean_g r) / (std_g r + eps)``; float64 ``[B]``.

    std is the unbiased one (``n - 1``); ``norm_by_std=False`` gives Dr. GRPO's
    ``r_i - mean_g r``. A group of one gets ``Â = 0`` (no baseline to compare with).
    """
    r_B = reward_B.to(torch.float64)
    inv_B, G = group_index(group_id_B)
    n_G = seg_sum(torch.ones_like(r_B), inv_B, G)
    mean_G = seg_sum(r_B, inv_B, G) / n_G.clamp(min=1)
    dev_B = r_B - mean_G[inv_B]
    # Two-pass variance: the deviations are exact for equal rewards, so such groups get 0.
    var_G = seg_sum(dev_B * dev_B, inv_B, G) / (n_G - 1).clamp(min=1)
    adv_B = dev_B / (var_G.sqrt()[inv_B] + eps) if norm_by_std else dev_B
    return torch.where(n_G[inv_B] > 1, adv_B, torch.zeros_like(adv_B))


def degenerate_groups(reward_B: torch.Tensor, group_id_B: torch.Tensor) -> torch.Tensor:
    """bool ``[B]``: the trajectory's group has all rewards equal (a group of one included)."""
    r_B = reward_B.to(torch.float64)
    inv_B, G = group_index(group_id_B)
    return (seg_max(r_B, inv_B, G) == seg_min(r_B, inv_B, G))[inv_B]


def turn_layout(seg_traj_S: torch.Tensor, B: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(T_B, first_B, t_S, final_S)``: turns per trajectory, index of its first turn,
    1-based turn number of every turn, and whether the turn is its trajectory's last."""
    T_B = torch.bincount(seg_traj_S, minlength=B)
    first_B = torch.cumsum(T_B, 0) - T_B
    t_S = torch.arange(seg_traj_S.numel(), device=seg_traj_S.device) - first_B[seg_traj_S] + 1
    return T_B, first_B, t_S, t_S == T_B[seg_traj_S]


def action_positions_last_first(seg_start_S: torch.Tensor, seg_action_len_S: torch.Tensor,
                                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int64 ``[A]``: the packed positions of the action tokens, last one first (the ``A`` stream reversed).

    Built from the turns' contiguous action spans (one fill and one cumsum over ``A``, no scan
    of the ``[N]`` mask): inside a span the position falls by one per element; the first element
    of each span jumps to that span's last token. ``out``: an int64 buffer of at least ``A`` elements.
    """
    has = seg_action_len_S > 0
    start_J, len_J = seg_start_S[has].flip(0), seg_action_len_S[has].flip(0)
    A = int(len_J.sum())
    if out is None:
        out = torch.empty(A, dtype=torch.int64, device=seg_start_S.device)
    steps = out[:A].fill_(-1)
    if A:
        before_J = torch.cat([start_J.new_zeros(1), start_J[:-1]])  # value just before the span's first element
        steps[torch.cumsum(len_J, 0) - len_J] = start_J + len_J - 1 - before_J
    return steps.cumsum_(0)


def turn_last_action(seg_action_len_S: torch.Tensor, seg_traj_S: torch.Tensor, B: int) -> torch.Tensor:
    """int64 ``[S]``: index in the action stream ``A`` where turn ``s``'s reward is paid.

    That is the turn's last action token; a turn without action tokens pays on the
    nearest earlier action token of its trajectory, and ``-1`` when there is none
    (no token could carry it).
    """
    end_S = torch.cumsum(seg_action_len_S, 0)
    T_B, first_B, _, _ = turn_layout(seg_traj_S, B)
    # Action-stream offset of each trajectory's first action token.
    start_B = torch.zeros(B, dtype=end_S.dtype, device=end_S.device)
    has_B = T_B > 0
    start_B[has_B] = (end_S - seg_action_len_S)[first_B[has_B]]
    last_S = end_S - 1
    return torch.where(last_S >= start_B[seg_traj_S], last_S, torch.full_like(last_S, -1))


def turn_first_action_value(values_N: torch.Tensor, seg_start_S: torch.Tensor,
                            seg_action_len_S: torch.Tensor) -> torch.Tensor:
    """float64 ``[S]``: the value at each turn's first action token, 0 for a turn without one."""
    has_S = seg_action_len_S > 0
    v_S = torch.zeros(seg_start_S.shape, dtype=torch.float64, device=seg_start_S.device)
    v_S[has_S] = values_N.to(torch.float64)[seg_start_S[has_S]]
    return v_S


def next_in_row(x_A: torch.Tensor, row_len_R: torch.Tensor) -> torch.Tensor:
    """``x`` shifted left by one inside each row; 0 after a row's last element.

    ``row_len_R``: the lengths of the contiguous rows that tile ``x_A`` in order (zeros allowed)."""
    nxt = torch.empty_like(x_A)
    if x_A.numel():
        nxt[:-1] = x_A[1:]
        nxt[torch.cumsum(row_len_R, 0)[row_len_R > 0] - 1] = 0
    return nxt


def add_prev_in_row_(out_A: torch.Tensor, x_A: torch.Tensor, row_len_R: torch.Tensor, c: float) -> torch.Tensor:
    """In place: ``out += c · (x shifted right by one inside each row)``, nothing at a row's first element.

    The reversed stream's form of :func:`next_in_row`, without materialising the shifted copy."""
    return _add_prev_(out_A, x_A, (torch.cumsum(row_len_R, 0) - row_len_R)[row_len_R > 0], c)


def _add_prev_(out: torch.Tensor, x: torch.Tensor, first: torch.Tensor, c: float) -> torch.Tensor:
    """:func:`add_prev_in_row_` with the rows given by their (sorted) first elements."""
    if x.numel() > 1:
        kept = out.index_select(0, first)  # restored exactly afterwards, no add-then-subtract rounding
        out[1:].add_(x[:-1], alpha=c)
        out.index_copy_(0, first, kept)
    return out


def discounted_suffix_sum(x_A: torch.Tensor, row_len_R: torch.Tensor, c: float) -> torch.Tensor:
    """``y_k = Σ_{k ≤ j < row_end_k} c^(j-k) x_j`` in float64: a discounted suffix sum inside contiguous rows.

    ``row_len_R`` gives the lengths of the rows that tile ``x_A`` in order (zeros allowed). This is
    GAE's ``A_k = δ_k + γλ A_{k+1}`` (with ``c = γλ``) for every row at once: the stream is
    reversed, so the suffix sums become the prefix sums of :func:`discounted_prefix_sum_`.
    """
    return discounted_prefix_sum_(x_A.to(torch.float64).flip(0), row_len_R.flip(0), c).flip(0)


def discounted_prefix_sum_(z: torch.Tensor, row_len_R: torch.Tensor, c: float) -> torch.Tensor:
    """In place on a contiguous float64 ``z``: ``y_k = Σ_{row_start_k ≤ j ≤ k} c^(k-j) z_j``; returns ``z``.

    ``y_k = z_k + c·y_{k-1}`` inside each row: a chunked scan with no per-element Python work.
    The stream is cut into chunks of ``K ≤ 64`` elements (fewer when ``c^(-K)`` would pass 1e100):

    1. inside each chunk, element ``q`` is scaled by ``c^(-q)`` and the chunk is cumulatively
       summed (one ``cumsum`` over a ``[chunks, K]`` view);
    2. a row that starts inside a chunk restarts there: its elements up to the next start or
       the chunk's end subtract the running sum just before the start (ranges of < K elements);
    3. the value entering each chunk from the one before, ``Y_b = y_{bK-1}`` (0 at a row start),
       obeys the same recursion one level up: ``Y_b = L_{b-1} + c^K·Y_{b-1}``, where
       ``L_{b-1}`` is chunk ``b-1``'s own last value, and the chain breaks at every chunk that
       holds a row start. That scan over ``A/K`` chunks recurses; each level is 64x shorter;
    4. each chunk adds ``c·Y_b`` before the first row start in it, and is scaled back by ``c^q``.

    NOTE (overflow and precision): no scale exceeds ``c^(-K) ≤ 1e100``; values before a restart
    are brought back by ``c^q`` with ``q`` at least their distance, so they are shrunk, never
    amplified (cancellation error ``≲ eps · Σ c^(k-j)|z_j|``). With ``c < 1e-50`` (``K = 1``) the
    chunk level is the scan itself, so only the one-step term ``c·z_{k-1}`` is added: the next
    term, ``c^2 < 1e-100``, is far below float64 resolution.
    """
    if not 0.0 <= c <= 1.0:
        raise ValueError(f"discount c = gamma * lambda must lie in [0, 1], got {c}")
    if z.dtype != torch.float64 or not z.is_contiguous():
        raise ValueError(f"the scan works in place on a contiguous float64 stream, got {z.dtype}")
    A = z.numel()
    if int(row_len_R.sum()) != A:
        raise ValueError(f"row lengths sum to {int(row_len_R.sum())}, the stream has {A} elements")
    if A == 0 or c == 0.0:
        return z
    rows_R = row_len_R.to(torch.int64)
    return _chunked_scan_(z, (torch.cumsum(rows_R, 0) - rows_R)[rows_R > 0], c)


def _chunked_scan_(z: torch.Tensor, start_R: torch.Tensor, c: float) -> torch.Tensor:
    """:func:`discounted_prefix_sum_` on a non-empty stream whose rows start at ``start_R`` (sorted, from 0)."""
    A, dev = z.numel(), z.device
    K = min(A, _CHUNK) if c == 1.0 else max(1, min(A, _CHUNK, int(_SCALE_LOG_LIMIT / -math.log(c))))
    if K == 1:
        return _add_prev_(z, z.clone(), start_R, c)
    F = A - A % K  # elements in whole chunks; the rest is one short chunk
    C = -(-A // K)
    whole, tail = z[:F].view(-1, K), z[F:]
    up_K, down_K = (t.to(dev) for t in _column_scales(c, K))
    if c < 1.0:
        whole.mul_(up_K)
        tail.mul_(up_K[:A - F])
    whole.cumsum_(1)
    tail.cumsum_(0)
    # Rows that start inside a chunk (not at its column 0), and where their restart range ends.
    inner = start_R[start_R % K != 0]
    nxt = torch.cat([start_R[1:], start_R.new_tensor([A])])[start_R % K != 0]
    end = torch.minimum(nxt, torch.clamp((inner // K + 1) * K, max=A))
    before = z.index_select(0, inner - 1)  # the running sum just before each restart
    chunk_C = torch.arange(C, device=dev)
    has_start_C = torch.zeros(C, dtype=torch.bool, device=dev)
    has_start_C[start_R // K] = True
    carry_C = torch.zeros(C, dtype=torch.float64, device=dev)
    if C > 1:
        # L_b: chunk b's last value without the carry in; after an inner restart, minus the sum before it.
        last_len_C = torch.clamp(A - chunk_C * K, max=K)
        own_C = z.index_select(0, chunk_C * K + last_len_C - 1)
        if inner.numel():
            last_inner = torch.full((C,), -1, dtype=torch.int64, device=dev)
            last_inner.scatter_reduce_(0, inner // K, torch.arange(inner.numel(), device=dev), "amax")
            own_C -= torch.where(last_inner >= 0, before[last_inner.clamp(min=0)], 0.0)
        own_C *= down_K[last_len_C - 1]
        links = start_R.new_ones(C, dtype=torch.bool)
        links[start_R[start_R % K == 0] // K] = False  # chunk b starts a row: nothing enters it
        x_C = torch.where(links[1:], own_C[:-1], 0.0)
        # The chain Y_b = x_b + c^K·Y_{b-1} breaks where a chunk starts a row or follows one holding a start.
        breaks = torch.cat([chunk_C.new_zeros(1), (chunk_C[1:])[~links[1:] | has_start_C[:-1]]])
        y_C = torch.cat([carry_C.new_zeros(1), x_C])
        _chunked_scan_(y_C, breaks, c ** K)
        carry_C = c * y_C
    whole.add_(carry_C[:F // K, None])
    tail.add_(carry_C[C - 1] if F < A else 0.0)
    if inner.numel():
        # Inside a restart range: remove the carry (it ends at the restart) and the sum before it.
        n_J = end - inner
        fix_J = torch.repeat_interleave(before + carry_C[inner // K], n_J)
        pos_J = torch.repeat_interleave(inner - (torch.cumsum(n_J, 0) - n_J), n_J) + torch.arange(
            int(n_J.sum()), device=dev)
        z.index_add_(0, pos_J, fix_J, alpha=-1.0)
    if c < 1.0:
        whole.mul_(down_K)
        tail.mul_(down_K[:A - F])
    return z


def gather_turns(table_S: torch.Tensor, seg_id_N: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Per-token ``table_S[seg_id_N]``, ``fill`` where ``seg_id_N = -1`` (one gather, no masking pass)."""
    padded = torch.cat([torch.full((1,), fill, dtype=table_S.dtype, device=table_S.device), table_S])
    return padded.index_select(0, seg_id_N + 1)


def to_tokens(values_A: torch.Tensor, idx_A: torch.Tensor, N: int) -> torch.Tensor:
    """Scatter action-stream values ``[A]`` into the packed stream ``[N]`` (0 on observations)."""
    out = torch.zeros(N, dtype=values_A.dtype, device=values_A.device)
    return out.scatter_(0, idx_A, values_A)


def whiten(x: torch.Tensor, weight: Optional[torch.Tensor] = None,
           sum_over_ranks: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """veRL's ``masked_whiten``: ``(x - mean) / sqrt(var + 1e-8)``, weighted, unbiased var.

    ``weight`` counts how many tokens each entry stands for (1 per token, or a turn's
    action length when ``x`` is per turn), so whitening per-turn values equals whitening
    their per-token broadcast; None: every entry is one token. Fewer than two tokens:
    returned unchanged. ``sum_over_ranks``: the statistics are the whole batch's, each rank
    holding a share (two sums over ranks: the count and total, then the squared deviations),
    as veRL whitens the whole batch; None: ``x`` is the whole batch.
    """
    total = sum_over_ranks or (lambda t: t)
    w = torch.ones_like(x, dtype=torch.float64) if weight is None else weight.to(torch.float64)
    n, s = total(torch.stack([w.sum(), (w * x).sum()]).to(torch.float64)).tolist()
    if n < 2:
        return x
    mean = torch.tensor(s / n, dtype=torch.float64, device=x.device)
    var = total((w * (x - mean) ** 2).sum().reshape(1)) / n * (n / (n - 1))
    return (x - mean) * torch.rsqrt(var[0] + 1e-8)
