"""The lookup world: a question asks for the codes of K named entities, each one found by a search of its own.

    world = generate_world(ToyWorldConfig(kind="lookup"))      # fastcredit.data.toyworld dispatches here
    labels = search_labels(example, [step.retrieved_ids for step in episode.steps])   # good / wasted / harmful

Every entity has a code (``digits`` digits, zero-padded) stated in a passage of its own,
``"Sagul Gitris"\nSagul Gitris has the code 417.``; the gold sub-query that finds it is
``Sagul Gitris code``. A question names K entities (``min_k`` .. ``max_k``), numbered,
``What are the codes of #1 Sagul Gitris, #2 Manos Limom and #3 Voter Tadar?``, and its one gold
answer is their codes in the question's order, ``417, 082, 953`` (EM normalisation drops the commas).

What makes it a test of credit assignment (docs/lookup-world.md):

* **Held-out entities are disjoint from the training ones.** Test questions name only the
  ``test_entities`` pool, training questions only the ``entities`` pool, so a held-out code can come
  only from retrieval: no policy can have memorised it. A name is a pair of words (a first name and a
  surname from ``name_words`` of each); a held-out name is a new pair of words training names use, so
  every token of it is one the policy has been trained on (a name it never saw, not a token it never saw).
* **The look-ups are independent.** A search finds one entity's code or not; a miss costs that one
  code, never the later searches, so a trajectory's good and bad turns are not its outcome restated.
* **Decoys.** First names come in near-identical pairs (the second keeps the first's first syllable), and
  each entity's decoy is the same surname with the twin first name (``Sabri Gitris`` beside
  ``Sagul Gitris``), with a code of its own. A careless, surname-only query (``Gitris code``) finds one of
  the surname's entities, almost never the one asked for, and its code costs the answer.
* **A turn budget.** Each question allows K + ``slack`` searches and the answer (``turn_budget``).

Each question carries one hop record per entity in the chain world's format (``query``, ``answer``,
``subject``, ``relation: "code"``, ``passage_ids``), so the oracle judges, PiCA's pivots and the
credit-accuracy metrics read it unchanged, plus ``decoy`` (the near-identical one) and ``decoy_ids`` (the
passages of every other entity of its surname). A search turn's label (:func:`search_labels`): *good* if it
retrieves a needed entity's passage no earlier turn had found; else *harmful* if it retrieves one of a needed
entity's decoys; else *wasted* (it repeats a find, or finds an entity the question does not name).
"""
from __future__ import annotations

import random
from typing import Iterable, Sequence, Union

from fastcredit.config.toy import ToyWorldConfig, lookup_turn_budget
from fastcredit.data.loaders import QAExample
from fastcredit.data.toyqa import RELATIONS, gold_fact_passages, question_hops

KIND = "lookup"
GOOD, WASTED, HARMFUL = "good", "wasted", "harmful"

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
           "br", "dr", "gr", "kr", "st", "th", "sh", "tr")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "", "n", "r", "s", "l", "m")


class _Words:
    """The name words: first names in near-identical pairs (the second keeps the first's first syllable) and
    surnames, every word unique after lower-casing."""

    def __init__(self, rng: random.Random):
        self.rng, self.taken = rng, set()

    def _syllable(self) -> str:
        return self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS)

    def _claim(self, word: str) -> bool:
        if word.lower() in self.taken:
            return False
        self.taken.add(word.lower())
        return True

    def word(self) -> str:
        while True:
            word = (self._syllable() + self._syllable() + self.rng.choice(_CODAS)).capitalize()
            if self._claim(word):
                return word

    def twin(self, word: str) -> str:
        head = next(i for i, ch in enumerate(word) if ch.lower() in _VOWELS) + 1  # onset and vowel kept
        while True:
            cand = word[:head] + self._syllable() + self.rng.choice(_CODAS)
            if self._claim(cand):
                return cand


def name_pool(lk, rng: random.Random) -> tuple[list, dict]:
    """``(principals, twin)``: ``lk.entities`` training then ``lk.test_entities`` held-out distinct ``(first,
    surname)`` pairs, and each first name's near-identical twin. No two principals share a first-name pair and a
    surname, so every principal's decoy ``(twin[first], surname)`` is free; a held-out pair uses only words some
    training pair uses."""
    words = _Words(rng)
    twin: dict = {}
    for _ in range(lk.name_words // 2):
        a = words.word()
        b = words.twin(a)
        twin[a], twin[b] = b, a
    firsts = [w for w in twin if w < twin[w]]  # one of each pair
    surnames = [words.word() for _ in range(lk.name_words)]
    slots = [(rng.choice((f, twin[f])), s) for f in firsts for s in surnames]
    rng.shuffle(slots)
    train = slots[: lk.entities]
    seen = {w for f, s in train for w in (f, s)}  # words training questions name (a decoy's first name is not)
    # held-out names are new pairs of words the training names use: every token of one is one training shows
    test = [(f, s) for f, s in slots[lk.entities:] if f in seen and s in seen][: lk.test_entities]
    if len(test) < lk.test_entities:
        raise ValueError(f"lookup.name_words = {lk.name_words} leaves {len(test)} held-out names made of words the "
                         f"{lk.entities} training names use, fewer than lookup.test_entities = {lk.test_entities}; "
                         "add training entities or use fewer name words")
    return train + test, twin


def gold_query(name: str) -> str:
    """The sub-query that finds ``name``'s code."""
    return RELATIONS["code"].query.format(s=name)


def surname_query(name: str) -> str:
    """The careless query that drops the first name: it finds the entity or its decoy."""
    return RELATIONS["code"].query.format(s=name.split(" ")[-1])


def _code(rng: random.Random, digits: int, avoid: str = "") -> str:
    while True:
        code = str(rng.randrange(10 ** digits)).zfill(digits)
        if code != avoid:
            return code


def answer_text(codes: Sequence[str]) -> str:
    """The answer of a question: its codes in order, comma-separated."""
    return ", ".join(codes)


def numbered(i: int, name: str) -> str:
    """How a question and the demonstrator's thinks name its ``i``-th entity (0-based): ``#2 Manos Limom``. The
    number is the token right before the name, so a policy finds the name to copy by one token."""
    return f"#{i + 1} {name}"


def _question_text(names: Sequence[str]) -> str:
    items = [numbered(i, n) for i, n in enumerate(names)]
    if len(items) == 1:
        return f"What is the code of {items[0]}?"
    return f"What are the codes of {', '.join(items[:-1])} and {items[-1]}?"


def make_lookup_world(cfg: ToyWorldConfig, rng: random.Random) -> tuple[dict, list, dict, dict]:
    """``(entities, passages, facts, splits)``: entities by name (``type``, ``relations: {"code": ...}``, ``split``,
    ``decoy_of`` for a decoy), ``(title, text)`` per passage in id order, ``"name|code"`` → passage ids, and the
    ``train`` / ``test`` questions as ``(question, gold answers, hops, turn budget)``."""
    lk = cfg.lookup
    principals, twin = name_pool(lk, rng)
    ents: dict = {}
    pools: dict = {"train": [], "test": []}
    for i, (first, surname) in enumerate(principals):
        split = "train" if i < lk.entities else "test"
        name = f"{first} {surname}"
        ents[name] = {"type": "entity", "relations": {"code": _code(rng, lk.digits)}, "aliases": [], "split": split}
        pools[split].append(name)
        if rng.random() < lk.decoy_fraction:
            decoy = f"{twin[first]} {surname}"
            ents[decoy] = {"type": "entity", "relations": {"code": _code(rng, lk.digits, ents[name]["relations"]
                                                                         ["code"])},
                           "aliases": [], "split": split, "decoy_of": name}
            ents[name]["decoy"] = decoy
    order = list(ents)
    rng.shuffle(order)  # ids carry no hint of which entity, split or decoy a passage holds
    passages, facts = [], {}
    for pid, name in enumerate(order):
        passages.append((name, RELATIONS["code"].sentence.format(s=name, o=ents[name]["relations"]["code"])))
        facts[f"{name}|code"] = [str(pid)]
    namesakes: dict = {}  # surname -> every entity of it: a needed entity's decoys are its namesakes
    for name in ents:
        namesakes.setdefault(name.split(" ")[-1], []).append(name)
    n_test = int(round(cfg.test_fraction * cfg.num_questions))
    splits = {}
    for split, n in (("train", cfg.num_questions - n_test), ("test", n_test)):
        splits[split] = [_question(ents, facts, namesakes, rng.sample(pools[split], rng.randint(lk.min_k, lk.max_k)),
                                   lk) for _ in range(n)]
    return ents, passages, facts, splits


def _question(ents: dict, facts: dict, namesakes: dict, names: list, lk) -> tuple:
    hops = []
    for name in names:
        others = [n for n in namesakes[name.split(" ")[-1]] if n != name]
        hops.append({"query": gold_query(name), "answer": ents[name]["relations"]["code"], "aliases": [],
                     "subject": name, "relation": "code", "passage_ids": list(facts[f"{name}|code"]),
                     "decoy": ents[name].get("decoy"),
                     "decoy_ids": sorted((pid for n in others for pid in facts[f"{n}|code"]), key=int)})
    answer = answer_text([h["answer"] for h in hops])
    return _question_text(names), [answer], hops, lookup_turn_budget(lk, len(names))


def lookup_examples(splits: dict, data_source: str) -> dict:
    """``split`` → QAExample list; metadata: ``kind``, ``num_hops`` (K), ``hops``, ``turn_budget``."""
    return {split: [QAExample(f"{split}_{i}", q, answers, data_source,
                              {"kind": KIND, "num_hops": len(hops), "hops": hops, "turn_budget": budget})
                    for i, (q, answers, hops, budget) in enumerate(rows)]
            for split, rows in splits.items()}


def lookup_summary(cfg: ToyWorldConfig, entities: dict, passages: list, train: list, test: list) -> dict:
    """The counts the command line prints: entities by split, decoys, passages, questions by K."""
    ks = [len(question_hops(q)) for q in train + test]
    return {
        "kind": KIND, "seed": cfg.seed,
        "entities": {split: sum(e["split"] == split and "decoy_of" not in e for e in entities.values())
                     for split in ("train", "test")},
        "decoys": sum("decoy_of" in e for e in entities.values()),
        "passages": len(passages), "questions": len(ks), "train": len(train), "test": len(test),
        "questions_by_k": {str(k): ks.count(k) for k in range(cfg.lookup.min_k, cfg.lookup.max_k + 1)},
    }


def is_lookup(question: Union[QAExample, dict]) -> bool:
    """Whether ``question`` is a lookup-world question."""
    metadata = question.metadata if isinstance(question, QAExample) else question.get("metadata") or {}
    return metadata.get("kind") == KIND


def turn_budget(question: Union[QAExample, dict]):
    """The question's own turn budget (actions, the answer included), or None where it has none."""
    metadata = question.metadata if isinstance(question, QAExample) else question.get("metadata") or {}
    budget = metadata.get("turn_budget")
    return int(budget) if budget is not None else None


def decoy_passages(question: Union[QAExample, dict]) -> list[set[str]]:
    """For each needed entity, the ids of its decoy's passages (empty without a decoy)."""
    return [set(map(str, h.get("decoy_ids") or ())) for h in question_hops(question)]


def search_labels(question: Union[QAExample, dict], retrieved: Iterable[Iterable]) -> list[str]:
    """Per turn (``retrieved``: each turn's retrieved passage ids, in order): ``good`` if it retrieved a needed
    entity's passage no earlier turn had found; else ``harmful`` if it retrieved a needed entity's decoy; else
    ``wasted``. A question without decoy records (the chain world) has no harmful turns. Only search turns retrieve
    anything; a caller reads the labels of its search turns."""
    golds, decoys = gold_fact_passages(question), decoy_passages(question)
    found = [False] * len(golds)
    out = []
    for ids in retrieved:
        got = set(map(str, ids))
        new = [k for k, g in enumerate(golds) if not found[k] and not g.isdisjoint(got)]
        for k in new:
            found[k] = True
        if new:
            out.append(GOOD)
        elif any(not d.isdisjoint(got) for d in decoys):
            out.append(HARMFUL)
        else:
            out.append(WASTED)
    return out
