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


def test_harmful_searches_are_bad_but_not_wasted():
    labels = [["good", "harmful", "good"],   # g0 success with a harmful search (the careless one found the entity
              ["good", "good"],              # later: a repair)
              ["harmful", "wasted"],         # g1 failure: no good search
              ["good", "harmful"]]           # g1 failure with a good search
    f = trajectory_figures(labels, [True, True, False, False], [0, 0, 1, 1])
    assert f["wasted_search_share"] == pytest.approx(1 / 9) and f["harmful_search_share"] == pytest.approx(3 / 9)
    assert f["successes_with_wasted_search"] == 0.0 and f["successes_with_bad_search"] == pytest.approx(1 / 2)
    assert f["failures_with_good_search"] == pytest.approx(1 / 2)
    assert f["failures_with_harmful_search"] == 1.0 and f["repairs"] == 1


def test_retrieval_controls_count_what_each_query_finds_first():
    from bench.start_figures import retrieval_controls
    from fastcredit.config.toy import LookupWorldConfig
    from fastcredit.data.toyworld import ToyWorldConfig, generate_world

    world = generate_world(ToyWorldConfig(kind="lookup", num_questions=20, lookup=LookupWorldConfig(
        entities=40, test_entities=10, min_k=2, max_k=2)))
    hops = {h["subject"]: h for ex in world.test for h in ex.metadata["hops"]}
    names = sorted(hops)
    # a searcher that finds every gold query but the first name's, and answers careless queries with the decoy for
    # the first two names, the entity for the third, another passage after that
    miss, decoy_first, entity_first = names[0], names[:2], names[2]

    def searcher(queries):
        out = []
        for q in queries:
            name = next((n for n in names if q == f"{n} code"), None)
            if name is not None:
                out.append(([], ["-1"] if name == miss else hops[name]["passage_ids"]))
                continue
            owner = next(n for n in names if q == f"{n.split(' ')[1]} code")
            pid = (hops[owner]["decoy_ids"][0] if owner in decoy_first else
                   hops[owner]["passage_ids"][0] if owner == entity_first else "-1")
            out.append(([], [pid]))
        return out

    got = retrieval_controls(searcher, world.test, 1)
    n = len(names)
    assert got["entities"] == n and got["gold_query_hit_at_1"] == pytest.approx((n - 1) / n)
    assert got["careless_query_decoy_first"] == pytest.approx(2 / n)
    assert got["careless_query_entity_first"] == pytest.approx(1 / n)
    assert got["careless_query_other_first"] == pytest.approx((n - 3) / n)
