"""The lookup world's demonstrator: trajectories with turns of mixed quality, for the warm start.

    plans = plan_lookup_demos(examples, pool, waste=0.15, misquery=0.1, rng=random.Random(0))
    found = dict(zip(queries, searcher(queries)))         # demo_queries(examples, plans), with the run's retriever
    lookup_actions(example, plans[example.id], lambda q: found[q][1], read)   # [(action text, query or None)]

A demonstrator that always searched the right entity would leave a warm-started policy whose sampled
successes hold no bad search and whose failures hold no good one: outcome and turn quality would be
the same thing, and turn-level credit would have nothing to tell apart. This one errs at each search
with a configurable probability (``warmstart.waste_prob``, ``warmstart.misquery_prob``):

* *waste*: it searches an entity it has already found (a repeat) or one the question does not name (a
  training entity drawn at random): the turn is spent, nothing is learnt;
* *mis-query*: it searches the needed entity's surname only (``Gitris code``), and takes the code of
  whatever comes first, the entity or its decoy: a decoy's code costs the answer.

It keeps within the turn budget (a waste is made only while a spare search is left) and reads what
each search really returned with the run's own retriever: a search that found neither the needed
entity nor its decoy is searched again with the entity's full name. Each think quotes the fact just
read and the codes found so far, then names the next search, as the chain world's oracle does
(``fastcredit.data.toyqa.oracle_actions``):

    <think> Sagul Gitris has the code 417. Found 417. I need to find #2 Manos Limom code.</think>
    <search> Manos Limom code </search>

and the last one, before the answer, every code found, then the answer, which repeats them (each list is the one
before it and one code more, copied from the think just before):

    <think> Voter Tadar has the code 953. Found 417, 082, 953. The answer is 417, 082, 953.</think>
"""
from __future__ import annotations

import random
from typing import Callable, Optional, Sequence

from fastcredit.data.loaders import QAExample
from fastcredit.data.lookup import answer_text, gold_query, numbered, surname_query, turn_budget
from fastcredit.data.toyqa import question_hops

OK, REPEAT, OFF, CARELESS = "ok", "repeat", "off", "careless"
# One planned search: (what the demonstrator does, the off-question entity it would search)
Decision = tuple[str, str]
# read(passage id) -> (entity name, code) the passage states
Reader = Callable[[str], tuple[str, str]]


def plan_lookup_demos(examples: Sequence[QAExample], pool: Sequence[str], waste: float, misquery: float,
                      rng: random.Random) -> dict[str, list[Decision]]:
    """Per example id, one decision per search of its budget: a mis-query with probability ``misquery``, else a
    waste with probability ``waste`` (a repeat or an off-question search, even odds), else the right search.
    ``pool``: the entities an off-question search may name (those the question names are skipped)."""
    for name, p in (("waste", waste), ("misquery", misquery)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name} probability must be in [0, 1], got {p}")
    if waste + misquery > 1.0:
        raise ValueError(f"waste ({waste}) and misquery ({misquery}) probabilities add up to more than 1")
    plans = {}
    for ex in examples:
        asked = {h["subject"] for h in question_hops(ex)}
        budget = (turn_budget(ex) or len(asked) + 1) - 1
        decisions = []
        for _ in range(budget):
            u = rng.random()
            kind = CARELESS if u < misquery else (REPEAT if rng.random() < 0.5 else OFF) if u < misquery + waste \
                else OK
            other = rng.choice(pool)
            while other in asked and len(pool) > len(asked):
                other = rng.choice(pool)
            decisions.append((kind, other))
        plans[ex.id] = decisions
    return plans


def demo_queries(examples: Sequence[QAExample], plans: dict[str, list[Decision]]) -> list[str]:
    """Every query a demonstration may search, each once, sorted: each needed entity's full and surname queries and
    each planned off-question search (a planned repeat's too: with nothing found yet it becomes one)."""
    out = set()
    for ex in examples:
        for h in question_hops(ex):
            out.update((gold_query(h["subject"]), surname_query(h["subject"])))
        # a repeat with nothing found yet searches the off-question entity instead
        out.update(gold_query(other) for kind, other in plans.get(ex.id, ()) if kind in (OFF, REPEAT))
    return sorted(out)


def _think(read: str, codes: list, tail: str) -> str:
    found = f" Found {answer_text(codes)}." if codes else ""
    return f"<think>{read}{found} {tail}</think>"


def lookup_actions(example: QAExample, plan: Sequence[Decision], retrieved: Callable[[str], Sequence[str]],
                   read: Reader) -> list[tuple[str, Optional[str]]]:
    """``(action text, query)`` per turn of the demonstration of ``example`` under ``plan``; the answer turn's
    query is None. ``retrieved(query)``: the passage ids the run's retriever returns, best first (the demonstrator
    reads the first); ``read(passage id)``: the entity and code it states."""
    hops = question_hops(example)
    k, searches = len(hops), len(plan)
    codes: list = []
    done: list = []  # the entities whose code was taken, in order
    out, last = [], ""
    for kind, other in plan:
        if len(codes) == k:
            break
        need = hops[len(codes)]
        must = k - len(codes)  # searches still needed, this one included
        left = searches - len(out)
        if kind in (REPEAT, OFF) and left <= must:
            kind = OK  # no spare search left to waste
        if kind == REPEAT and not done:
            kind = OFF
        query = {OK: gold_query(need["subject"]), CARELESS: surname_query(need["subject"]),
                 REPEAT: gold_query(done[-1]) if done else "", OFF: gold_query(other)}[kind]
        ids = list(retrieved(query))
        name, code = read(ids[0]) if ids else ("", "")
        useful = name in (need["subject"], need.get("decoy"))
        if kind == CARELESS and not useful and left <= must:  # no spare search to repeat it with: search it right
            query = gold_query(need["subject"])
            ids = list(retrieved(query))
            name, code = read(ids[0]) if ids else ("", "")
            useful = name in (need["subject"], need.get("decoy"))
        # the think names the entity by its number in the question (an off-question search has none)
        target = {OK: len(codes), CARELESS: len(codes), REPEAT: len(done) - 1, OFF: None}[kind]
        said = query if target is None else numbered(target, query)
        out.append((_think(last, codes, f"I need to find {said}.") + f"\n<search> {query} </search>", query))
        if kind in (OK, CARELESS) and useful:
            codes.append(code)  # a decoy's code too: the careless demonstrator takes what it read
            done.append(need["subject"])
        last = f" {name} has the code {code}." if name else ""
    answer = answer_text(codes)
    out.append((_think(last, codes, f"The answer is {answer}.") + f"\n<answer> {answer} </answer>", None))
    return out


def passage_reader(world) -> Reader:
    """A :data:`Reader` over a loaded toy world (``fastcredit.data.toyworld.load_world``): the fact its passage
    states, read back from the text."""
    from fastcredit.data.toyqa import parse_facts

    def read(pid: str) -> tuple[str, str]:
        facts = [(s, o) for s, rel, o in parse_facts(world.passage(pid).text) if rel == "code"]
        return facts[0] if facts else ("", "")

    return read
