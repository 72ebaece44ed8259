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

import math
from typing import Optional

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


def next_in_row(x_A: torch.Tensor, row_len_R: torch.Tensor) -> torch.Tensor:
    """``x`` shifted left by one inside each row; 0 after a row's last element.

    ``row_len_R``: the lengths of the contiguous rows that tile ``x_A`` in order (zeros allowed)."""
    nxt = torch.empty_like(x_A)
    if x_A.numel():
        nxt[:-1] = x_A[1:]
        nxt[torch.cumsum(row_len_R, 0)[row_len_R > 0] - 1] = 0
    return nxt


def discounted_suffix_sum(x_A: torch.Tensor, row_len_R: torch.Tensor, c: float) -> torch.Tensor:
    """``y_k = Σ_{k ≤ j < row_end_k} c^(j-k) x_j`` in float64: a discounted suffix sum inside contiguous rows.

    ``row_len_R`` gives the lengths of the rows that tile ``x_A`` in order (zeros allowed). This is
    GAE's ``A_k = δ_k + γλ A_{k+1}`` (with ``c = γλ``) for every row at once.

    Six streaming passes over the data and work per segment, never per element index: the
    stream is reversed (suffix sums become prefix sums) and cut into blocks of ``K`` elements
    with ``c^(-K) ≤ 1e100``; element ``i`` at column ``q`` of its block is scaled by ``c^(-q)``,
    the blocks are cumulatively summed in place, and the sums are scaled back by ``c^q``.
    A *segment* is a maximal run inside one row and one block. Before the cumulative sum, the
    first element of each segment that starts inside a block receives ``−(previous segment's
    total)``, so the running sum restarts there; a segment that starts a block but continues
    its row from the block before receives the carry ``c^K · (that block's last segment's
    total)`` instead, i.e. ``c · y`` of the row's next element. The totals come from one
    ``segment_reduce``.

    NOTE (overflow and precision): the textbook ``c^(-k) · cumsum(c^k x)`` overflows float64
    once ``c^(-k)`` passes 1e308 (k ≈ 14,000 for c = 0.95); inside a block no scale exceeds
    1e100, and values of earlier segments are brought back by ``c^q`` with ``q`` at least their
    distance, so they are shrunk rather than amplified (cancellation error ``≲ eps · Σ
    c^(j-k)|x_j|``). The carry of a carry (a row spanning a whole block) is multiplied by at
    least ``c^(K+1) < 1e-100`` and is dropped, far below float64 resolution. With ``c = 1``
    the stream is one block; with ``c = 0``, ``y = x``.
    """
    if not 0.0 <= c <= 1.0:
        raise ValueError(f"discount c = gamma * lambda must lie in [0, 1], got {c}")
    x_A = x_A.to(torch.float64)
    A = x_A.numel()
    if int(row_len_R.sum()) != A:
        raise ValueError(f"row lengths sum to {int(row_len_R.sum())}, the stream has {A} elements")
    if A == 0 or c == 0.0:
        return x_A.clone()
    dev = x_A.device
    K = A if c == 1.0 else max(1, min(A, int(_SCALE_LOG_LIMIT / -math.log(c))))
    F = A - A % K  # elements in whole blocks; the rest is one short block
    z = x_A.flip(0)  # a fresh tensor: everything below works in place on it
    whole, tail = z[:F].view(-1, K), z[F:]
    col_K = torch.arange(K, dtype=torch.float64, device=dev)
    if c < 1.0:
        up_K = torch.pow(c, -col_K)
        whole.mul_(up_K)
        tail.mul_(up_K[:A - F])
    rows_R = row_len_R.flip(0).to(torch.int64)
    row_start = (torch.cumsum(rows_R, 0) - rows_R)[rows_R > 0]
    start_J = torch.unique(torch.cat([row_start, torch.arange(0, A, K, device=dev)]))  # segment starts, sorted
    if start_J.numel() > 1:
        total_J = torch.segment_reduce(z, "sum", lengths=torch.diff(start_J, append=start_J.new_tensor([A])))
        later = start_J[1:]  # every segment but the first, and the total of the one before it
        carry = torch.where((later % K == 0) & ~torch.isin(later, row_start), (c ** K) * total_J[:-1], 0.0)
        carried_before = torch.cat([carry.new_zeros(1), carry[:-1]])
        z.index_add_(0, later, torch.where(later % K > 0, -(total_J[:-1] + carried_before), carry))
    whole.cumsum_(1)
    tail.cumsum_(0)
    if c < 1.0:
        down_K = torch.pow(c, col_K)
        whole.mul_(down_K)
        tail.mul_(down_K[:A - F])
    return z.flip(0)


def gather_turns(table_S: torch.Tensor, seg_id_N: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Per-token ``table_S[seg_id_N]``, ``fill`` where ``seg_id_N = -1`` (one gather, no masking pass)."""
    padded = torch.cat([torch.full((1,), fill, dtype=table_S.dtype, device=table_S.device), table_S])
    return padded.index_select(0, seg_id_N + 1)


def to_tokens(values_A: torch.Tensor, idx_A: torch.Tensor, N: int) -> torch.Tensor:
    """Scatter action-stream values ``[A]`` into the packed stream ``[N]`` (0 on observations)."""
    out = torch.zeros(N, dtype=values_A.dtype, device=values_A.device)
    return out.index_copy_(0, idx_A, values_A)


def whiten(x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """veRL's ``masked_whiten``: ``(x - mean) / sqrt(var + 1e-8)``, weighted, unbiased var.

    ``weight`` counts how many tokens each entry stands for (1 per token, or a turn's
    action length when ``x`` is per turn), so whitening per-turn values equals whitening
    their per-token broadcast; None: every entry is one token. Fewer than two tokens:
    returned unchanged.
    """
    w = torch.ones_like(x, dtype=torch.float64) if weight is None else weight.to(torch.float64)
    n = float(w.sum())
    if n < 2:
        return x
    mean = (w * x).sum() / n
    var = (w * (x - mean) ** 2).sum() / n * (n / (n - 1))
    return (x - mean) * torch.rsqrt(var + 1e-8)
