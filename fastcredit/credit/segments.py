"""Vectorised building blocks over packed segments: group statistics, segment reductions, scans.

Legend (shape suffixes):
    N  packed response tokens (observations included)
    A  action tokens only: the packed stream with observation tokens removed, same order
    S  turns, trajectory-major and in order
    B  trajectories
    G  groups (prompts)

Nothing here loops in Python over trajectories, turns or tokens. The one scan,
:func:`discounted_suffix_sum`, works on blocks whose size depends only on the discount.
"""
from __future__ import annotations

import math

import torch

# c^(-K) for a block of K elements stays below this; see discounted_suffix_sum.
_SCALE_LOG_LIMIT = 100.0 * math.log(10.0)


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


def action_layout(seg_id_N: torch.Tensor, seg_traj_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(idx_A, seg_A, traj_A)``: packed position, turn and trajectory of every action token."""
    idx_A = torch.nonzero(seg_id_N >= 0).flatten()
    seg_A = seg_id_N[idx_A].long()
    return idx_A, seg_A, seg_traj_S[seg_A]


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


def row_ends(row_A: torch.Tensor) -> torch.Tensor:
    """int64 ``[A]``: exclusive end index of each element's row (rows are contiguous runs; ids may skip)."""
    if row_A.numel() == 0:
        return row_A.to(torch.int64)
    rel_A = row_A - row_A[0]
    return torch.cumsum(torch.bincount(rel_A), 0)[rel_A]


def next_in_row(x_A: torch.Tensor, row_end_A: torch.Tensor) -> torch.Tensor:
    """``x`` shifted left by one inside each row; 0 after a row's last element."""
    nxt = torch.zeros_like(x_A)
    if x_A.numel() > 1:
        same = torch.arange(1, x_A.numel(), device=x_A.device) < row_end_A[:-1]
        nxt[:-1] = torch.where(same, x_A[1:], 0.0)
    return nxt


def discounted_suffix_sum(x_A: torch.Tensor, row_end_A: torch.Tensor, c: float) -> torch.Tensor:
    """``y_k = Σ_{k ≤ j < row_end_k} c^(j-k) x_j`` in float64: a discounted suffix sum inside contiguous rows.

    ``row_end_A`` is the exclusive end index of each element's row (:func:`row_ends`). This is GAE's ``A_k = δ_k + γλ A_{k+1}`` (with ``c = γλ``) for every row at once.

    NOTE (overflow): the textbook trick ``c^(-k) · reverse_cumsum(c^k x)`` overflows
    float64 once ``c^(-k)`` passes 1e308 (k ≈ 14,000 for c = 0.95). The stream is cut
    into blocks of ``K`` elements with ``c^(-K) ≤ 1e100``; inside a block every element
    is scaled by ``c^(-q)``, ``q`` its distance to the block's end, so scales never
    exceed 1e100 and the terms of later rows, when brought back by ``c^(q_k)``, are
    shrunk rather than amplified (their cancellation error stays ``≲ eps · Σ c^(j-k)|x_j|``).
    A row that runs past its block takes one carry, ``c^(d) · y(first element of the
    next block)``; the carry's own carry is multiplied by at least ``c^(K+1) < 1e-100``
    and is dropped, far below float64 resolution. The scales depend only on the column
    inside a block, so they broadcast (no per-element power). With ``c = 1`` the whole
    stream is one block (plain reverse cumsum, error ``≲ eps · Σ_{j>k}|x_j|``); with
    ``c = 0``, ``y = x``.
    """
    if not 0.0 <= c <= 1.0:
        raise ValueError(f"discount c = gamma * lambda must lie in [0, 1], got {c}")
    x_A = x_A.to(torch.float64)
    A = x_A.numel()
    if A == 0 or c == 0.0:
        return x_A.clone()
    K = A if c == 1.0 else max(1, min(A, int(_SCALE_LOG_LIMIT / -math.log(c))))
    nb = -(-A // K)
    dev = x_A.device
    # Work on a [nb, K] view padded with zeros; q = K-1 ... 0 is the distance to the block's end.
    q_K = torch.arange(K - 1, -1, -1, dtype=torch.float64, device=dev)
    W = torch.zeros(nb * K, dtype=torch.float64, device=dev)
    W[:A] = x_A
    W = W.view(nb, K)
    if c < 1.0:
        W.mul_(torch.pow(c, -q_K))
    R = W.flip(1).cumsum(1).flip(1)
    # Cut each block's suffix sums at the end of the element's row: subtract R there.
    row_end = torch.zeros(nb * K, dtype=torch.int64, device=dev)
    row_end[:A] = row_end_A
    row_end = row_end.view(nb, K)
    block_end = torch.arange(1, nb + 1, device=dev)[:, None] * K  # [nb, 1]
    stop = torch.minimum(row_end, block_end)
    R_flat = torch.cat([R.reshape(-1), R.new_zeros(1)])
    y = R - torch.where(stop < block_end, R_flat[stop], 0.0)
    if c < 1.0:
        y.mul_(torch.pow(c, q_K))
    if nb > 1:
        # A row that runs past its block: + c^(d) · y(first element of the next block), d = block end − k.
        head = torch.zeros(nb, 1, dtype=torch.float64, device=dev)
        head[:-1, 0] = y[1:, 0]
        dist_K = torch.arange(K, 0, -1, dtype=torch.float64, device=dev)
        y += torch.where(row_end > block_end, head * torch.pow(c, dist_K), 0.0)
    return y.reshape(-1)[:A]


def gather_turns(table_S: torch.Tensor, seg_id_N: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Per-token ``table_S[seg_id_N]``, ``fill`` where ``seg_id_N = -1`` (one gather, no masking pass)."""
    padded = torch.cat([torch.full((1,), fill, dtype=table_S.dtype, device=table_S.device), table_S])
    return padded.index_select(0, seg_id_N + 1)


def to_tokens(values_A: torch.Tensor, idx_A: torch.Tensor, N: int) -> torch.Tensor:
    """Scatter action-stream values ``[A]`` into the packed stream ``[N]`` (0 on observations)."""
    out = torch.zeros(N, dtype=values_A.dtype, device=values_A.device)
    return out.index_copy_(0, idx_A, values_A)


def whiten(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """veRL's ``masked_whiten``: ``(x - mean) / sqrt(var + 1e-8)``, weighted, unbiased var.

    ``weight`` counts how many tokens each entry stands for (1 per token, or a turn's
    action length when ``x`` is per turn), so whitening per-turn values equals whitening
    their per-token broadcast. Fewer than two tokens: returned unchanged.
    """
    w = weight.to(torch.float64)
    n = float(w.sum())
    if n < 2:
        return x
    mean = (w * x).sum() / n
    var = (w * (x - mean) ** 2).sum() / n * (n / (n - 1))
    return (x - mean) * torch.rsqrt(var + 1e-8)
