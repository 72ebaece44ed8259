"""Detour demonstrations for the warm start: oracle trajectories that search the wrong thing, see it, search again.

    plan = plan_detours(examples, world.entities, fraction=0.3, rng=random.Random(0))
    hits = dict(zip(queries, retrieved_ids))             # every planned query searched with the run's retriever
    detours = choose_detours(plan, examples, hits)       # example id -> (hop index, wrong query)
    oracle_actions(example, rng, detour=detours.get(example.id))

The plain oracle trajectory makes exactly one search per hop, so a policy warm-started on it
answers after that many searches whatever they returned: it never repairs a wasted search,
and a wasted search inside a trajectory that still succeeds (what outcome-only GRPO
reinforces and a turn-level critic does not) hardly ever happens. A detour demonstration
(``warmstart.detour_fraction``: that share of the warm start's trajectories) puts one wrong
search before one hop's search, then a think that names the miss, then the right search.
The wrong search is the sub-query of the subject's *twin* (the one-letter-apart entity,
whose passages state the twin's own facts) where the world has one, else the subject's
sub-query for *another of its relations* (a true fact, not the one asked for), else, after the
first hop, the hop's relation asked of the *previous hop's subject* (the entity just left).

A detour counts only if its search really misses: every candidate is searched with the run's
own retriever first, and the first whose results hold none of the hop's gold passages is
taken; a question without one keeps its plain oracle trajectory. The hop and the candidate
order are drawn from ``rng``, so a seed gives the same demonstrations.
"""
from __future__ import annotations

import random
from typing import Mapping, Optional, Sequence

from fastcredit.data.loaders import QAExample
from fastcredit.data.toyqa import RELATIONS, gold_fact_passages, question_hops

# One question's planned detour: candidate (hop index, wrong query) pairs, in the order they are tried.
Plan = dict[str, list[tuple[int, str]]]


def twin_map(entities: Mapping[str, dict]) -> dict[str, list[str]]:
    """Each entity's twins (both directions of the world's ``twin_of``), sorted."""
    out: dict[str, list[str]] = {}
    for name, ent in entities.items():
        original = ent.get("twin_of")
        if original is not None:
            out.setdefault(original, []).append(name)
            out.setdefault(name, []).append(original)
    return {k: sorted(v) for k, v in out.items()}


def detour_queries(hop: dict, entities: Mapping[str, dict], twins: Mapping[str, list[str]],
                   previous: Optional[dict] = None) -> list[str]:
    """The wrong sub-queries a detour at ``hop`` may search: the hop's relation asked of each twin of its subject,
    then each other relation the subject has, asked of the subject, then (``previous``: the hop before it) the
    hop's relation asked of the previous hop's subject, the entity the agent has just left."""
    subject, relation = hop["subject"], hop["relation"]
    out = [RELATIONS[relation].query.format(s=t) for t in twins.get(subject, [])]
    own = (entities.get(subject) or {}).get("relations", {})
    out += [RELATIONS[r].query.format(s=subject) for r in sorted(own) if r != relation and r in RELATIONS]
    if previous is not None and previous["subject"] != subject:
        out.append(RELATIONS[relation].query.format(s=previous["subject"]))
    return [q for q in dict.fromkeys(out) if q != hop["query"]]


def plan_detours(examples: Sequence[QAExample], entities: Mapping[str, dict], fraction: float,
                 rng: random.Random) -> Plan:
    """For a ``fraction`` of ``examples`` (each drawn with that probability), the candidate detours to try, keyed by
    example id: the hops in a random order, each hop's wrong queries in :func:`detour_queries`' order."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"detour fraction must be in [0, 1], got {fraction}")
    twins = twin_map(entities)
    plan: Plan = {}
    for ex in examples:
        if rng.random() >= fraction:
            continue
        chain = question_hops(ex)
        hops = list(enumerate(chain))
        rng.shuffle(hops)
        candidates = [(k, q) for k, hop in hops
                      for q in detour_queries(hop, entities, twins, chain[k - 1] if k else None)]
        if candidates:
            plan[ex.id] = candidates
    return plan


def planned_queries(plan: Plan) -> list[str]:
    """Every wrong query of ``plan``, each once, sorted."""
    return sorted({q for candidates in plan.values() for _, q in candidates})


def choose_detours(plan: Plan, examples: Sequence[QAExample],
                   retrieved: Mapping[str, Sequence[str]]) -> dict[str, tuple[int, str]]:
    """Example id → ``(hop index, wrong query)``: per planned example, the first candidate whose retrieved passage
    ids (``retrieved[query]``) hold none of that hop's gold passages; examples with none are left out."""
    out = {}
    for ex in examples:
        golds = gold_fact_passages(ex)
        for k, query in plan.get(ex.id, ()):
            if golds[k].isdisjoint(map(str, retrieved[query])):
                out[ex.id] = (k, query)
                break
    return out
