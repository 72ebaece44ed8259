"""The vectorised segment helpers: group statistics, reward placement, and the discounted scan."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastcredit.credit import segments
from fastcredit.credit.reference import group_advantage_reference
from fastcredit.credit.segments import (
    action_positions_last_first,
    add_prev_in_row_,
    degenerate_groups,
    discounted_prefix_sum_,
    discounted_suffix_sum,
    group_advantage,
    next_in_row,
    turn_last_action,
    turn_layout,
    whiten,
)


def _scan_loop(x, rows, c):
    """y_k = x_k + c·y_{k+1} inside a row, the GAE recursion, in float64."""
    y = [0.0] * len(x)
    for k in reversed(range(len(x))):
        carry = y[k + 1] if k + 1 < len(x) and rows[k + 1] == rows[k] else 0.0
        y[k] = x[k] + c * carry
    return torch.tensor(y, dtype=torch.float64)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.sampled_from([0.0, 1e-3, 0.3, 0.9, 0.999, 1.0]),
       st.integers(0, 2**31 - 1))
def test_discounted_suffix_sum_matches_the_recursion(lengths, c, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.repeat_interleave(torch.arange(len(lengths)) * 2, torch.tensor(lengths))  # ids skip
    x = torch.randn(rows.numel(), generator=gen, dtype=torch.float64)
    expect = _scan_loop(x.tolist(), rows.tolist(), c)
    assert torch.allclose(discounted_suffix_sum(x, torch.tensor(lengths), c), expect, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("c", [0.5, 0.95, 0.99, 0.999, 1.0])
def test_discounted_suffix_sum_long_rows_do_not_overflow(c):
    """20,000-token rows: c^(-k) alone would overflow float64 for c ≤ 0.95 (k ≈ 14,000)."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([20_000, 7, 15_000, 1])
    rows = torch.repeat_interleave(torch.arange(4), lengths)
    x = torch.randn(rows.numel(), generator=gen, dtype=torch.float64)
    x[torch.rand(rows.numel(), generator=gen) < 0.01] *= 1e3  # a few large rewards
    y = discounted_suffix_sum(x, lengths, c)
    assert torch.isfinite(y).all()
    assert torch.allclose(y, _scan_loop(x.tolist(), rows.tolist(), c), rtol=1e-6, atol=1e-6)


@settings(max_examples=120, deadline=None)
@given(st.lists(st.integers(0, 150), min_size=1, max_size=10), st.sampled_from([1e-3, 0.3, 0.7, 0.99, 1.0]),
       st.sampled_from([2, 3, 5, 64]), st.integers(0, 2**31 - 1))
def test_small_chunks_cut_rows_every_way(lengths, c, chunk, seed):
    """Chunks of 2-5 elements (so the chunk-level scan recurses several levels) and scales capped at
    e^30: rows that start, end, span and restart inside and across chunks, several starts in one
    chunk, and empty rows, all against the recursion."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    x = torch.randn(rows.numel(), generator=gen, dtype=torch.float64)
    expect = _scan_loop(x.tolist(), rows.tolist(), c)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(segments, "_SCALE_LOG_LIMIT", 30.0)
        mp.setattr(segments, "_CHUNK", chunk)
        got = discounted_suffix_sum(x, torch.tensor(lengths), c)
    assert torch.allclose(got, expect, rtol=1e-9, atol=1e-9)


def test_a_discount_below_1e_minus_50_adds_the_one_step_term():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    got = discounted_suffix_sum(x * 1e60, torch.tensor([3, 1]), 1e-60)
    assert torch.allclose(got, torch.tensor([1e60 + 2.0, 2e60 + 3.0, 3e60, 4e60], dtype=torch.float64),
                          rtol=1e-15, atol=0)


def test_discounted_suffix_sum_rejects_a_discount_above_one_and_rows_that_do_not_tile():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        discounted_suffix_sum(torch.ones(3), torch.tensor([3]), 1.5)
    with pytest.raises(ValueError, match="row lengths sum to 4, the stream has 3 elements"):
        discounted_suffix_sum(torch.ones(3), torch.tensor([1, 3]), 0.9)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from([0.0, 0.2, 0.8, 1.0])), min_size=1, max_size=40),
       st.booleans(), st.sampled_from([1e-6, 0.1]))
def test_group_advantage_matches_reference(members, norm, eps):
    groups = torch.tensor([g * 7 for g, _ in members])
    rewards = torch.tensor([r for _, r in members])
    expect = group_advantage_reference(rewards.tolist(), groups.tolist(), norm, eps)
    assert torch.allclose(group_advantage(rewards, groups, norm, eps), torch.tensor(expect, dtype=torch.float64),
                          atol=1e-9)


def test_group_advantage_hand_worked():
    # Group 0: r = (1, 0, 0, 1): mean 0.5, unbiased std = sqrt(4 · 0.25 / 3) = 0.5773503.
    #   Â = ±0.5 / (0.5773503 + 1e-6) = ±0.8660239.
    # Group 9: a single sample: Â = 0. Group 4: (0.2, 0.2): std 0, Â = 0 / (0 + ε) = 0.
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.7, 0.2, 0.2])
    g = torch.tensor([0, 0, 0, 0, 9, 4, 4])
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert torch.allclose(group_advantage(r, g), torch.tensor([a, -a, -a, a, 0, 0, 0], dtype=torch.float64))
    # Dr. GRPO (norm_by_std=False): r − mean.
    assert torch.allclose(group_advantage(r, g, norm_by_std=False),
                          torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0], dtype=torch.float64))
    assert degenerate_groups(r, g).tolist() == [False] * 4 + [True] * 3


def test_turn_layout_and_reward_positions():
    # Trajectory 0: turns with 2, 0, 3 action tokens; trajectory 1: 0 then 1; trajectory 2: one empty turn.
    alen = torch.tensor([2, 0, 3, 0, 1, 0])
    traj = torch.tensor([0, 0, 0, 1, 1, 2])
    T, first, t, final = turn_layout(traj, 3)
    assert T.tolist() == [3, 2, 1] and first.tolist() == [0, 3, 5]
    assert t.tolist() == [1, 2, 3, 1, 2, 1] and final.tolist() == [False, False, True, False, True, True]
    # Action stream: traj 0 holds A = 0..4, traj 1 holds A = 5. An empty turn pays on the
    # nearest earlier action token of its trajectory; none there: -1.
    assert turn_last_action(alen, traj, 3).tolist() == [1, 1, 4, -1, 5, -1]


def test_next_in_row_and_whiten():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert next_in_row(x, torch.tensor([2, 0, 2])).tolist() == [2.0, 0.0, 4.0, 0.0]
    assert next_in_row(x, torch.tensor([4])).tolist() == [2.0, 3.0, 4.0, 0.0]
    # Per-turn values with weights (token counts) whiten like their per-token broadcast.
    turn = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    counts = torch.tensor([2, 3, 1])
    tokens = torch.repeat_interleave(turn, counts)
    expect = (tokens - tokens.mean()) / torch.sqrt(tokens.var() + 1e-8)
    assert torch.allclose(torch.repeat_interleave(whiten(turn, counts), counts), expect)


def test_action_positions_last_first_matches_the_mask():
    # Turns (start, action length): actions at 0-1, none, 5-7, none at the end of one trajectory, 9.
    start = torch.tensor([0, 3, 5, 8, 9])
    alen = torch.tensor([2, 0, 3, 0, 1])
    mask = torch.zeros(12, dtype=torch.bool)
    for s0, n in zip(start.tolist(), alen.tolist()):
        mask[s0:s0 + n] = True
    assert action_positions_last_first(start, alen).tolist() == torch.nonzero(mask).flatten().flip(0).tolist()
    assert action_positions_last_first(start, alen).tolist() == [9, 7, 6, 5, 1, 0]
    assert action_positions_last_first(torch.tensor([0, 4]), torch.tensor([0, 0])).numel() == 0


def test_add_prev_in_row_leaves_row_starts_bit_exact():
    out = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5], dtype=torch.float64)
    x = torch.tensor([1e8, 2.0, 3.0, 1e-9, 5.0], dtype=torch.float64)
    add_prev_in_row_(out, x, torch.tensor([2, 0, 1, 2]), 0.5)
    # Rows [0, 1], [2], [3, 4]: only elements 1 and 4 receive 0.5 * their predecessor.
    assert out.tolist() == [0.1, 0.2 + 0.5e8, 0.3, 0.4, 0.5 + 0.5e-9]


def test_prefix_scan_in_place_is_the_reversed_suffix_scan():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(50, dtype=torch.float64, generator=gen)
    rows = torch.tensor([7, 0, 20, 23])
    z = x.flip(0).contiguous()
    got = discounted_prefix_sum_(z, rows.flip(0), 0.9)
    assert got is z
    assert torch.equal(got.flip(0), discounted_suffix_sum(x, rows, 0.9))
    with pytest.raises(ValueError, match="contiguous float64"):
        discounted_prefix_sum_(x.to(torch.float32), rows, 0.9)


def test_scratch_buffers_are_reused_per_tag_and_thread():
    import threading

    a = segments.scratch("t", 100, torch.float64, "cpu")
    b = segments.scratch("t", 60, torch.float64, "cpu")
    assert b.numel() == 60 and b.data_ptr() == a.data_ptr()  # kept between calls
    assert segments.scratch("u", 60, torch.float64, "cpu").data_ptr() != a.data_ptr()  # one per tag
    assert segments.scratch("t", 60, torch.float32, "cpu").data_ptr() != a.data_ptr()  # and per dtype
    grown = segments.scratch("t", 1000, torch.float64, "cpu")
    assert grown.numel() == 1000
    seen = []
    worker = threading.Thread(target=lambda: seen.append(segments.scratch("t", 1000, torch.float64, "cpu").data_ptr()))
    worker.start()
    worker.join()
    assert seen[0] != grown.data_ptr()  # another thread never shares a buffer
