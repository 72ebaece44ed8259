"""The toy world: a seeded synthetic encyclopedia in Search-R1's file formats.

    python -m fastcredit.data.toyworld --out runs/toyworld --seed 0

Entities (people, cities, countries, companies, universities) with functional typed
relations; a corpus of short passages stating one or two facts each, including passages
about *twins* — entities whose names differ from another's by one letter — so retrieval
must be precise; 1- to 3-hop questions whose hops carry the gold sub-query, sub-answer and
the passages stating the fact (PiCA's pivot labels, and the oracle judges' ground truth).
The same seed gives byte-identical files.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import tempfile
from dataclasses import dataclass, field
from typing import Iterable, Optional

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "th", "sh"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "eo", "ia"]
_CODAS = ["", "", "n", "r", "s", "l", "th", "x"]
_SUFFIX = {"city": ["ford", "mere", "holm", "grad", "ton"], "country": ["ia", "land", "stan", "ora"],
           "company": [" Industries", " Labs", " Group", " Works"], "university": [" University", " Institute"]}
TYPES = ("person", "city", "country", "company", "university")


@dataclass
class ToyWorldConfig:
    seed: int = field(default=0, metadata={"help": "generator seed; the same seed gives byte-identical files"})
    num_people: int = field(default=700, metadata={"help": "people (each has a birthplace, a university and maybe a spouse)"})
    num_cities: int = field(default=120, metadata={"help": "cities (each lies in a country)"})
    num_countries: int = field(default=30, metadata={"help": "countries (each has a capital among its cities)"})
    num_companies: int = field(default=250, metadata={"help": "companies (founder and headquarters)"})
    num_universities: int = field(default=60, metadata={"help": "universities (each located in a city)"})
    twin_fraction: float = field(default=0.3, metadata={"help": "fraction of people and companies given a one-letter-apart twin (distractors)"})
    num_questions: int = field(default=1000, metadata={"help": "questions generated (train + test)"})
    max_hops: int = field(default=3, metadata={"help": "longest question chain (1 to 3)"})
    test_fraction: float = field(default=0.1, metadata={"help": "share of questions in the test split"})


@dataclass
class Passage:
    id: str
    title: str
    text: str

    def contents(self) -> str:
        """Search-R1's corpus field: the quoted title, a newline, the text."""
        return f'"{self.title}"\n{self.text}'


@dataclass
class ToyWorld:
    config: ToyWorldConfig
    entities: dict  # name -> {"type": str, "relations": {relation: name}}
    passages: list  # [Passage]
    fact_passages: dict  # "subject|relation" -> [passage id]
    questions: list  # [dict] FlashRAG-style records with metadata.hops

    def split(self, name: str) -> list:
        return [q for q in self.questions if q["metadata"]["split"] == name]


class _Names:
    """Unique syllable names; twins differ from their original by one vowel."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def _word(self, syllables: int) -> str:
        w = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables))
        return (w + self.rng.choice(_CODAS)).capitalize()

    def new(self, kind: str) -> str:
        while True:
            if kind == "person":
                name = f"{self._word(2)} {self._word(self.rng.choice([2, 3]))}"
            else:
                name = self._word(2) + self.rng.choice(_SUFFIX[kind])
            if name not in self.used:
                self.used.add(name)
                return name

    def twin(self, name: str) -> Optional[str]:
        spots = [i for i, ch in enumerate(name) if ch in "aeiou"]
        self.rng.shuffle(spots)
        for i in spots:
            for v in "aeiou":
                cand = name[:i] + v + name[i + 1 :]
                if v != name[i] and cand not in self.used:
                    self.used.add(cand)
                    return cand
        return None


def _make_entities(cfg: ToyWorldConfig, rng: random.Random) -> dict:
    names = _Names(rng)
    ents: dict = {}

    def add(kind, name, **rel):
        ents[name] = {"type": kind, "relations": rel}

    countries = [names.new("country") for _ in range(cfg.num_countries)]
    cities = [names.new("city") for _ in range(cfg.num_cities)]
    for i, c in enumerate(cities):  # every country gets at least one city
        add("city", c, country=countries[i % len(countries)] if i < len(countries) else rng.choice(countries))
    for k in countries:
        add("country", k, capital=rng.choice([c for c in cities if ents[c]["relations"]["country"] == k]))
    for _ in range(cfg.num_universities):
        add("university", names.new("university"), located_in=rng.choice(cities))
    unis = [n for n, e in ents.items() if e["type"] == "university"]
    people = [names.new("person") for _ in range(cfg.num_people)]
    people += [t for p in people if rng.random() < cfg.twin_fraction for t in [names.twin(p)] if t]
    for p in people:
        add("person", p, born_in=rng.choice(cities), studied_at=rng.choice(unis))
    singles = people[:]
    rng.shuffle(singles)
    for a, b in zip(singles[0::4], singles[1::4]):  # half of the people are married, in pairs
        ents[a]["relations"]["spouse"], ents[b]["relations"]["spouse"] = b, a
    companies = [names.new("company") for _ in range(cfg.num_companies)]
    companies += [t for c in companies if rng.random() < cfg.twin_fraction for t in [names.twin(c)] if t]
    for c in companies:
        add("company", c, founded_by=rng.choice(people), headquartered_in=rng.choice(cities))
    return ents


_SENTENCES = {
    "born_in": "{s} was born in {o}.",
    "studied_at": "{s} studied at {o}.",
    "spouse": "{s} is married to {o}.",
    "country": "{s} is a city in {o}.",
    "capital": "The capital of {s} is {o}.",
    "located_in": "{s} is located in {o}.",
    "founded_by": "{s} was founded by {o}.",
    "headquartered_in": "{s} has its headquarters in {o}.",
}
# Facts stated together in one passage; the rest get a passage each.
_GROUPS = {"person": [("born_in",), ("studied_at", "spouse")], "company": [("founded_by", "headquartered_in")]}


def _make_passages(ents: dict, rng: random.Random) -> tuple[list, dict]:
    passages, facts = [], {}
    for name in sorted(ents):
        e = ents[name]
        groups = _GROUPS.get(e["type"], [tuple(e["relations"])])
        for group in groups:
            rels = [r for r in group if r in e["relations"]]
            if not rels:
                continue
            pid = str(len(passages))
            text = " ".join(_SENTENCES[r].format(s=name, o=e["relations"][r]) for r in rels)
            passages.append(Passage(pid, name, text))
            for r in rels:
                facts.setdefault(f"{name}|{r}", []).append(pid)
    # A spouse fact is stated in both partners' passages.
    for name, e in ents.items():
        partner = e["relations"].get("spouse")
        if partner:
            facts[f"{name}|spouse"] = sorted(set(facts[f"{name}|spouse"] + facts[f"{partner}|spouse"]), key=int)
    order = list(range(len(passages)))
    rng.shuffle(order)  # passage ids carry no hint of the entity order
    remap = {passages[i].id: str(j) for j, i in enumerate(order)}
    shuffled = [Passage(str(j), passages[i].title, passages[i].text) for j, i in enumerate(order)]
    facts = {k: sorted((remap[p] for p in v), key=int) for k, v in facts.items()}
    return shuffled, facts


# (start type, relation chain, question template, sub-query templates per hop)
_TEMPLATES = [
    ("person", ["born_in"], "Where was {x} born?", ["{x} place of birth"]),
    ("person", ["studied_at"], "Which university did {x} attend?", ["{x} university"]),
    ("company", ["founded_by"], "Who founded {x}?", ["{x} founder"]),
    ("country", ["capital"], "What is the capital of {x}?", ["{x} capital"]),
    ("person", ["born_in", "country"], "In which country was {x} born?", ["{x} place of birth", "{y} country"]),
    ("company", ["founded_by", "born_in"], "Where was the founder of {x} born?", ["{x} founder", "{y} place of birth"]),
    ("person", ["spouse", "studied_at"], "Which university did the spouse of {x} attend?", ["{x} spouse", "{y} university"]),
    ("university", ["located_in", "country"], "In which country is {x}?", ["{x} location", "{y} country"]),
    ("company", ["founded_by", "born_in", "country"], "In which country was the founder of {x} born?",
     ["{x} founder", "{y} place of birth", "{y} country"]),
    ("person", ["born_in", "country", "capital"], "What is the capital of the country where {x} was born?",
     ["{x} place of birth", "{y} country", "{y} capital"]),
    ("company", ["headquartered_in", "country", "capital"],
     "What is the capital of the country where {x} has its headquarters?",
     ["{x} headquarters", "{y} country", "{y} capital"]),
]


def _make_questions(cfg, ents, facts, rng) -> list:
    by_type = {t: sorted(n for n, e in ents.items() if e["type"] == t) for t in TYPES}
    templates = [t for t in _TEMPLATES if len(t[1]) <= cfg.max_hops]
    out, seen = [], set()
    attempts = 0
    while len(out) < cfg.num_questions and attempts < cfg.num_questions * 50:
        attempts += 1
        start_type, chain, question_t, query_ts = rng.choice(templates)
        x = rng.choice(by_type[start_type])
        if (x, question_t) in seen:
            continue
        hops, cur = [], x
        for rel, query_t in zip(chain, query_ts):
            nxt = ents[cur]["relations"].get(rel)
            if nxt is None:
                break
            hops.append({"query": query_t.format(x=x, y=cur), "answer": nxt, "relation": rel,
                         "subject": cur, "passage_ids": facts[f"{cur}|{rel}"]})
            cur = nxt
        if len(hops) != len(chain):
            continue
        seen.add((x, question_t))
        out.append({"question": question_t.format(x=x), "golden_answers": [cur], "num_hops": len(hops), "hops": hops})
    if len(out) < cfg.num_questions:
        raise ValueError(f"the world is too small for {cfg.num_questions} distinct questions (made {len(out)})")
    n_test = int(round(cfg.test_fraction * len(out)))
    records = []
    for i, q in enumerate(out):
        split = "test" if i >= len(out) - n_test else "train"
        records.append({
            "id": f"toy-{split}-{i}", "question": q["question"], "golden_answers": q["golden_answers"],
            "data_source": "toyworld",
            "metadata": {"split": split, "num_hops": q["num_hops"], "hops": q["hops"]},
        })
    return records


def generate_world(cfg: Optional[ToyWorldConfig] = None) -> ToyWorld:
    """Build the world in memory from ``cfg.seed`` alone (no global randomness)."""
    cfg = cfg or ToyWorldConfig()
    if not 1 <= cfg.max_hops <= 3:
        raise ValueError(f"max_hops must be 1, 2 or 3, got {cfg.max_hops}")
    if cfg.num_countries < 1 or cfg.num_cities < cfg.num_countries:
        raise ValueError("need at least one country and at least as many cities as countries")
    rng = random.Random(cfg.seed)
    ents = _make_entities(cfg, rng)
    passages, facts = _make_passages(ents, rng)
    questions = _make_questions(cfg, ents, facts, rng)
    return ToyWorld(cfg, ents, passages, facts, questions)


def hops_found(question: dict, retrieved_ids: Iterable[str]) -> list[bool]:
    """For each gold hop of ``question``: was one of its fact's passages retrieved?"""
    got = set(map(str, retrieved_ids))
    return [bool(got.intersection(h["passage_ids"])) for h in question["metadata"]["hops"]]


def _write_atomic(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _jsonl(rows: Iterable[dict]) -> bytes:
    return "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def write_world(world: ToyWorld, out_dir: str) -> dict:
    """Write corpus.jsonl, train/test .jsonl and .parquet, world.json and summary.json."""
    from fastcredit.data.loaders import QAExample, write_searchr1_parquet

    os.makedirs(out_dir, exist_ok=True)
    corpus = ({"id": p.id, "contents": p.contents()} for p in world.passages)
    _write_atomic(os.path.join(out_dir, "corpus.jsonl"), _jsonl(corpus))
    for split in ("train", "test"):
        rows = world.split(split)
        _write_atomic(os.path.join(out_dir, f"{split}.jsonl"), _jsonl(rows))
        examples = [QAExample(r["id"], r["question"], r["golden_answers"], r["data_source"], r["metadata"]) for r in rows]
        write_searchr1_parquet(examples, os.path.join(out_dir, f"{split}.parquet"), split)
    world_doc = {"config": dataclasses.asdict(world.config), "entities": world.entities, "facts": world.fact_passages}
    _write_atomic(os.path.join(out_dir, "world.json"), json.dumps(world_doc, sort_keys=True, indent=1).encode("utf-8"))
    summary = summarise(world)
    _write_atomic(os.path.join(out_dir, "summary.json"), json.dumps(summary, sort_keys=True, indent=1).encode("utf-8"))
    return summary


def summarise(world: ToyWorld) -> dict:
    counts = {t: sum(e["type"] == t for e in world.entities.values()) for t in TYPES}
    hops = {str(h): sum(q["metadata"]["num_hops"] == h for q in world.questions) for h in (1, 2, 3)}
    return {"seed": world.config.seed, "entities": counts, "passages": len(world.passages),
            "questions": len(world.questions), "train": len(world.split("train")),
            "test": len(world.split("test")), "questions_by_hops": hops}


def load_world(out_dir: str) -> ToyWorld:
    """Read a written world back (entities, passages, questions)."""
    from fastcredit.data.loaders import DataError, iter_corpus, load_flashrag_jsonl

    path = os.path.join(out_dir, "world.json")
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: cannot read the toy world ({exc})") from None
    cfg = ToyWorldConfig(**doc["config"])
    passages = [Passage(pid, title, text) for pid, title, text in iter_corpus(os.path.join(out_dir, "corpus.jsonl"))]
    questions = []
    for split in ("train", "test"):
        for ex in load_flashrag_jsonl(os.path.join(out_dir, f"{split}.jsonl")):
            questions.append({"id": ex.id, "question": ex.question, "golden_answers": ex.golden_answers,
                              "data_source": ex.data_source, "metadata": ex.metadata})
    return ToyWorld(cfg, doc["entities"], passages, doc["facts"], questions)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description="Generate the toy world's files.")
    parser.add_argument("--out", required=True, help="output directory")
    for f in dataclasses.fields(ToyWorldConfig):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default, help=f.metadata["help"])
    args = parser.parse_args(argv)
    cfg = ToyWorldConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ToyWorldConfig)})
    summary = write_world(generate_world(cfg), args.out)
    print(json.dumps(summary, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
