"""Padded ``[B, L]`` views of a packed trajectory batch, for libraries that demand them, and back.

Legend: N packed response tokens, B trajectories, L longest response.

Everything after rollout works on the packed batch (``fastcredit.rollout.trajectory``);
these views exist only at the boundary with code that wants rectangles.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from fastcredit.rollout.trajectory import TrajectoryBatch, TrajectoryError, Turn, from_turns


@dataclass
class PaddedView:
    """``[B, L]`` right-padded views of a batch, for libraries that demand them."""

    tokens: torch.Tensor  # int64 [B, L], pad_id where not valid
    attention_mask: torch.Tensor  # bool [B, L] real tokens
    action_mask: torch.Tensor  # bool [B, L] policy-generated tokens
    seg_id: torch.Tensor  # int32 [B, L] global turn index of action tokens, -1 elsewhere
    demo_mask: torch.Tensor  # bool [B, L]


def _padded_index(batch: TrajectoryBatch, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every packed token in the ``[B, L]`` view."""
    row_N = batch.traj_index_N
    col_N = torch.arange(batch.num_tokens) - batch.cu_seqlens.long()[row_N]
    if batch.num_tokens and int(col_N.max()) >= L:
        raise TrajectoryError(f"pad length {L} is shorter than the longest trajectory")
    return row_N, col_N


def to_padded(batch: TrajectoryBatch, pad_id: int = 0, length: Optional[int] = None) -> PaddedView:
    """Scatter the packed stream into right-padded ``[B, L]`` tensors (L = longest unless given)."""
    B = batch.num_trajectories
    L = int(batch.seqlens_B.max()) if length is None and B > 0 else (length or 0)
    row, col = _padded_index(batch, L)

    def scatter(values, fill, dtype):
        out = torch.full((B, L), fill, dtype=dtype)
        out[row, col] = values.to(dtype)
        return out

    return PaddedView(
        tokens=scatter(batch.tokens_N, pad_id, torch.int64),
        attention_mask=scatter(torch.ones(batch.num_tokens, dtype=torch.bool), False, torch.bool),
        action_mask=scatter(batch.action_mask_N, False, torch.bool),
        seg_id=scatter(batch.seg_id_N, -1, torch.int32),
        demo_mask=scatter(batch.demo_mask_N, False, torch.bool),
    )


def pack_padded(batch: TrajectoryBatch, values_BL: torch.Tensor) -> torch.Tensor:
    """Gather a per-token ``[B, L, ...]`` tensor (e.g. log-probs from a padded forward) into ``[N, ...]``."""
    row, col = _padded_index(batch, values_BL.shape[1])
    return values_BL[row, col]


def from_padded(
    tokens_BL: torch.Tensor,
    lengths_B: torch.Tensor,
    turns_B: Sequence[Sequence[tuple]],
    demo_mask_BL: Optional[torch.Tensor] = None,
    **outcomes,
) -> TrajectoryBatch:
    """Build a batch from ``[B, L]`` tokens, row lengths and per-row turn layouts.

    ``turns_B[b]`` lists ``(action_len, obs_len, kind)`` for trajectory ``b``;
    they must tile ``lengths_B[b]``. ``outcomes`` are forwarded to :func:`from_turns`.
    """
    lengths = [int(x) for x in torch.as_tensor(lengths_B).tolist()]
    if len(lengths) != tokens_BL.shape[0] or len(turns_B) != tokens_BL.shape[0]:
        raise TrajectoryError(
            f"from_padded: {tokens_BL.shape[0]} rows, {len(lengths)} lengths, {len(turns_B)} turn layouts"
        )
    trajectories = []
    for b, layout in enumerate(turns_B):
        used = sum(int(a) + int(o) for a, o, _ in layout)
        if used != lengths[b] or lengths[b] > tokens_BL.shape[1]:
            raise TrajectoryError(
                f"from_padded: row {b} has length {lengths[b]} but its turns cover {used} tokens"
            )
        row, pos, turns = tokens_BL[b].tolist(), 0, []
        for a, o, kind in layout:
            a, o = int(a), int(o)
            demo = None if demo_mask_BL is None else demo_mask_BL[b, pos : pos + a].int().tolist()
            turns.append(Turn(row[pos : pos + a], kind, row[pos + a : pos + a + o], demo))
            pos += a + o
        trajectories.append(turns)
    return from_turns(trajectories, **outcomes)
