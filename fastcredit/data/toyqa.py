"""The toy world's questions: the relation schema, question generation, and a question's gold hops.

Each fact of the world is a typed relation (``RELATIONS``: how a passage states it and the
gold sub-query that finds it); a question follows a chain of 1 to 3 relations from a named
entity (``QUESTIONS``). Every question carries its hops, each with its gold sub-query,
sub-answer and the passages that state its fact. What reads them lives here too: the
oracle trajectory (``oracle_actions``), which gold facts a search found (``hops_found``; per
turn, ``new_hop_turns``: PiCA's pivot labels, the oracle judges' and the credit-accuracy
metrics' ground truth), fact recall, and parsing facts back out of passage text. World
generation and its files: ``fastcredit.data.toyworld``.
"""
from __future__ import annotations

import random
import re
from typing import Iterable, NamedTuple, Optional, Union

from fastcredit.data.loaders import QAExample


class Relation(NamedTuple):
    subject: str  # entity type
    object: str
    sentence: str  # how a passage states it
    query: str  # the gold sub-query that finds it


RELATIONS = {
    "born_in": Relation("person", "city", "{s} was born in {o}.", "{s} place of birth"),
    "studied_at": Relation("person", "university", "{s} studied at {o}.", "{s} university"),
    "spouse": Relation("person", "person", "{s} is married to {o}.", "{s} spouse"),
    "country": Relation("city", "country", "{s} is a city in {o}.", "{s} country"),
    "capital": Relation("country", "city", "The capital of {s} is {o}.", "{s} capital"),
    "located_in": Relation("university", "city", "{s} is located in {o}.", "{s} location"),
    "founded_by": Relation("company", "person", "{s} was founded by {o}.", "{s} founder"),
    "headquartered_in": Relation("company", "city", "{s} has its headquarters in {o}.", "{s} headquarters"),
    "lead_singer": Relation("band", "person", "The lead singer of {s} is {o}.", "{s} lead singer"),
    "formed_in": Relation("band", "city", "{s} was formed in {o}.", "{s} formed in"),
    # the lookup world's one relation (fastcredit.data.lookup): no chain question follows it
    "code": Relation("entity", "code", "{s} has the code {o}.", "{s} code"),
}

# (relation chain, question). The chain starts at the entity named {x}; its end is the answer.
QUESTIONS = (
    (("born_in",), "Where was {x} born?"),
    (("studied_at",), "Which university did {x} attend?"),
    (("spouse",), "Who is {x} married to?"),
    (("country",), "Which country is {x} in?"),
    (("capital",), "What is the capital of {x}?"),
    (("located_in",), "In which city is {x} located?"),
    (("founded_by",), "Who founded {x}?"),
    (("headquartered_in",), "Where does {x} have its headquarters?"),
    (("lead_singer",), "Who is the lead singer of {x}?"),
    (("formed_in",), "In which city was {x} formed?"),
    (("born_in", "country"), "In which country was {x} born?"),
    (("studied_at", "located_in"), "In which city is the university that {x} attended?"),
    (("spouse", "born_in"), "Where was the spouse of {x} born?"),
    (("spouse", "studied_at"), "Which university did the spouse of {x} attend?"),
    (("located_in", "country"), "In which country is {x} located?"),
    (("founded_by", "born_in"), "Where was the founder of {x} born?"),
    (("founded_by", "studied_at"), "Which university did the founder of {x} attend?"),
    (("headquartered_in", "country"), "In which country does {x} have its headquarters?"),
    (("lead_singer", "born_in"), "Where was the lead singer of {x} born?"),
    (("formed_in", "country"), "In which country was {x} formed?"),
    (("born_in", "country", "capital"), "What is the capital of the country where {x} was born?"),
    (("founded_by", "born_in", "country"), "In which country was the founder of {x} born?"),
    (("headquartered_in", "country", "capital"),
     "What is the capital of the country where {x} has its headquarters?"),
    (("lead_singer", "born_in", "country"), "In which country was the lead singer of {x} born?"),
    (("lead_singer", "studied_at", "located_in"),
     "In which city is the university attended by the lead singer of {x}?"),
    (("spouse", "born_in", "country"), "In which country was the spouse of {x} born?"),
    (("studied_at", "located_in", "country"), "In which country is the university that {x} attended?"),
)


def _walk(ents: dict, facts: dict, start: str, chain: tuple) -> list:
    """The hop records of ``chain`` from ``start`` (which ``_reaches`` its end)."""
    hops, cur = [], start
    for rel in chain:
        nxt = ents[cur]["relations"][rel]
        hops.append({"query": RELATIONS[rel].query.format(s=cur), "answer": nxt, "aliases": list(ents[nxt]["aliases"]),
                     "subject": cur, "relation": rel, "passage_ids": list(facts[f"{cur}|{rel}"])})
        cur = nxt
    return hops


def _reaches(ents: dict, start: str, chain: tuple) -> bool:
    """Whether every relation of ``chain`` exists from ``start`` (not everyone is married)."""
    cur = start
    for rel in chain:
        cur = ents[cur]["relations"].get(rel)
        if cur is None:
            return False
    return True


def make_questions(cfg, ents: dict, facts: dict, rng: random.Random) -> list:
    """``(question, gold answers, hops)`` for ``cfg.num_questions`` distinct questions (``cfg``: a ToyWorldConfig)."""
    by_type = {t: [n for n, e in ents.items() if e["type"] == t] for t in {r.subject for r in RELATIONS.values()}}
    # Every askable (template, subject) pair, shuffled per hop count: drawing without
    # replacement keeps questions distinct and fails at once when too few exist.
    pools = {}
    for h in range(cfg.min_hops, cfg.max_hops + 1):
        pool = [(chain, template, x) for chain, template in QUESTIONS if len(chain) == h
                for x in by_type[RELATIONS[chain[0]].subject] if _reaches(ents, x, chain)]
        rng.shuffle(pool)
        pools[h] = pool
    available = sum(len(p) for p in pools.values())
    if available < cfg.num_questions:
        raise ValueError(f"the world is too small for {cfg.num_questions} distinct questions "
                         f"(it has {available}); add entities or ask for fewer questions")
    out = []
    for _ in range(cfg.num_questions):
        # Hop count first, uniformly among those left: questions spread evenly over min_hops..max_hops.
        chain, template, x = pools[rng.choice([h for h, p in pools.items() if p])].pop()
        hops = _walk(ents, facts, x, chain)
        answer = hops[-1]["answer"]
        out.append((template.format(x=x), [answer] + ents[answer]["aliases"], hops))
    return out


def question_hops(question: Union[QAExample, dict]) -> list:
    """The gold hop records of a question (``metadata.hops``), empty when it has none."""
    metadata = question.metadata if isinstance(question, QAExample) else question.get("metadata") or {}
    return metadata.get("hops") or []


def gold_fact_passages(question: Union[QAExample, dict]) -> list[set[str]]:
    """For each gold hop, the ids of the passages stating its fact (any one of them suffices)."""
    return [set(map(str, h["passage_ids"])) for h in question_hops(question)]


def fact_sentence(hop: dict) -> str:
    """The sentence in which a passage states ``hop``'s fact (``"X was founded by Y."``)."""
    return RELATIONS[hop["relation"]].sentence.format(s=hop["subject"], o=hop["answer"])


def oracle_actions(question: Union[QAExample, dict], rng: Optional[random.Random] = None,
                   detour: Optional[tuple[int, str]] = None) -> list[tuple[str, Optional[str]]]:
    """``(action text, query)`` per turn of the oracle trajectory: each gold hop's sub-query, then the answer.

    The answer turn's query is None. Each think first quotes the fact the last observation
    gave (``<think> X was founded by Y. I need to find Y university.</think>``), as a
    search agent that reads before it acts does. For a small policy this turns every
    entity it must write into a copy of a span it has just read: the quoted sentence is
    in the observation, and the next query or answer is in the quoted sentence. With
    ``rng`` the think also restates the search 0 to 3 times, so turns vary in length.
    Tag contents are space-padded as in Search-R1's prompt (``<search> query </search>``),
    so an entity has the same tokens inside a tag as in the question and the passages.

    ``detour=(hop index, wrong query)``: a detour demonstration (``fastcredit.data.detours``).
    Before that hop's search the trajectory searches ``wrong query`` (a twin's or another
    relation's sub-query, whose results lack the hop's fact), then says so and searches
    again: ``<think> X founder is not X headquarters. I need to find X headquarters.</think>``.
    """
    hops = question_hops(question)
    golds = question.golden_answers if isinstance(question, QAExample) else question["golden_answers"]
    if detour is not None and not 0 <= detour[0] < len(hops):
        raise ValueError(f"detour at hop {detour[0]}: the question has {len(hops)} hop(s)")
    out, read = [], ""
    for k, hop in enumerate(hops):
        query = hop["query"]
        again = " I search for it." * (rng.randint(0, 3) if rng is not None else 0)
        if detour is not None and detour[0] == k:
            wrong = detour[1]
            out.append((f"<think>{read} I need to find {wrong}.{again}</think>\n<search> {wrong} </search>", wrong))
            read, again = f" {wrong} is not {query}.", ""
        out.append((f"<think>{read} I need to find {query}.{again}</think>\n<search> {query} </search>", query))
        read = " " + fact_sentence(hop)
    out.append((f"<think>{read} The answer is {golds[0]}.</think>\n<answer> {golds[0]} </answer>", None))
    return out


def hops_found(question: Union[QAExample, dict], retrieved_ids: Iterable) -> list[bool]:
    """For each gold hop: is one of its fact's passages among ``retrieved_ids``?"""
    got = set(map(str, retrieved_ids))
    return [not ids.isdisjoint(got) for ids in gold_fact_passages(question)]


def new_hop_turns(question: Union[QAExample, dict], retrieved: Iterable[Iterable]) -> list[bool]:
    """Per turn (``retrieved``: each turn's retrieved passage ids, in order): did it retrieve a gold passage of a
    hop no earlier turn had found? The ground truth of a good search (the oracle judges, the credit-accuracy
    metrics)."""
    seen: list = []
    found, out = 0, []
    for ids in retrieved:
        seen += list(ids)
        now = sum(hops_found(question, seen))
        out.append(now > found)
        found = now
    return out


def fact_recall(question: Union[QAExample, dict], retrieved_ids: Iterable) -> float:
    """Share of the question's gold facts retrieved so far (0 to 1); needs hop labels."""
    found = hops_found(question, retrieved_ids)
    if not found:
        raise ValueError("the question has no hop labels (metadata.hops); fact recall needs the toy world")
    return sum(found) / len(found)


def _fact_patterns() -> list[tuple[str, re.Pattern]]:
    def pattern(sentence: str) -> re.Pattern:
        body = re.escape(sentence).replace(re.escape("{s}"), "(?P<s>.+?)").replace(re.escape("{o}"), "(?P<o>.+?)")
        return re.compile(body)

    return [(rel, pattern(r.sentence)) for rel, r in RELATIONS.items()]


_FACT_PATTERNS = _fact_patterns()


def parse_facts(text: str) -> list[tuple[str, str, str]]:
    """The ``(subject, relation, object)`` facts a passage's text states, read back from its sentences."""
    out = []
    for sentence in re.split(r"(?<=\.) ", text):
        for rel, pat in _FACT_PATTERNS:
            m = pat.fullmatch(sentence)
            if m:
                out.append((m.group("s"), rel, m.group("o")))
    return out
