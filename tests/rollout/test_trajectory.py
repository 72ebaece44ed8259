"""The packed trajectory batch: constructors, invariants, select / concat."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastcredit.rollout.trajectory import (
    TrajectoryBatch,
    TrajectoryError,
    Turn,
    TurnKind,
    concat,
    from_turns,
    replace,
    select,
    to_turns,
)


@st.composite
def trajectories(draw, max_traj=6):
    """Random trajectories: 0..5 search/invalid turns, then an answer or truncated turn."""
    out = []
    for _ in range(draw(st.integers(1, max_traj))):
        turns = []
        for _ in range(draw(st.integers(0, 5))):
            a = draw(st.lists(st.integers(0, 999), max_size=6))
            o = draw(st.lists(st.integers(0, 999), max_size=5))
            demo = draw(st.lists(st.integers(0, 1), min_size=len(a), max_size=len(a)))
            turns.append(Turn(a, draw(st.sampled_from(["search", "invalid"])), o, demo))
        last = draw(st.lists(st.integers(0, 999), max_size=6))
        turns.append(Turn(last, draw(st.sampled_from(["answer", "truncated"]))))
        out.append(turns)
    return out


def _outcomes(n):
    return dict(group_id=[i // 2 for i in range(n)], em=[float(i % 2) for i in range(n)],
                f1=[0.5] * n, format_ok=[i % 3 == 0 for i in range(n)], predictions=[f"p{i}" for i in range(n)])


def _same_turns(a, b):
    assert len(a) == len(b)
    for ta, tb in zip(a, b):
        assert len(ta) == len(tb)
        for x, y in zip(ta, tb):
            assert list(x.action_ids) == list(y.action_ids)
            assert list(x.obs_ids) == list(y.obs_ids)
            assert TurnKind.parse(x.kind) == TurnKind.parse(y.kind)
            assert [int(v) for v in (x.demo or [0] * len(x.action_ids))] == [int(v) for v in y.demo]


def test_hand_built_layout():
    b = from_turns([[Turn([1, 2, 3], "search", [9, 9]), Turn([4, 5], "answer")], [Turn([7], "truncated")]])
    assert b.cu_seqlens.tolist() == [0, 7, 8]
    assert b.seg_start_S.tolist() == [0, 5, 7]
    assert b.seg_id_N.tolist() == [0, 0, 0, -1, -1, 1, 1, 2]
    assert b.action_mask_N.tolist() == [True] * 3 + [False] * 2 + [True] * 3
    assert b.turn_index_N.tolist() == [0, 0, 0, 0, 0, 1, 1, 2]
    assert b.turns_per_traj_B.tolist() == [2, 1]
    assert b.seg_is_final_S.tolist() == [False, True, True]
    assert b.last_action_token_S.tolist() == [2, 6, 7]


@settings(max_examples=60)
@given(trajectories())
def test_turns_round_trip(trajs):
    b = from_turns(trajs, **_outcomes(len(trajs)))
    _same_turns(trajs, to_turns(b))
    assert b.num_tokens == sum(len(t.action_ids) + len(t.obs_ids) for tr in trajs for t in tr)
    assert int(b.action_mask_N.sum()) == sum(len(t.action_ids) for tr in trajs for t in tr)


@settings(max_examples=40)
@given(trajectories(), st.data())
def test_select_and_concat(trajs, data):
    b = from_turns(trajs, **_outcomes(len(trajs)))
    idx = data.draw(st.lists(st.integers(0, len(trajs) - 1), max_size=8))
    s = select(b, torch.tensor(idx, dtype=torch.int64))
    _same_turns([trajs[i] for i in idx], to_turns(s))
    assert s.predictions == [b.predictions[i] for i in idx]
    assert s.em_B.tolist() == [b.em_B[i].item() for i in idx]
    c = concat([b, s])
    _same_turns(trajs + [trajs[i] for i in idx], to_turns(c))
    assert c.group_id_B.tolist() == b.group_id_B.tolist() + s.group_id_B.tolist()


def test_empty_batch_and_empty_turns():
    empty = from_turns([])
    assert empty.num_trajectories == 0 and empty.num_tokens == 0
    b = from_turns([[Turn([], "search", [5]), Turn([], "answer")]])
    assert b.seg_id_N.tolist() == [-1]
    assert b.last_action_token_S.tolist() == [-1, -1]


@pytest.mark.parametrize(
    "trajs, message",
    [
        ([[Turn([1], "answer"), Turn([2], "answer")]], "not the last"),
        ([[Turn([1], "search", [3])]], "must end with an answer or a truncated turn"),
        ([[Turn([1], "answer", [3])]], "cannot have an observation"),
        ([[]], "at least one turn"),
        ([[Turn([1, 2], "answer", demo=[1])]], "demo has 1 entries for 2"),
    ],
)
def test_invalid_layouts_name_the_problem(trajs, message):
    with pytest.raises(TrajectoryError, match=message):
        from_turns(trajs)


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown turn kind 'serch'"):
        from_turns([[Turn([1], "serch")]])


def test_direct_construction_checks_every_invariant():
    good = from_turns([[Turn([1, 2], "search", [3]), Turn([4], "answer")], [Turn([5], "truncated")]])
    bad_cases = {
        "seg_id_N": (good.seg_id_N.clone().index_fill_(0, torch.tensor([2]), 0), "seg_id_N\\[2\\]"),
        "seg_start_S": (torch.tensor([0, 4, 4]), "tile their trajectory"),
        "cu_seqlens": (torch.tensor([0, 4, 6], dtype=torch.int32), "cu_seqlens must start at 0 and end"),
        "seg_traj_S": (torch.tensor([0, 1, 1]), "trajectory 0|starts at"),
        "em_B": (torch.zeros(3), "em_B must have shape \\[2\\]"),
        "group_id_B": (torch.zeros(2, dtype=torch.int32), "group_id_B must have dtype torch.int64"),
        "demo_mask_N": (torch.tensor([0, 0, 1, 0, 0], dtype=torch.bool), "demo_mask_N\\[2\\] is set on an observation"),
        "seg_kind_S": (torch.tensor([0, 1, 9], dtype=torch.int8), "TurnKind codes|must end"),
    }
    for name, (value, message) in bad_cases.items():
        with pytest.raises(TrajectoryError, match=message):
            replace(good, **{name: value})


def test_rollout_logp_follows_select():
    b = from_turns([[Turn([1, 2], "answer")], [Turn([3], "answer")]])
    b = replace(b, rollout_logp_N=torch.tensor([-0.1, -0.2, -0.3]))
    assert select(b, torch.tensor([1])).rollout_logp_N.tolist() == pytest.approx([-0.3])
    with pytest.raises(TrajectoryError, match="rollout_logp_N"):
        replace(b, rollout_logp_N=torch.zeros(2))
    assert isinstance(b, TrajectoryBatch)
