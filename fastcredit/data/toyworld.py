"""The toy world: a seeded synthetic encyclopedia in Search-R1's file formats.

    python -m fastcredit.data.toyworld --out runs/toyworld --seed 0 --num-questions 1000

People, cities, countries, universities, companies and bands with functional typed
relations (born_in, studied_at, spouse, country, capital, located_in, founded_by,
headquartered_in, lead_singer, formed_in). The corpus states each fact in a short passage
about one entity. Two kinds of distractors make retrieval need precision: *twins*, entities
whose names differ from another's by one letter ("Varo Keltan" / "Varo Keltin") with
passages of their own, and *mention* passages that name an entity next to other entities
without stating any relation. Questions take 1 to 3 hops (``min_hops`` .. ``max_hops``); each hop carries its gold
sub-query, sub-answer and the passages that state the fact (PiCA's pivot labels and the
oracle judges' ground truth: ``fastcredit.data.toyqa``, where the questions are made and read).

Files written by ``write_world`` (the same config gives byte-identical files):

    corpus.jsonl                  {"id", "contents": "\\"Title\\"\\ntext"}; id = line number
    train.jsonl, test.jsonl       {"id", "question", "golden_answers", "data_source": "toyworld",
                                   "metadata": {"num_hops", "hops": [{"query", "answer", "aliases",
                                   "subject", "relation", "passage_ids"}]}}
    train.parquet, test.parquet   Search-R1's nq_hotpotqa_train layout (see loaders.py)
    world.json                    config, summary, entities, facts ("subject|relation" → ids)
    summary.json                  the counts, as printed by the command line
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import typing
from dataclasses import dataclass
from typing import Iterable, Optional

from fastcredit.data.loaders import (
    DataError, QAExample, iter_corpus, load_toyworld, write_searchr1_parquet,
)
from fastcredit.data.toyqa import RELATIONS, make_questions, question_hops
from fastcredit.config.toy import LookupWorldConfig, ToyWorldConfig, check_toy_world, toy_world_config, world_key
from fastcredit.runtime.files import atomic_output

TYPES = ("person", "city", "country", "university", "company", "band")
DATA_SOURCE = "toyworld"


# Facts stated together in one passage about the subject; one passage per tuple.
_PASSAGE_GROUPS = {
    "person": (("born_in",), ("studied_at", "spouse")),
    "city": (("country",),),
    "country": (("capital",),),
    "university": (("located_in",),),
    "company": (("founded_by", "headquartered_in"),),
    "band": (("formed_in", "lead_singer"),),
}
# Sentences of mention passages: (template, type of the other entity). None of them
# matches a RELATIONS sentence, so they name entities without stating a fact.
_MENTIONS = {
    "person": (("{s} once gave a talk in {o}.", "city"), ("{s} wrote a biography of {o}.", "person")),
    "city": (("{s} hosted a trade fair with delegates from {o}.", "country"),),
    "country": (("{s} signed a trade agreement with {o}.", "country"),),
    "university": (("{s} awarded an honorary degree to {o}.", "person"),),
    "company": (("{s} sponsored a festival in {o}.", "city"), ("{s} once hired {o} as an adviser.", "person")),
    "band": (("{s} played a sold-out concert in {o}.", "city"), ("{s} recorded a song about {o}.", "person")),
}
_ALIAS_SENTENCE = {"country": "Its official name is the {a}.", "university": "It is also known as the {a}."}

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
           "br", "dr", "gr", "kr", "st", "th", "sh", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ei", "ou")
_CODAS = ("", "", "", "n", "r", "s", "l", "th", "x", "m")
_SUFFIXES = {
    "city": ("ford", "holm", "mere", "grad", "ton", "vale", "port"),
    "country": ("ia", "land", "stan", "ora"),
    "university": (" University", " Institute"),
    "company": (" Labs", " Works", " Group", " Industries", " Systems"),
    "band": (" Echo", " Parade", " Hollow", " Static", " Choir"),
}


@dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        """Search-R1's corpus field: the quoted title, a newline, the text."""
        return f'"{self.title}"\n{self.text}'


@dataclass
class ToyWorld:
    """The generated world. ``entities``: name → {"type", "relations": {rel: name}, "aliases", ["twin_of"]};
    ``facts``: "subject|relation" → ids of the passages stating it; passage ``i`` has id ``str(i)``."""

    config: ToyWorldConfig
    entities: dict
    passages: list
    facts: dict
    train: list
    test: list

    @property
    def questions(self) -> list:
        """Train then test questions (QAExample)."""
        return self.train + self.test

    def split(self, name: str) -> list:
        """The ``train`` or ``test`` questions (QAExample)."""
        if name not in ("train", "test"):
            raise ValueError(f"unknown split {name!r}; valid: train, test")
        return self.train if name == "train" else self.test

    def passage(self, pid: str) -> Passage:
        """The passage with id ``pid`` (ids are row numbers)."""
        return self.passages[int(pid)]


class _Namer:
    """Unique pronounceable names; a twin differs from its original in one vowel letter."""

    def __init__(self, rng: random.Random):
        self.rng, self.taken = rng, set()  # lower-cased, so names stay distinct after EM normalisation

    def _word(self, syllables: int) -> str:
        body = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables))
        return (body + self.rng.choice(_CODAS)).capitalize()

    def _claim(self, name: str) -> bool:
        if name.lower() in self.taken:
            return False
        self.taken.add(name.lower())
        return True

    def fresh(self, kind: str) -> str:
        while True:
            if kind == "person":
                name = f"{self._word(2)} {self._word(self.rng.choice((2, 3)))}"
            else:
                name = self._word(2) + self.rng.choice(_SUFFIXES[kind])
            if self._claim(name):
                return name

    def twin(self, name: str, kind: str) -> Optional[str]:
        # Only the invented part changes: "Kelmar Lebs" would be a giveaway, not a twin.
        stem_end = len(name) if kind == "person" else name.index(" ") if " " in name else len(name)
        edits = [(i, v) for i in range(stem_end) if name[i].lower() in "aeiou" for v in "aeiou" if v != name[i].lower()]
        self.rng.shuffle(edits)
        for i, v in edits:
            cand = name[:i] + (v.upper() if name[i].isupper() else v) + name[i + 1:]
            if self._claim(cand):
                return cand
        return None


def _with_twins(names: list, kind: str, fraction: float, namer: _Namer, ents: dict) -> list:
    out = []
    for name in names:
        out.append(name)
        if namer.rng.random() < fraction:
            twin = namer.twin(name, kind)
            if twin is not None:
                out.append(twin)
                ents[twin] = {"type": kind, "relations": {}, "aliases": [], "twin_of": name}
    return out


def _make_entities(cfg: ToyWorldConfig, rng: random.Random) -> dict:
    namer, ents = _Namer(rng), {}

    def add(kind: str, names: list) -> list:
        for n in names:
            ents.setdefault(n, {"type": kind, "relations": {}, "aliases": []})
        return names

    countries = add("country", [namer.fresh("country") for _ in range(cfg.num_countries)])
    cities = add("city", [namer.fresh("city") for _ in range(cfg.num_cities)])
    for i, c in enumerate(cities):  # the first cities go round the countries, so each has one
        ents[c]["relations"]["country"] = countries[i] if i < len(countries) else rng.choice(countries)
    for k in countries:
        ents[k]["relations"]["capital"] = rng.choice([c for c in cities if ents[c]["relations"]["country"] == k])
        ents[k]["aliases"] = [f"Republic of {k}"]
    for u in add("university", [namer.fresh("university") for _ in range(cfg.num_universities)]):
        ents[u]["relations"]["located_in"] = rng.choice(cities)
        if u.endswith(" University"):
            ents[u]["aliases"] = [f"University of {u[: -len(' University')]}"]
    unis = [n for n, e in ents.items() if e["type"] == "university"]
    people = _with_twins(add("person", [namer.fresh("person") for _ in range(cfg.num_people)]),
                         "person", cfg.twin_fraction, namer, ents)
    for p in people:
        ents[p]["relations"].update(born_in=rng.choice(cities), studied_at=rng.choice(unis))
    order = people[:]
    rng.shuffle(order)
    married = order[: 2 * int(len(order) * cfg.married_fraction / 2)]
    for a, b in zip(married[0::2], married[1::2]):
        ents[a]["relations"]["spouse"], ents[b]["relations"]["spouse"] = b, a
    for kind, count, rels in (("company", cfg.num_companies, ("founded_by", "headquartered_in")),
                              ("band", cfg.num_bands, ("lead_singer", "formed_in"))):
        names = _with_twins(add(kind, [namer.fresh(kind) for _ in range(count)]), kind, cfg.twin_fraction, namer, ents)
        for n in names:
            for rel in rels:
                pool = people if RELATIONS[rel].object == "person" else cities
                ents[n]["relations"][rel] = rng.choice(pool)
    return ents


def _fact_texts(name: str, ent: dict) -> list[tuple[tuple, str]]:
    """(relations stated, text) for each fact passage about one entity."""
    out = []
    for group in _PASSAGE_GROUPS[ent["type"]]:
        rels = tuple(r for r in group if r in ent["relations"])
        if not rels:
            continue
        text = " ".join(RELATIONS[r].sentence.format(s=name, o=ent["relations"][r]) for r in rels)
        if not out and ent["aliases"]:  # the alias goes in the entity's first passage
            text += " " + _ALIAS_SENTENCE[ent["type"]].format(a=ent["aliases"][0])
        out.append((rels, text))
    return out


def _make_passages(cfg: ToyWorldConfig, ents: dict, rng: random.Random) -> tuple[list, dict]:
    by_type = {t: [n for n, e in ents.items() if e["type"] == t] for t in TYPES}
    drafts = []  # (title, text, relations stated)
    for name, ent in ents.items():
        for rels, text in _fact_texts(name, ent):
            drafts.append((name, text, rels))
        if rng.random() < cfg.distractor_fraction:
            template, other_type = rng.choice(_MENTIONS[ent["type"]])
            others = [o for o in by_type[other_type] if o != name]
            if others:
                drafts.append((name, template.format(s=name, o=rng.choice(others)), ()))
    order = list(range(len(drafts)))
    rng.shuffle(order)  # ids carry no hint of which entity or kind of passage they hold
    passages, facts = [], {}
    for pid, k in enumerate(order):
        title, text, rels = drafts[k]
        passages.append(Passage(str(pid), title, text))
        for r in rels:
            facts.setdefault(f"{title}|{r}", []).append(str(pid))
    # A marriage is stated in both partners' passages; either one satisfies the hop.
    for name, ent in ents.items():
        partner = ent["relations"].get("spouse")
        if partner is not None:
            facts[f"{name}|spouse"] = facts[f"{name}|spouse"] + facts[f"{partner}|spouse"]
    return passages, {k: sorted(set(v), key=int) for k, v in facts.items()}


def generate_world(cfg: Optional[ToyWorldConfig] = None) -> ToyWorld:
    """Build the world in memory; everything follows from ``cfg`` (one ``random.Random(cfg.seed)``). A lookup world
    (``cfg.kind``) is made by ``fastcredit.data.lookup``."""
    cfg = cfg or ToyWorldConfig()
    check_toy_world(cfg)  # a ConfigError, a ValueError, naming the setting
    rng = random.Random(cfg.seed)
    if cfg.kind == "lookup":
        from fastcredit.data.lookup import lookup_examples, make_lookup_world

        ents, texts, facts, splits = make_lookup_world(cfg, rng)
        examples = lookup_examples(splits, DATA_SOURCE)
        passages = [Passage(str(pid), title, text) for pid, (title, text) in enumerate(texts)]
        return ToyWorld(cfg, ents, passages, facts, examples["train"], examples["test"])
    ents = _make_entities(cfg, rng)
    passages, facts = _make_passages(cfg, ents, rng)
    questions = make_questions(cfg, ents, facts, rng)
    n_test = int(round(cfg.test_fraction * len(questions)))
    splits = {"train": questions[: len(questions) - n_test], "test": questions[len(questions) - n_test:]}
    examples = {
        split: [QAExample(f"{split}_{i}", q, answers, DATA_SOURCE, {"num_hops": len(hops), "hops": hops})
                for i, (q, answers, hops) in enumerate(rows)]
        for split, rows in splits.items()
    }
    return ToyWorld(cfg, ents, passages, facts, examples["train"], examples["test"])


def summarize(world: ToyWorld) -> dict:
    """Counts: entities by type, twins, passages (fact / distractor), questions by split and hops (a lookup world:
    ``fastcredit.data.lookup.lookup_summary``)."""
    if world.config.kind == "lookup":
        from fastcredit.data.lookup import lookup_summary

        return lookup_summary(world.config, world.entities, world.passages, world.train, world.test)
    fact_ids = {pid for ids in world.facts.values() for pid in ids}
    hops = [len(question_hops(q)) for q in world.questions]
    return {
        "seed": world.config.seed,
        "entities": {t: sum(e["type"] == t for e in world.entities.values()) for t in TYPES},
        "twins": sum("twin_of" in e for e in world.entities.values()),
        "passages": len(world.passages),
        "fact_passages": len(fact_ids),
        "distractor_passages": len(world.passages) - len(fact_ids),
        "questions": len(world.questions),
        "train": len(world.train),
        "test": len(world.test),
        "questions_by_hops": {str(h): hops.count(h) for h in range(1, 4)},
    }


def _dump(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, indent=1).encode("utf-8") + b"\n"


def _write_bytes(path: str, data: bytes) -> None:
    with atomic_output(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data)


def _jsonl(rows: Iterable[dict]) -> bytes:
    return "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def write_world(world: ToyWorld, out_dir: str) -> dict:
    """Write the world's files into ``out_dir`` (created if needed), each atomically; return the summary."""
    os.makedirs(out_dir, exist_ok=True)
    corpus = ({"id": p.id, "contents": p.contents} for p in world.passages)
    _write_bytes(os.path.join(out_dir, "corpus.jsonl"), _jsonl(corpus))
    for split in ("train", "test"):
        examples = world.split(split)
        _write_bytes(os.path.join(out_dir, f"{split}.jsonl"), _jsonl(ex.to_record() for ex in examples))
        write_searchr1_parquet(examples, os.path.join(out_dir, f"{split}.parquet"), split=split)
    summary = summarize(world)
    doc = {"config": world_key(world.config), "summary": summary,
           "entities": world.entities, "facts": world.facts}
    _write_bytes(os.path.join(out_dir, "world.json"), _dump(doc))
    _write_bytes(os.path.join(out_dir, "summary.json"), _dump(summary))
    return summary


def load_world(out_dir: str) -> ToyWorld:
    """Read a written world back: config, entities, facts, passages and both splits."""
    path = os.path.join(out_dir, "world.json")
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
        cfg = toy_world_config(doc["config"])
        entities, facts = doc["entities"], doc["facts"]
    except FileNotFoundError:
        raise DataError(f"{path}: no such file (not a toy-world folder?)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{path}: not a readable toy world ({type(exc).__name__}: {exc})") from None
    passages = []
    for row, (pid, title, text) in enumerate(iter_corpus(os.path.join(out_dir, "corpus.jsonl"))):
        if pid != str(row):  # Passage lookup by id relies on id == line number
            raise DataError(f"{out_dir}/corpus.jsonl line {row + 1}: field 'id' is {pid!r}, expected {str(row)!r}")
        passages.append(Passage(pid, title, text))
    return ToyWorld(cfg, entities, passages, facts, load_toyworld(out_dir, "train"), load_toyworld(out_dir, "test"))


def _flags(p, cls, prefix: str = "") -> None:
    """One flag per field of ``cls`` (a nested section's fields under its name: ``--lookup-min-k``)."""
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        if f.name == "lookup":
            _flags(p, LookupWorldConfig, name + "_")
            continue
        choices = typing.get_args(typing.get_type_hints(cls)[f.name]) or None
        p.add_argument("--" + name.replace("_", "-"), type=type(f.default), default=f.default, choices=choices,
                       help=f"{f.metadata['help']} (default {f.default})")


def parser():
    """The command line: the output folder and one flag per ToyWorldConfig field (the lookup section's too)."""
    from fastcredit.config import command_parser

    p = command_parser("python -m fastcredit.data.toyworld", "Write the toy world's files.")
    p.add_argument("--out", required=True, help="output folder")
    _flags(p, ToyWorldConfig)
    return p


def main(argv: Optional[list] = None) -> int:
    """The command line: generate, write, print the summary; exit status 2 on a bad config."""
    args = vars(parser().parse_args(argv))
    lookup = LookupWorldConfig(**{f.name: args[f"lookup_{f.name}"] for f in dataclasses.fields(LookupWorldConfig)})
    cfg = ToyWorldConfig(**{f.name: args[f.name] for f in dataclasses.fields(ToyWorldConfig) if f.name != "lookup"},
                         lookup=lookup)
    try:
        summary = write_world(generate_world(cfg), args["out"])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
