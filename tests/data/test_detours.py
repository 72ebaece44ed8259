"""Detour demonstrations: the wrong search, the miss named, the right search; only detours that really miss."""
import random

import pytest

from fastcredit.data.detours import choose_detours, detour_queries, plan_detours, planned_queries, twin_map
from fastcredit.data.loaders import QAExample
from fastcredit.data.toyqa import RELATIONS, gold_fact_passages, hops_found, new_hop_turns, oracle_actions
from fastcredit.data.toyworld import ToyWorldConfig, generate_world

SMALL = dict(num_people=60, num_cities=15, num_countries=5, num_universities=6, num_companies=20, num_bands=10,
             num_questions=80, twin_fraction=0.6, min_hops=2, max_hops=3)

HOPS = [{"query": "Kelmar Lebs university", "subject": "Kelmar Lebs", "relation": "studied_at", "answer": "Dovu Tech",
         "passage_ids": ["3"]},
        {"query": "Dovu Tech location", "subject": "Dovu Tech", "relation": "located_in", "answer": "Ostra",
         "passage_ids": ["7"]}]
Q = QAExample("q1", "In which city is the university that Kelmar Lebs attended?", ["Ostra"], "toyworld",
              {"hops": HOPS})
ENTITIES = {
    "Kelmar Lebs": {"type": "person", "relations": {"studied_at": "Dovu Tech", "born_in": "Ostra"}, "aliases": []},
    "Kalmar Lebs": {"type": "person", "relations": {"studied_at": "Ivo Tech"}, "aliases": [], "twin_of": "Kelmar Lebs"},
    "Dovu Tech": {"type": "university", "relations": {"located_in": "Ostra"}, "aliases": []},
}


def test_a_detour_searches_the_wrong_query_names_the_miss_and_searches_again():
    plain = oracle_actions(Q)
    turns = oracle_actions(Q, detour=(1, "Dovu Tech founder"))
    assert len(turns) == len(plain) + 1
    assert turns[0] == plain[0]  # the hops before the detour are the oracle's
    assert turns[1] == ("<think> Kelmar Lebs studied at Dovu Tech. I need to find Dovu Tech founder.</think>\n"
                        "<search> Dovu Tech founder </search>", "Dovu Tech founder")
    assert turns[2] == ("<think> Dovu Tech founder is not Dovu Tech location. I need to find Dovu Tech location."
                        "</think>\n<search> Dovu Tech location </search>", "Dovu Tech location")
    assert turns[3:] == plain[2:]  # then the answer, as in the plain trajectory
    first = oracle_actions(Q, detour=(0, "Kalmar Lebs university"))
    assert [q for _, q in first] == ["Kalmar Lebs university", "Kelmar Lebs university", "Dovu Tech location", None]
    with pytest.raises(ValueError, match="detour at hop 2: the question has 2 hop"):
        oracle_actions(Q, detour=(2, "x"))


def test_wrong_queries_are_the_twins_then_the_subjects_other_relations():
    assert twin_map(ENTITIES) == {"Kelmar Lebs": ["Kalmar Lebs"], "Kalmar Lebs": ["Kelmar Lebs"]}
    twins = twin_map(ENTITIES)
    assert detour_queries(HOPS[0], ENTITIES, twins) == ["Kalmar Lebs university", "Kelmar Lebs place of birth"]
    assert detour_queries(HOPS[1], ENTITIES, twins) == []  # a university has no twin and one relation
    # after the first hop: the relation asked of the entity just left
    assert detour_queries(HOPS[1], ENTITIES, twins, previous=HOPS[0]) == ["Kelmar Lebs location"]


def test_plans_follow_the_fraction_and_the_seed():
    world = generate_world(ToyWorldConfig(seed=3, **SMALL))
    qs = world.train
    assert plan_detours(qs, world.entities, 0.0, random.Random(0)) == {}
    everything = plan_detours(qs, world.entities, 1.0, random.Random(0))
    twins = twin_map(world.entities)
    hops = lambda q: q.metadata["hops"]  # noqa: E731
    with_candidates = [q for q in qs if any(detour_queries(h, world.entities, twins, hops(q)[k - 1] if k else None)
                                            for k, h in enumerate(hops(q)))]
    assert set(everything) == {q.id for q in with_candidates} and len(everything) > len(qs) // 2
    half = plan_detours(qs, world.entities, 0.5, random.Random(1))
    assert 0.3 * len(everything) < len(half) < 0.7 * len(everything)
    assert half == plan_detours(qs, world.entities, 0.5, random.Random(1))
    assert half != plan_detours(qs, world.entities, 0.5, random.Random(2))
    with pytest.raises(ValueError, match="detour fraction must be in"):
        plan_detours(qs, world.entities, 1.5, random.Random(0))


def test_only_a_detour_that_misses_the_hops_fact_is_taken():
    plan = {"q1": [(0, "Kalmar Lebs university"), (0, "Kelmar Lebs place of birth")]}
    hits = {"Kalmar Lebs university": ["3", "11"], "Kelmar Lebs place of birth": ["12"]}
    # the twin's search found the gold passage anyway: not a detour; the next candidate misses
    assert choose_detours(plan, [Q], hits) == {"q1": (0, "Kelmar Lebs place of birth")}
    assert choose_detours(plan, [Q], {q: ["3"] for q in hits}) == {}  # every candidate finds it: none
    assert choose_detours({}, [Q], hits) == {}


def test_detour_trajectories_on_a_world_waste_one_search_then_find_every_hop():
    """End to end on a generated world, with a searcher that returns the passages stating the query's fact: every
    chosen detour is a search that finds nothing new, and the trajectory still finds every hop and answers."""
    world = generate_world(ToyWorldConfig(seed=4, **SMALL))
    by_query = {RELATIONS[rel].query.format(s=s): ids for key, ids in world.facts.items()
                for s, rel in [key.split("|")]}
    plan = plan_detours(world.train, world.entities, 1.0, random.Random(0))
    hits = {q: by_query.get(q, []) for q in planned_queries(plan)}
    chosen = choose_detours(plan, world.train, hits)
    assert len(chosen) == len(plan)  # a twin's or another relation's fact is never the hop's
    for ex in world.train:
        if ex.id not in chosen:
            continue
        turns = oracle_actions(ex, random.Random(0), detour=chosen[ex.id])
        searched = [by_query.get(q, []) for _, q in turns if q is not None]
        good = new_hop_turns(ex, searched)
        k = chosen[ex.id][0]
        assert good[k] is False and len(good) == len(gold_fact_passages(ex)) + 1  # the detour finds nothing new
        assert good[:k] == new_hop_turns(ex, searched[:k])  # the turns before it are the oracle's
        assert all(hops_found(ex, [i for ids in searched for i in ids]))  # and every hop is found in the end
        assert turns[-1][0].endswith(f"<answer> {ex.golden_answers[0]} </answer>")
