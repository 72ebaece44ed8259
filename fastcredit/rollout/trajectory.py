"""The packed trajectory batch: the data model every phase after rollout works on.

Legend (shape suffixes):
    N  packed response tokens of the whole batch (no padding)
    B  trajectories
    S  turns ("segments") of all trajectories, trajectory-major, in order

A trajectory's response is a sequence of turns. Turn ``s`` occupies the packed
tokens ``[seg_start_S[s], seg_start_S[s] + seg_action_len_S[s])`` (its action, which
the policy wrote) followed by ``seg_obs_len_S[s]`` observation tokens (written by the
environment, never trained on). Turns of a trajectory are contiguous and tile its
response exactly. ``seg_id_N`` maps each action token to its turn and is -1 on
observation tokens. Turn kinds are ``fastcredit.credit.types.TurnKind`` (imported here,
the estimators read the same codes).
"""
from __future__ import annotations

import dataclasses
import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from fastcredit.credit.types import TurnKind


class TrajectoryError(ValueError):
    """A trajectory batch violates an invariant of the data model."""


@dataclass
class Turn:
    """One turn as the rollout produced it: the input to :func:`from_turns`."""

    action_ids: Sequence[int]
    kind: "TurnKind | str"
    obs_ids: Sequence[int] = ()
    # Per action token: 1 where the token is a refined (demonstration) token (ProCeedRL).
    demo: Optional[Sequence[int]] = None
    # The policy version (updates done) whose weights generated the action; None where the engine reports none.
    version: Optional[int] = None


@dataclass
class TrajectoryBatch:
    """A batch of ``B`` trajectories with packed response tokens and turn segments.

    Construct with :func:`from_turns` or directly; every constructor runs :meth:`validate`, which raises
    :class:`TrajectoryError` naming the first broken invariant.
    """

    tokens_N: torch.Tensor  # int64 [N] response token ids, trajectories back to back
    cu_seqlens: torch.Tensor  # int32 [B+1] trajectory b is tokens cu[b]:cu[b+1]
    seg_start_S: torch.Tensor  # int64 [S] packed offset of the turn's first token
    seg_action_len_S: torch.Tensor  # int64 [S] tokens the policy wrote in this turn
    seg_obs_len_S: torch.Tensor  # int64 [S] observation tokens after the action
    seg_traj_S: torch.Tensor  # int64 [S] trajectory index of the turn
    seg_kind_S: torch.Tensor  # int8 [S] TurnKind
    seg_id_N: torch.Tensor  # int32 [N] turn index of an action token, -1 on observations
    demo_mask_N: torch.Tensor  # bool [N] refined (ProCeedRL demonstration) action tokens
    group_id_B: torch.Tensor  # int64 [B] prompt group; samples of one prompt share it
    em_B: torch.Tensor  # float32 [B] exact match of the extracted answer
    f1_B: torch.Tensor  # float32 [B] token F1 of the extracted answer
    format_ok_B: torch.Tensor  # bool [B] every action well formed (rewards.format_ok)
    seg_obs_key_S: torch.Tensor  # int64 [S] observation_key of the turn's observation ids (GiGPO's anchor states)
    predictions: list = field(default_factory=list)  # [B] extracted answer or None
    # Optional per-token sampling log-probs reported by the rollout engine.
    rollout_logp_N: Optional[torch.Tensor] = None
    # Optional int64 [S]: the policy version that generated each turn (fastcredit.trainer.offpolicy reads its lag).
    seg_version_S: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_trajectories(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.tokens_N.numel())

    @property
    def num_turns(self) -> int:
        return int(self.seg_start_S.numel())

    @property
    def seqlens_B(self) -> torch.Tensor:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()

    @property
    def action_mask_N(self) -> torch.Tensor:
        """bool [N]: tokens the policy generated (the only ones ever trained on)."""
        return self.seg_id_N >= 0

    @property
    def turns_per_traj_B(self) -> torch.Tensor:
        """int64 [B]: number of turns ``T_i`` of each trajectory."""
        return torch.bincount(self.seg_traj_S, minlength=self.num_trajectories)

    @property
    def first_seg_B(self) -> torch.Tensor:
        """int64 [B]: index of each trajectory's first turn."""
        counts = self.turns_per_traj_B
        return torch.cumsum(counts, 0) - counts

    @property
    def seg_is_final_S(self) -> torch.Tensor:
        """bool [S]: the turn is the last of its trajectory."""
        last = self.first_seg_B + self.turns_per_traj_B - 1
        out = torch.zeros(self.num_turns, dtype=torch.bool)
        out[last] = True
        return out

    @property
    def turn_index_N(self) -> torch.Tensor:
        """int64 [N]: global turn of every token, observation tokens included."""
        seg_len = self.seg_action_len_S + self.seg_obs_len_S
        return torch.repeat_interleave(torch.arange(self.num_turns), seg_len)

    @property
    def traj_index_N(self) -> torch.Tensor:
        """int64 [N]: trajectory of every token."""
        return torch.repeat_interleave(torch.arange(self.num_trajectories), self.seqlens_B)

    @property
    def last_action_token_S(self) -> torch.Tensor:
        """int64 [S]: packed index of a turn's last action token (-1 for an empty action)."""
        end = self.seg_start_S + self.seg_action_len_S - 1
        return torch.where(self.seg_action_len_S > 0, end, torch.full_like(end, -1))

    def validate(self) -> None:
        """Check every invariant of the data model; raise TrajectoryError on the first miss."""
        _check_dtypes(self)
        B, N, S = self.num_trajectories, self.num_tokens, self.num_turns
        cu = self.cu_seqlens.long()
        if B < 0 or int(cu[0]) != 0 or int(cu[-1]) != N:
            raise TrajectoryError(f"cu_seqlens must start at 0 and end at N={N}, got {cu.tolist()[:8]}…")
        if bool((cu[1:] < cu[:-1]).any()):
            raise TrajectoryError("cu_seqlens must be non-decreasing")
        for name, t, n in (
            ("seg_action_len_S", self.seg_action_len_S, S), ("seg_obs_len_S", self.seg_obs_len_S, S),
            ("seg_traj_S", self.seg_traj_S, S), ("seg_kind_S", self.seg_kind_S, S),
            ("seg_id_N", self.seg_id_N, N), ("demo_mask_N", self.demo_mask_N, N),
            ("group_id_B", self.group_id_B, B), ("em_B", self.em_B, B), ("f1_B", self.f1_B, B),
            ("format_ok_B", self.format_ok_B, B), ("seg_obs_key_S", self.seg_obs_key_S, S),
        ):
            if t.dim() != 1 or t.numel() != n:
                raise TrajectoryError(f"{name} must have shape [{n}], got {list(t.shape)}")
        if len(self.predictions) != B:
            raise TrajectoryError(f"predictions must have {B} entries, got {len(self.predictions)}")
        if self.rollout_logp_N is not None and self.rollout_logp_N.shape != (N,):
            raise TrajectoryError(f"rollout_logp_N must have shape [{N}], got {list(self.rollout_logp_N.shape)}")
        if self.seg_version_S is not None and (self.seg_version_S.shape != (S,)
                                               or self.seg_version_S.dtype != torch.int64):
            raise TrajectoryError(f"seg_version_S must be int64 of shape [{S}], got {self.seg_version_S.dtype} "
                                  f"{list(self.seg_version_S.shape)}")
        if S == 0:
            if B > 0:
                raise TrajectoryError("every trajectory needs at least one turn; trajectory 0 has none")
            return
        _check_segments(self, cu)
        _check_seg_id(self)


def _check_dtypes(b: TrajectoryBatch) -> None:
    expect = {
        "tokens_N": (torch.int64, torch.int32), "cu_seqlens": (torch.int32, torch.int64),
        "seg_start_S": (torch.int64,), "seg_action_len_S": (torch.int64,),
        "seg_obs_len_S": (torch.int64,), "seg_traj_S": (torch.int64,), "seg_kind_S": (torch.int8,),
        "seg_id_N": (torch.int32,), "demo_mask_N": (torch.bool,), "group_id_B": (torch.int64,),
        "em_B": (torch.float32,), "f1_B": (torch.float32,), "format_ok_B": (torch.bool,),
        "seg_obs_key_S": (torch.int64,),
    }
    for name, dtypes in expect.items():
        t = getattr(b, name)
        if not isinstance(t, torch.Tensor):
            raise TrajectoryError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            raise TrajectoryError(f"{name} must have dtype {dtypes[0]}, got {t.dtype}")


def _check_segments(b: TrajectoryBatch, cu: torch.Tensor) -> None:
    traj, start = b.seg_traj_S, b.seg_start_S
    if bool((b.seg_action_len_S < 0).any()) or bool((b.seg_obs_len_S < 0).any()):
        raise TrajectoryError("turn lengths must be non-negative")
    if bool((traj < 0).any()) or bool((traj >= b.num_trajectories).any()):
        raise TrajectoryError(f"seg_traj_S must lie in [0, {b.num_trajectories})")
    if bool((traj[1:] < traj[:-1]).any()):
        raise TrajectoryError("turns must be ordered by trajectory (seg_traj_S non-decreasing)")
    counts = torch.bincount(traj, minlength=b.num_trajectories)
    if bool((counts == 0).any()):
        bad = int(torch.nonzero(counts == 0)[0])
        raise TrajectoryError(f"every trajectory needs at least one turn; trajectory {bad} has none")
    first = torch.cumsum(counts, 0) - counts
    end = start + b.seg_action_len_S + b.seg_obs_len_S
    is_first = torch.zeros_like(traj, dtype=torch.bool)
    is_first[first] = True
    expected_start = torch.where(is_first, cu[traj], torch.roll(end, 1))
    if bool((start != expected_start).any()):
        s = int(torch.nonzero(start != expected_start)[0])
        raise TrajectoryError(
            f"turn {s} of trajectory {int(traj[s])} starts at {int(start[s])}, expected "
            f"{int(expected_start[s])}: turns must tile their trajectory without gaps"
        )
    last = first + counts - 1
    if bool((end[last] != cu[1:]).any()):
        t = int(torch.nonzero(end[last] != cu[1:])[0])
        raise TrajectoryError(f"the turns of trajectory {t} end at {int(end[last[t]])}, not at {int(cu[t + 1])}")
    kind = b.seg_kind_S.long()
    if bool((kind < 0).any()) or bool((kind > max(TurnKind)).any()):
        raise TrajectoryError(f"seg_kind_S values must be TurnKind codes 0..{int(max(TurnKind))}")
    ending = (kind == TurnKind.ANSWER) | (kind == TurnKind.TRUNCATED)
    is_last = torch.zeros_like(is_first)
    is_last[last] = True
    if bool((ending & ~is_last).any()):
        s = int(torch.nonzero(ending & ~is_last)[0])
        raise TrajectoryError(f"turn {s} is {TurnKind(int(kind[s])).name.lower()} "
                              f"but not the last of trajectory {int(traj[s])}")
    if bool((is_last & ~ending).any()):
        s = int(torch.nonzero(is_last & ~ending)[0])
        raise TrajectoryError(
            f"the last turn of trajectory {int(traj[s])} is {TurnKind(int(kind[s])).name.lower()}; "
            "a trajectory must end with an answer or a truncated turn"
        )
    if bool((ending & (b.seg_obs_len_S > 0)).any()):
        s = int(torch.nonzero(ending & (b.seg_obs_len_S > 0))[0])
        raise TrajectoryError(f"turn {s} ends its trajectory and cannot have an observation")


def _check_seg_id(b: TrajectoryBatch) -> None:
    expected = _seg_id_from_segments(b.seg_start_S, b.seg_action_len_S, b.seg_obs_len_S)
    if not torch.equal(b.seg_id_N.long(), expected):
        n = int(torch.nonzero(b.seg_id_N.long() != expected)[0])
        raise TrajectoryError(
            f"seg_id_N[{n}] = {int(b.seg_id_N[n])} but the segments say {int(expected[n])}"
        )
    if bool((b.demo_mask_N & (b.seg_id_N < 0)).any()):
        n = int(torch.nonzero(b.demo_mask_N & (b.seg_id_N < 0))[0])
        raise TrajectoryError(f"demo_mask_N[{n}] is set on an observation token")


def _seg_id_from_segments(start_S, action_len_S, obs_len_S) -> torch.Tensor:
    """int64 [N]: turn index on action tokens, -1 on observation tokens (vectorised)."""
    S = start_S.numel()
    seg_len = action_len_S + obs_len_S
    turn_N = torch.repeat_interleave(torch.arange(S), seg_len)
    offset_N = torch.arange(turn_N.numel()) - torch.repeat_interleave(start_S, seg_len)
    is_action = offset_N < action_len_S[turn_N]
    return torch.where(is_action, turn_N, torch.full_like(turn_N, -1))


def observation_key(obs_ids: Sequence[int]) -> int:
    """A 63-bit hash of one observation's token ids (BLAKE2b, the same in every process): equal ids, equal keys."""
    digest = hashlib.blake2b(array("q", obs_ids).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _outcome_tensors(B, group_id, em, f1, format_ok, predictions):
    def as_tensor(v, dtype, default):
        return torch.as_tensor(default if v is None else v, dtype=dtype).reshape(-1)

    return dict(
        group_id_B=as_tensor(group_id, torch.int64, list(range(B))),
        em_B=as_tensor(em, torch.float32, [0.0] * B),
        f1_B=as_tensor(f1, torch.float32, [0.0] * B),
        format_ok_B=as_tensor(format_ok, torch.bool, [False] * B),
        predictions=list(predictions) if predictions is not None else [None] * B,
    )


def from_turns(
    trajectories: Sequence[Sequence[Turn]],
    *,
    group_id=None,
    em=None,
    f1=None,
    format_ok=None,
    predictions=None,
) -> TrajectoryBatch:
    """Pack a list of trajectories (each a list of :class:`Turn`) into a batch."""
    tokens, starts, alen, olen, traj, kinds, demo, obs_keys, versions = [], [], [], [], [], [], [], [], []
    cu, pos = [0], 0
    for b, turns in enumerate(trajectories):
        for t, turn in enumerate(turns):
            a, o = list(turn.action_ids), list(turn.obs_ids)
            d = [0] * len(a) if turn.demo is None else [int(x) for x in turn.demo]
            if len(d) != len(a):
                raise TrajectoryError(
                    f"trajectory {b} turn {t}: demo has {len(d)} entries for {len(a)} action tokens"
                )
            starts.append(pos)
            alen.append(len(a))
            olen.append(len(o))
            traj.append(b)
            kinds.append(int(TurnKind.parse(turn.kind)))
            obs_keys.append(observation_key(o))
            versions.append(turn.version)
            tokens += a + o
            demo += d + [0] * len(o)
            pos += len(a) + len(o)
        cu.append(pos)
    start_S = torch.tensor(starts, dtype=torch.int64)
    alen_S = torch.tensor(alen, dtype=torch.int64)
    olen_S = torch.tensor(olen, dtype=torch.int64)
    B = len(trajectories)
    return TrajectoryBatch(
        tokens_N=torch.tensor(tokens, dtype=torch.int64),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        seg_start_S=start_S,
        seg_action_len_S=alen_S,
        seg_obs_len_S=olen_S,
        seg_traj_S=torch.tensor(traj, dtype=torch.int64),
        seg_kind_S=torch.tensor(kinds, dtype=torch.int8),
        seg_id_N=_seg_id_from_segments(start_S, alen_S, olen_S).to(torch.int32),
        demo_mask_N=torch.tensor(demo, dtype=torch.bool),
        seg_obs_key_S=torch.tensor(obs_keys, dtype=torch.int64),
        seg_version_S=_versions(versions),
        **_outcome_tensors(B, group_id, em, f1, format_ok, predictions),
    )


def _versions(versions: list) -> Optional[torch.Tensor]:
    """Every turn's policy version, or None when no turn has one; some but not all is an error."""
    missing = [i for i, v in enumerate(versions) if v is None]
    if len(missing) == len(versions):
        return None
    if missing:
        raise TrajectoryError(f"turn {missing[0]} (packed order) has no policy version while others have one")
    return torch.tensor(versions, dtype=torch.int64)


def to_turns(batch: TrajectoryBatch) -> list[list[Turn]]:
    """Inverse of :func:`from_turns` (Python lists; for tests, debugging and logging)."""
    tok = batch.tokens_N.tolist()
    demo = batch.demo_mask_N.tolist()
    versions = None if batch.seg_version_S is None else batch.seg_version_S.tolist()
    out: list[list[Turn]] = [[] for _ in range(batch.num_trajectories)]
    for s in range(batch.num_turns):
        st, a, o = int(batch.seg_start_S[s]), int(batch.seg_action_len_S[s]), int(batch.seg_obs_len_S[s])
        out[int(batch.seg_traj_S[s])].append(
            Turn(
                action_ids=tok[st : st + a],
                kind=TurnKind(int(batch.seg_kind_S[s])),
                obs_ids=tok[st + a : st + a + o],
                demo=[int(x) for x in demo[st : st + a]],
                version=None if versions is None else versions[s],
            )
        )
    return out


def selection_index(batch: TrajectoryBatch, index_K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tok_N', seg_S')``: the packed token and turn indices of trajectories ``index_K``, in
    :func:`select`'s order, to cut per-token and per-turn tensors that live beside the batch."""
    index_K = torch.as_tensor(index_K, dtype=torch.int64).reshape(-1)
    return (_ranges(batch.cu_seqlens.long()[index_K], batch.seqlens_B[index_K]),
            _ranges(batch.first_seg_B[index_K], batch.turns_per_traj_B[index_K]))


def select(batch: TrajectoryBatch, index_K: torch.Tensor) -> TrajectoryBatch:
    """Keep the trajectories ``index_K`` (in that order); vectorised, no Python loop over tokens."""
    index_K = torch.as_tensor(index_K, dtype=torch.int64).reshape(-1)
    counts, first = batch.turns_per_traj_B, batch.first_seg_B
    seg_K = _ranges(first[index_K], counts[index_K])
    tok_K = _ranges(batch.cu_seqlens.long()[index_K], batch.seqlens_B[index_K])
    new_len = batch.seqlens_B[index_K]
    cu = torch.zeros(index_K.numel() + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(new_len, 0)
    new_traj_S = torch.repeat_interleave(torch.arange(index_K.numel()), counts[index_K])
    # A turn keeps its offset inside its trajectory; only the trajectory's base moves.
    rel_start = batch.seg_start_S[seg_K] - batch.cu_seqlens.long()[batch.seg_traj_S[seg_K]]
    start_S = cu[new_traj_S] + rel_start
    alen, olen = batch.seg_action_len_S[seg_K], batch.seg_obs_len_S[seg_K]
    return TrajectoryBatch(
        tokens_N=batch.tokens_N[tok_K],
        cu_seqlens=cu.to(batch.cu_seqlens.dtype),
        seg_start_S=start_S,
        seg_action_len_S=alen,
        seg_obs_len_S=olen,
        seg_traj_S=new_traj_S,
        seg_kind_S=batch.seg_kind_S[seg_K],
        seg_id_N=_seg_id_from_segments(start_S, alen, olen).to(torch.int32),
        demo_mask_N=batch.demo_mask_N[tok_K],
        group_id_B=batch.group_id_B[index_K],
        em_B=batch.em_B[index_K],
        f1_B=batch.f1_B[index_K],
        format_ok_B=batch.format_ok_B[index_K],
        seg_obs_key_S=batch.seg_obs_key_S[seg_K],
        predictions=[batch.predictions[int(i)] for i in index_K],
        rollout_logp_N=None if batch.rollout_logp_N is None else batch.rollout_logp_N[tok_K],
        seg_version_S=None if batch.seg_version_S is None else batch.seg_version_S[seg_K],
    )


def concat(batches: Sequence[TrajectoryBatch]) -> TrajectoryBatch:
    """Concatenate batches (e.g. refilled groups after dynamic sampling)."""
    if not batches:
        raise TrajectoryError("concat needs at least one batch")
    tok_off = torch.tensor([0] + [b.num_tokens for b in batches]).cumsum(0)
    traj_off = torch.tensor([0] + [b.num_trajectories for b in batches]).cumsum(0)
    seg_off = torch.tensor([0] + [b.num_turns for b in batches]).cumsum(0)
    cat = lambda name: torch.cat([getattr(b, name) for b in batches])  # noqa: E731
    cu = torch.cat([batches[0].cu_seqlens[:1].long()] + [
        b.cu_seqlens[1:].long() + tok_off[i] for i, b in enumerate(batches)
    ])
    logps = [b.rollout_logp_N for b in batches]
    versions = [b.seg_version_S for b in batches]
    return TrajectoryBatch(
        tokens_N=cat("tokens_N"),
        cu_seqlens=cu.to(batches[0].cu_seqlens.dtype),
        seg_start_S=torch.cat([b.seg_start_S + tok_off[i] for i, b in enumerate(batches)]),
        seg_action_len_S=cat("seg_action_len_S"),
        seg_obs_len_S=cat("seg_obs_len_S"),
        seg_traj_S=torch.cat([b.seg_traj_S + traj_off[i] for i, b in enumerate(batches)]),
        seg_kind_S=cat("seg_kind_S"),
        seg_id_N=torch.cat([
            torch.where(b.seg_id_N >= 0, b.seg_id_N + int(seg_off[i]), b.seg_id_N)
            for i, b in enumerate(batches)
        ]),
        demo_mask_N=cat("demo_mask_N"),
        group_id_B=cat("group_id_B"),
        em_B=cat("em_B"),
        f1_B=cat("f1_B"),
        format_ok_B=cat("format_ok_B"),
        seg_obs_key_S=cat("seg_obs_key_S"),
        predictions=[p for b in batches for p in b.predictions],
        rollout_logp_N=None if any(lp is None for lp in logps) else torch.cat(logps),
        seg_version_S=None if any(v is None for v in versions) else torch.cat(versions),
    )


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(s, s + n)`` for each (s, n), without a Python loop."""
    total = int(lengths.sum()) if lengths.numel() else 0
    base = torch.repeat_interleave(starts, lengths)
    within = torch.arange(total) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    return base + within


def replace(batch: TrajectoryBatch, **changes) -> TrajectoryBatch:
    """A copy with some fields replaced (validated again)."""
    return dataclasses.replace(batch, **changes)

