"""bench/start_figures.py: the start figures of hand-labelled trajectories (the run itself: make compare's presets)."""
from __future__ import annotations

import pytest

from bench.start_figures import trajectory_figures


def test_figures_of_hand_labelled_trajectories():
    # per trajectory: its search turns (True good, False wasted), success, group
    labels = [[True, True],          # g0 success, clean
              [False, True, True],   # g0 success, a wasted search repaired
              [True, False],         # g1 failure: a good search, then a wasted one (not a repair)
              [False],               # g1 failure, wasted only
              [], [False, False]]    # g2 failures: no search; two wasted
    success = [True, True, False, False, False, False]
    f = trajectory_figures(labels, success, [0, 0, 1, 1, 2, 2])
    assert f["trajectories"] == 6 and f["groups"] == 3 and f["sampled_em"] == pytest.approx(2 / 6)
    assert f["all_fail_groups"] == pytest.approx(2 / 3) and f["all_success_groups"] == pytest.approx(1 / 3)
    assert f["searches_per_trajectory"] == pytest.approx(10 / 6)
    assert f["wasted_search_share"] == pytest.approx(5 / 10)
    assert f["successes_with_wasted_search"] == pytest.approx(1 / 2)
    assert f["failures_with_good_search"] == pytest.approx(1 / 4)
    assert f["repairs"] == 1 and f["trajectories_with_repair"] == pytest.approx(1 / 6)
    assert f["successes_with_repair"] == pytest.approx(1 / 2)


def test_a_figure_over_no_trajectory_is_none_not_nan():
    f = trajectory_figures([[False]], [False], [0])
    assert f["successes_with_wasted_search"] is None and f["successes_with_repair"] is None
    assert f["failures_with_good_search"] == 0.0 and f["all_fail_groups"] == 1.0
