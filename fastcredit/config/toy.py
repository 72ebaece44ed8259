"""The toy world's section of the config (``data.toy``): what ``fastcredit.data.toyworld`` generates.

    check_toy_world(cfg)                 # ConfigError "toy world: num_cities (3) must be at least num_countries (5)"

Two kinds of world (``data.toy.kind``): ``chain``, typed relations followed over 1 to 3 hops, and ``lookup``, where a
question asks for the codes of K named entities, each found by an independent search
(``data.toy.lookup``; ``fastcredit.data.lookup``). Each number's range is declared beside its field;
:func:`check_toy_world` adds the rules between them. The generator and the training config's checks both call it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from fastcredit.config.errors import ConfigError
from fastcredit.config.fields import COUNT, NONNEG, UNIT, opt
from fastcredit.config.ranges import check_ranges


@dataclass
class LookupWorldConfig:
    entities: int = opt(6000, "training entities: the entities training questions ask about", range=COUNT)
    test_entities: int = opt(300, "held-out entities: test questions ask only about these, and no training question "
                                  "names one (disjoint from data.toy.lookup.entities)", range=COUNT)
    min_k: int = opt(3, "fewest entities a question asks about (K, 1 to 8)", range="[1, 8]",
                     note="at most data.toy.lookup.max_k")
    max_k: int = opt(3, "most entities a question asks about (K, 1 to 8); each question draws K uniformly",
                     range="[1, 8]")
    slack: int = opt(1, "searches a trajectory may make beyond its K: its turn budget is K + slack searches and the "
                        "answer (the question's turn_budget; rollout.max_turns must hold the largest)", range="[0, 8]")
    name_words: int = opt(120, "first names (in near-identical pairs) and surnames the entities' names are made of: "
                              "every word is common to training and held-out names, an entity is a new pair",
                          range="[2, inf)")
    decoy_fraction: float = opt(1.0, "share of entities given a decoy: an entity of the same surname whose first name "
                                     "shares its first syllable, with a code of its own (a surname-only query finds "
                                     "one of the surname's entities)", range=UNIT)
    digits: int = opt(3, "digits of an entity's code (zero-padded)", range="[1, 6]")


@dataclass
class ToyWorldConfig:
    kind: Literal["chain", "lookup"] = opt(
        "chain", "chain: relations followed over 1 to 3 hops (people, cities, companies, ...); lookup: a question "
                 "asks for the codes of K named entities, each an independent search, held-out entities disjoint "
                 "from the training ones (data.toy.lookup; docs/lookup-world.md)")
    seed: int = opt(0, "generator seed; the same config gives byte-identical files", range=NONNEG)
    num_people: int = opt(700, "people, before twins (birthplace, university, maybe a spouse)", range=NONNEG)
    num_cities: int = opt(120, "cities (each lies in a country)", range=COUNT)
    num_countries: int = opt(30, "countries (each has one of its cities as capital)", range=COUNT)
    num_universities: int = opt(60, "universities (each located in a city)", range=NONNEG)
    num_companies: int = opt(250, "companies, before twins (founder and headquarters)", range=NONNEG)
    num_bands: int = opt(80, "bands, before twins (lead singer and home city)", range=NONNEG)
    twin_fraction: float = opt(0.3, "share of people, companies and bands given a one-letter-apart "
                                    "twin entity (a distractor)", range=UNIT)
    distractor_fraction: float = opt(0.25, "share of entities given an extra passage that names other "
                                           "entities but states no relation", range=UNIT)
    married_fraction: float = opt(0.5, "share of people who are married (in pairs)", range=UNIT)
    num_questions: int = opt(1000, "questions generated, train and test together", range=COUNT)
    min_hops: int = opt(1, "shortest question chain (1 to max_hops); e.g. 2 leaves out the one-search questions",
                        range="[1, 3]", note="at most data.toy.max_hops")
    max_hops: int = opt(3, "longest question chain (1 to 3); hop counts are drawn uniformly", range="[1, 3]")
    test_fraction: float = opt(0.1, "share of the questions in the test split", range="[0, 1)")
    lookup: LookupWorldConfig = opt(LookupWorldConfig, "the lookup world's settings (data.toy.kind=lookup); the "
                                                       "chain world's entity counts and hops do not apply to it")


def world_key(cfg: ToyWorldConfig) -> dict:
    """The settings a world is made from, as a dict (its folder's build key, world.json's config, the warm start's
    fingerprint): a chain world's leave out ``kind`` and ``lookup``, so worlds and warm starts made before the lookup
    kind existed are still found."""
    d = dataclasses.asdict(cfg)
    if cfg.kind == "chain":
        del d["kind"], d["lookup"]
    return d


def toy_world_config(d: dict) -> ToyWorldConfig:
    """A ToyWorldConfig from its ``dataclasses.asdict`` form (a world folder's world.json); a world written before the
    lookup kind existed has neither ``kind`` nor ``lookup`` and is a chain world."""
    d = dict(d)
    lookup = LookupWorldConfig(**d.pop("lookup", {}))
    return ToyWorldConfig(**d, lookup=lookup)


def lookup_turn_budget(cfg: LookupWorldConfig, k: int) -> int:
    """The turn budget of a lookup question about ``k`` entities: ``k + slack`` searches and the answer."""
    return k + cfg.slack + 1


def check_toy_world(cfg: ToyWorldConfig, name: str = "toy world") -> None:
    """Every number of ``cfg`` in its field's range, then the rules between them; a ConfigError (a ValueError)
    whose message starts with ``name`` (``data.toy`` in the training config's checks)."""
    check_ranges(cfg, label=name)
    if cfg.kind == "lookup":
        return _check_lookup(cfg, name)
    rules = [
        (cfg.min_hops <= cfg.max_hops, f"min_hops must be in [1, max_hops = {cfg.max_hops}], got {cfg.min_hops}"),
        (cfg.num_cities >= cfg.num_countries,
         f"num_cities ({cfg.num_cities}) must be at least num_countries ({cfg.num_countries})"),
        (cfg.num_universities >= 1 or cfg.num_people == 0,
         "people study somewhere: num_universities must be at least 1"),
        (cfg.num_people >= 1 or cfg.num_companies + cfg.num_bands == 0,
         "companies and bands need people: num_people must be at least 1"),
    ]
    for ok, message in rules:
        if not ok:
            raise ConfigError(f"{name}: {message}")


def _check_lookup(cfg: ToyWorldConfig, name: str) -> None:
    lk = cfg.lookup
    n_test = int(round(cfg.test_fraction * cfg.num_questions))
    rules = [
        (lk.min_k <= lk.max_k, f"lookup.min_k must be in [1, lookup.max_k = {lk.max_k}], got {lk.min_k}"),
        (lk.max_k <= lk.entities, f"lookup.max_k ({lk.max_k}) is more than the training entities a question can name "
                                  f"(lookup.entities = {lk.entities})"),
        (lk.max_k <= lk.test_entities or n_test == 0,
         f"lookup.max_k ({lk.max_k}) is more than the held-out entities a test question can name "
         f"(lookup.test_entities = {lk.test_entities})"),
        (lk.entities + lk.test_entities <= (lk.name_words // 2) * lk.name_words,
         f"lookup.entities + lookup.test_entities ({lk.entities + lk.test_entities}) is more than "
         f"lookup.name_words = {lk.name_words} words can name ({(lk.name_words // 2) * lk.name_words}: a first-name "
         "pair and a surname each)"),
        (cfg.num_questions - n_test >= 1, f"num_questions ({cfg.num_questions}) leaves no training question at "
                                          f"test_fraction {cfg.test_fraction}"),
    ]
    for ok, message in rules:
        if not ok:
            raise ConfigError(f"{name}: {message}")
    chain_defaults = {f.name: f.default for f in dataclasses.fields(ToyWorldConfig)
                      if f.name in ("min_hops", "max_hops")}
    for key, default in chain_defaults.items():
        if getattr(cfg, key) != default:
            raise ConfigError(f"{name}: {key} is a chain-world setting; the lookup world's questions take "
                              f"lookup.min_k .. lookup.max_k entities (set kind=chain, or leave {key} at {default})")
