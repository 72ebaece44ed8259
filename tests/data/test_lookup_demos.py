"""The lookup world's demonstrator (fastcredit.data.lookup_demos): its mistakes, its budget, and what it reads."""
import random

import pytest

from fastcredit.config import ToyWorldConfig
from fastcredit.config.toy import LookupWorldConfig
from fastcredit.credit.rewards import exact_match, format_ok_actions
from fastcredit.data import toyworld
from fastcredit.data.lookup import gold_query, search_labels, surname_query, turn_budget
from fastcredit.data.lookup_demos import (CARELESS, OFF, OK, REPEAT, demo_queries, lookup_actions, passage_reader,
                                          plan_lookup_demos)
from fastcredit.data.toyqa import question_hops


@pytest.fixture(scope="module")
def world():
    cfg = ToyWorldConfig(kind="lookup", seed=5, num_questions=60, test_fraction=0.1,
                         lookup=LookupWorldConfig(entities=60, test_entities=20, min_k=3, max_k=3, slack=1))
    return toyworld.generate_world(cfg)


def exact_retriever(world):
    """Top-1 retrieval that is never wrong: a query's entity if it names one, else the first namesake of a
    surname-only query's surname (the decoy where the world orders it first)."""
    by_query = {gold_query(n): world.facts[f"{n}|code"] for n in world.entities}

    def retrieve(query: str) -> list:
        if query in by_query:
            return by_query[query]
        surname = query[: -len(" code")]
        namesakes = sorted(n for n in world.entities if n.split(" ")[1] == surname)
        return world.facts[f"{namesakes[0]}|code"]

    return retrieve


def run(world, ex, plan):
    retrieve = exact_retriever(world)
    actions = lookup_actions(ex, plan, retrieve, passage_reader(world))
    retrieved = [retrieve(q) if q is not None else [] for _, q in actions]
    return actions, retrieved


def test_the_right_searches_answer_every_code_in_order(world):
    ex = world.train[0]
    actions, retrieved = run(world, ex, [(OK, "")] * 4)
    hops = question_hops(ex)
    assert [q for _, q in actions] == [h["query"] for h in hops] + [None]
    assert format_ok_actions([a for a, _ in actions])
    assert exact_match(actions[-1][0].split("<answer>")[1].split("</answer>")[0], ex.golden_answers) == 1.0
    assert search_labels(ex, retrieved) == ["good"] * 3 + ["wasted"]  # the answer turn retrieves nothing
    assert actions[1][0].startswith(f"<think> {hops[0]['subject']} has the code {hops[0]['answer']}. Found "
                                    f"{hops[0]['answer']}. I need to find #2 {hops[1]['query']}.</think>")


def test_a_waste_spends_the_spare_search_and_the_answer_still_comes(world):
    ex = world.train[1]
    other = next(n for n in world.entities if world.entities[n]["split"] == "train" and n not in ex.question)
    for kind in (REPEAT, OFF):
        actions, retrieved = run(world, ex, [(OK, other), (kind, other), (kind, other), (OK, other)])
        labels = search_labels(ex, retrieved[:-1])
        assert labels == ["good", "wasted", "good", "good"], kind  # the second waste finds no spare search
        assert len(actions) == turn_budget(ex)
        assert exact_match(actions[-1][0].split("<answer>")[1].split("</answer>")[0], ex.golden_answers) == 1.0
    actions, _ = run(world, ex, [(OK, other), (REPEAT, other), (OK, other), (OK, other)])
    assert actions[1][1] == actions[0][1] and "#1 " in actions[1][0]  # a repeat names the entity it found
    actions, _ = run(world, ex, [(OK, other), (OFF, other), (OK, other), (OK, other)])
    assert actions[1][1] == gold_query(other) and "I need to find " + gold_query(other) in actions[1][0]


def first_namesake(world, name: str) -> str:
    return sorted(n for n in world.entities if n.split(" ")[1] == name.split(" ")[1])[0]


def test_a_careless_query_takes_the_code_it_reads(world):
    # the retriever puts the surname's first entity first: one where that is a namesake, one where it is the entity
    wrong = next(e for e in world.train if first_namesake(world, question_hops(e)[0]["subject"])
                 != question_hops(e)[0]["subject"])
    actions, retrieved = run(world, wrong, [(CARELESS, ""), (OK, ""), (OK, ""), (OK, "")])
    first = question_hops(wrong)[0]
    assert actions[0][1] == surname_query(first["subject"]) and "#1 " + surname_query(first["subject"]) in \
        actions[0][0]
    name, code = passage_reader(world)(retrieved[0][0])
    answer = actions[-1][0].split("<answer>")[1].split("</answer>")[0].strip()
    assert name != first["subject"] and search_labels(wrong, retrieved)[0] == "harmful"
    assert answer.split(", ")[0] == code and exact_match(answer, wrong.golden_answers) == 0.0
    assert len(actions) == 4  # no search spent on it again
    lucky = next(e for e in world.train if first_namesake(world, question_hops(e)[0]["subject"])
                 == question_hops(e)[0]["subject"])
    actions, retrieved = run(world, lucky, [(CARELESS, ""), (OK, ""), (OK, ""), (OK, "")])
    answer = actions[-1][0].split("<answer>")[1].split("</answer>")[0].strip()
    assert search_labels(lucky, retrieved)[0] == "good" and exact_match(answer, lucky.golden_answers) == 1.0


def test_plans_are_seeded_and_their_queries_cover_every_search(world):
    pool = sorted(n for n, e in world.entities.items() if e["split"] == "train" and "decoy_of" not in e)
    plans = plan_lookup_demos(world.train, pool, 0.3, 0.2, random.Random(1))
    assert plans == plan_lookup_demos(world.train, pool, 0.3, 0.2, random.Random(1))
    kinds = [k for plan in plans.values() for k, _ in plan]
    assert {OK, REPEAT, OFF, CARELESS} <= set(kinds)
    assert 0.1 < kinds.count(CARELESS) / len(kinds) < 0.3
    queries = set(demo_queries(world.train, plans))
    for ex in world.train:
        assert len(plans[ex.id]) == turn_budget(ex) - 1
        actions = lookup_actions(ex, plans[ex.id], exact_retriever(world), passage_reader(world))
        assert {q for _, q in actions if q is not None} <= queries
        for kind, other in plans[ex.id]:
            assert other not in ex.question
    # a repeat before anything is found searches the off-question entity: that query is planned too
    ex = world.train[0]
    other = next(n for n in world.entities if n not in ex.question and "decoy_of" not in world.entities[n])
    plan = [(REPEAT, other), (OK, ""), (OK, ""), (OK, "")]
    actions = lookup_actions(ex, plan, exact_retriever(world), passage_reader(world))
    assert actions[0][1] == gold_query(other) in demo_queries([ex], {ex.id: plan})
    with pytest.raises(ValueError, match="add up to more than 1"):
        plan_lookup_demos(world.train, pool, 0.6, 0.5, random.Random(1))
