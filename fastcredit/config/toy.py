"""The toy world's section of the config (``data.toy``): what ``fastcredit.data.toyworld`` generates."""
from __future__ import annotations

from dataclasses import dataclass

from fastcredit.config.fields import opt


@dataclass
class ToyWorldConfig:
    seed: int = opt(0, "generator seed; the same config gives byte-identical files")
    num_people: int = opt(700, "people, before twins (birthplace, university, maybe a spouse)")
    num_cities: int = opt(120, "cities (each lies in a country)")
    num_countries: int = opt(30, "countries (each has one of its cities as capital)")
    num_universities: int = opt(60, "universities (each located in a city)")
    num_companies: int = opt(250, "companies, before twins (founder and headquarters)")
    num_bands: int = opt(80, "bands, before twins (lead singer and home city)")
    twin_fraction: float = opt(0.3, "share of people, companies and bands given a one-letter-apart twin entity (a distractor)")
    distractor_fraction: float = opt(0.25, "share of entities given an extra passage that names other entities but states no relation")
    married_fraction: float = opt(0.5, "share of people who are married (in pairs)")
    num_questions: int = opt(1000, "questions generated, train and test together")
    min_hops: int = opt(1, "shortest question chain (1 to max_hops); e.g. 2 leaves out the one-search questions")
    max_hops: int = opt(3, "longest question chain (1 to 3); hop counts are drawn uniformly")
    test_fraction: float = opt(0.1, "share of the questions in the test split")
