"""The estimator interface's data: turn kinds, inputs, result, and what an estimator needs.

Legend (shape suffixes):
    N  packed response tokens of the batch (observations included)
    S  turns ("segments"), trajectory-major and in order
    B  trajectories

Credit never imports the rollout package: :meth:`CreditInputs.from_batch` reads a
trajectory batch's tensors by attribute name, and the turn-kind codes of the data model
are defined here (``fastcredit.rollout.trajectory`` uses them).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Callable, Optional

import torch

from fastcredit.credit.segments import gather_turns


class TurnKind(IntEnum):
    """How a turn's action ended (docs/methods.md "The objects")."""

    SEARCH = 0  # ended with </search>; followed by the retrieved passages
    ANSWER = 1  # ended with </answer>; the trajectory ends
    INVALID = 2  # neither tag, or an empty query; followed by a corrective message
    TRUNCATED = 3  # a length or turn budget ran out; the trajectory ends

    @classmethod
    def parse(cls, value: "TurnKind | str | int") -> "TurnKind":
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError(
                    f"unknown turn kind {value!r}; valid: {[k.name.lower() for k in cls]}"
                ) from None
        return cls(int(value))


TURN_KINDS = tuple(k.name.lower() for k in TurnKind)  # "search", "answer", "invalid", "truncated"

JUDGE_KINDS = ("critic", "round_judge", "prm")


@dataclass(frozen=True)
class Needs:
    """What an estimator needs besides the batch layout; declared where it registers.

    The judge phase, model construction and config validation read this, never the
    estimator's name.
    """

    judge: Optional[str] = None  # "critic" (per-search-turn labels), "round_judge" (CW-GRPO), "prm" (PiCA)
    value_model: bool = False  # trains a value model on ``returns_N``; ``values_N`` is given
    proceed_rollout: bool = False  # the batch comes from ProCeed rewind-and-refine rollouts
    gold_answers: bool = False  # the step keeps each trajectory's gold answers for the training side
    # IG-Search: the training side scores the gold answer under the rollout policy after each search turn (one more
    # packed no-grad forward beside the old log-probs, its own timed phase) and gives ig_S and the query spans
    answer_scoring: bool = False
    inputs: tuple = ()  # CreditInputs fields that must be given

    def __post_init__(self) -> None:
        if self.judge is not None and self.judge not in JUDGE_KINDS:
            raise ValueError(f"unknown judge kind {self.judge!r}; valid: {', '.join(JUDGE_KINDS)}")
        if self.answer_scoring and not self.gold_answers:
            raise ValueError("Needs.answer_scoring scores the gold answers: it needs gold_answers=True too")
        unknown = [n for n in self.inputs if n not in {f.name for f in fields(CreditInputs)}]
        if unknown:
            raise ValueError(f"Needs.inputs names unknown CreditInputs fields: {', '.join(unknown)}")


LAYOUT_FIELDS = ("group_id_B", "em_B", "seg_start_S", "seg_action_len_S", "seg_traj_S", "seg_kind_S",
                  "seg_id_N", "demo_mask_N")
# Read from the batch too when it has them: what the environment showed (GiGPO's anchor states).
CONTENT_FIELDS = ("tokens_N", "seg_obs_len_S", "seg_obs_key_S")


@dataclass
class CreditInputs:
    """Everything an estimator may read; the judge / model outputs are optional.

    Layout tensors follow ``fastcredit.rollout.trajectory.TrajectoryBatch``. Per-turn
    judge outputs are ignored where the method does not use them (e.g. critic labels
    of non-search turns, CW-GRPO scores of final turns or of failed trajectories), so
    they may hold anything there, NaN included.
    """

    reward_B: torch.Tensor  # float [B] outcome reward r_i (fastcredit.credit.rewards)
    group_id_B: torch.Tensor  # int64 [B] prompt group
    em_B: torch.Tensor  # float [B] exact match (0/1); the critic's fallback label
    seg_start_S: torch.Tensor  # int64 [S] packed offset of the turn's first token
    seg_action_len_S: torch.Tensor  # int64 [S] action tokens of the turn
    seg_traj_S: torch.Tensor  # int64 [S] trajectory of the turn (non-decreasing)
    seg_kind_S: torch.Tensor  # int8 [S] SEARCH / ANSWER / INVALID / TRUNCATED
    seg_id_N: torch.Tensor  # int32 [N] turn of an action token, -1 on observation tokens
    demo_mask_N: Optional[torch.Tensor] = None  # bool [N] ProCeedRL refined (demonstration) tokens
    tokens_N: Optional[torch.Tensor] = None  # int [N] response token ids (GiGPO reads the observations')
    seg_obs_len_S: Optional[torch.Tensor] = None  # int64 [S] observation tokens after the turn's action
    seg_obs_key_S: Optional[torch.Tensor] = None  # int64 [S] 63-bit hash of those observation tokens
    critic_label_S: Optional[torch.Tensor] = None  # float [S] CriticSearch r^a: 1 Good, 0 Bad (search turns)
    critic_ok_B: Optional[torch.Tensor] = None  # bool [B] the critic's answer parsed after the retries
    judge_u_S: Optional[torch.Tensor] = None  # float [S] CW-GRPO retrieval utility u (non-final rounds)
    judge_v_S: Optional[torch.Tensor] = None  # float [S] CW-GRPO reasoning correctness v
    judge_ok_B: Optional[torch.Tensor] = None  # bool [B] the CW-GRPO judge answered for every round
    prm_f0_B: Optional[torch.Tensor] = None  # float [B] PiCA f(0): success probability from the question
    prm_f_S: Optional[torch.Tensor] = None  # float [S] PiCA f(t) after turn t
    prm_hazard_S: Optional[torch.Tensor] = None  # float [S] PiCA hazard h_t (pica.step_reward=linear)
    ig_S: Optional[torch.Tensor] = None  # float [S] IG-Search information gain of a search turn; NaN: not scored
    seg_query_start_S: Optional[torch.Tensor] = None  # int64 [S] offset of the query's first token in the action
    seg_query_len_S: Optional[torch.Tensor] = None  # int64 [S] |Q|: tokens between <search> and </search> (0: none)
    values_N: Optional[torch.Tensor] = None  # float [N] V of the state each token is generated in
    old_logp_N: Optional[torch.Tensor] = None  # float [N] behaviour-policy log-probs (KL in reward)
    ref_logp_N: Optional[torch.Tensor] = None  # float [N] reference-policy log-probs (KL in reward)
    # Sums a tensor over the data-parallel ranks, each holding its share of the batch, for batch-wide statistics
    # (credit.whiten_advantages); None: this process holds the whole batch. A plain function: no process groups here.
    sum_over_ranks: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    @property
    def B(self) -> int:
        return int(self.reward_B.numel())

    @property
    def S(self) -> int:
        return int(self.seg_traj_S.numel())

    @property
    def N(self) -> int:
        return int(self.seg_id_N.numel())

    @classmethod
    def from_batch(cls, batch, reward_B, **extra) -> "CreditInputs":
        """Inputs from a ``TrajectoryBatch`` (read by attribute name) plus judge / model tensors.

        The layout must be there; the content fields (tokens, observation lengths) are taken when the
        batch has them."""
        layout = {name: getattr(batch, name) for name in LAYOUT_FIELDS}
        content = {name: getattr(batch, name) for name in CONTENT_FIELDS
                   if name not in extra and getattr(batch, name, None) is not None}
        return cls(reward_B=torch.as_tensor(reward_B, dtype=torch.float32), **layout, **content, **extra)

    def require(self, *names: str, who: str) -> None:
        """Raise a ValueError naming every missing input of estimator ``who``."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"estimator {who!r} needs {', '.join(missing)} in its CreditInputs")

    def validate(self) -> None:
        """Check the shapes of every given tensor against B, S and N."""
        sizes = {"B": self.B, "S": self.S, "N": self.N}
        for f in fields(self):
            t, suffix = getattr(self, f.name), f.name.rsplit("_", 1)[1]
            if t is None or suffix not in sizes:
                continue
            want = sizes[suffix]
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != want:
                shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"CreditInputs.{f.name} must have shape [{want}], got {shape}")
        if self.S and bool((self.seg_traj_S[1:] < self.seg_traj_S[:-1]).any()):
            raise ValueError("CreditInputs.seg_traj_S must be non-decreasing (turns trajectory-major)")


@dataclass
class CreditResult:
    """What an estimator returns.

    Exactly one of ``adv_S`` (one advantage per turn; the loss gathers it through
    ``seg_id_N``, so no per-token tensor is written) and ``adv_N`` (per token, 0 on
    observation tokens) is set. Tensors are float32, computed in float64.
    """

    adv_S: Optional[torch.Tensor] = None  # float32 [S]
    adv_N: Optional[torch.Tensor] = None  # float32 [N]
    returns_N: Optional[torch.Tensor] = None  # float32 [N] value targets (ppo, pica); 0 on observations
    weight_N: Optional[torch.Tensor] = None  # float32 [N] static per-token loss weight; None: all 1
    loss_mask_N: Optional[torch.Tensor] = None  # bool [N] tokens that count in the loss; None: action tokens
    phi_mask_N: Optional[torch.Tensor] = None  # bool [N] tokens the loss weights by CHORD-phi p(1 - p)
    turn_S: dict = field(default_factory=dict)  # per-turn intermediates for logging / tests (float64)
    metrics: dict = field(default_factory=dict)  # name -> float, for logging

    def token_advantages(self, seg_id_N: torch.Tensor) -> torch.Tensor:
        """float32 ``[N]`` advantages (0 on observation tokens), for logging and tests."""
        if self.adv_N is not None:
            return self.adv_N
        return gather_turns(self.adv_S.to(torch.float32), seg_id_N)


def as_result_tensor(x: torch.Tensor) -> torch.Tensor:
    """Estimators compute in float64 and hand float32 to the loss."""
    return x.to(torch.float32)
