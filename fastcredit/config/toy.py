"""The toy world's section of the config (``data.toy``): what ``fastcredit.data.toyworld`` generates.

    check_toy_world(cfg)                 # ConfigError "toy world: num_cities (3) must be at least num_countries (5)"

Each number's range is declared beside its field; :func:`check_toy_world` adds the rules between
them. The generator and the training config's checks both call it.
"""
from __future__ import annotations

from dataclasses import dataclass

from fastcredit.config.errors import ConfigError
from fastcredit.config.fields import COUNT, NONNEG, UNIT, opt
from fastcredit.config.ranges import check_ranges


@dataclass
class ToyWorldConfig:
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


def check_toy_world(cfg: ToyWorldConfig, name: str = "toy world") -> None:
    """Every number of ``cfg`` in its field's range, then the rules between them; a ConfigError (a ValueError)
    whose message starts with ``name`` (``data.toy`` in the training config's checks)."""
    check_ranges(cfg, label=name)
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
