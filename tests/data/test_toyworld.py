"""The toy world: determinism, every answer derivable from the corpus, unambiguous questions, formats."""
import dataclasses
import hashlib
import json
import os
import re
import time
from collections import defaultdict

import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastcredit.data.loaders import DataError, QAExample, iter_corpus, load_qa, load_searchr1_parquet, load_toyworld
from fastcredit.data.prompts import build_prompt
from fastcredit.data.toyqa import QUESTIONS, RELATIONS, fact_recall, gold_fact_passages, hops_found, parse_facts
from fastcredit.data.toyworld import ToyWorldConfig, generate_world, load_world, write_world
from fastcredit.credit.rewards import exact_match, normalize_answer
from tests.commands import run_main

SMALL = dict(num_people=60, num_cities=15, num_countries=5, num_universities=6, num_companies=20, num_bands=10,
             num_questions=80)
FILES = ["corpus.jsonl", "summary.json", "test.jsonl", "test.parquet", "train.jsonl", "train.parquet", "world.json"]


def _digests(folder):
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in sorted(os.listdir(folder))}


def _fingerprint(world):
    return json.dumps([[p.contents for p in world.passages], [q.to_record() for q in world.questions]])


def _one_letter_apart(a, b):
    return len(a) == len(b) and sum(x != y for x, y in zip(a, b)) == 1


def test_same_config_gives_identical_files(tmp_path):
    cfg = ToyWorldConfig(seed=7, **SMALL)
    write_world(generate_world(cfg), str(tmp_path / "a"))
    write_world(generate_world(cfg), str(tmp_path / "b"))
    assert sorted(os.listdir(tmp_path / "a")) == FILES
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")
    write_world(generate_world(ToyWorldConfig(seed=8, **SMALL)), str(tmp_path / "c"))
    different = [n for n in FILES if _digests(tmp_path / "a")[n] != _digests(tmp_path / "c")[n]]
    assert set(different) >= {"corpus.jsonl", "train.jsonl", "test.jsonl", "world.json", "train.parquet"}


@settings(max_examples=10)
@given(st.integers(0, 2**31), st.integers(1, 2**31))
def test_worlds_follow_the_seed_only(seed, delta):
    world = generate_world(ToyWorldConfig(seed=seed, **SMALL))
    assert _fingerprint(world) == _fingerprint(generate_world(ToyWorldConfig(seed=seed, **SMALL)))
    assert _fingerprint(world) != _fingerprint(generate_world(ToyWorldConfig(seed=seed + delta, **SMALL)))


def test_default_size_and_speed():
    t0 = time.perf_counter()
    world = generate_world()
    elapsed = time.perf_counter() - t0
    assert elapsed < 3.0, f"default generation took {elapsed:.2f} s"
    assert 2000 <= len(world.passages) <= 5000
    assert (len(world.questions), len(world.train), len(world.test)) == (1000, 900, 100)
    by_hops = defaultdict(int)
    for q in world.questions:
        by_hops[q.metadata["num_hops"]] += 1
    assert set(by_hops) == {1, 2, 3} and min(by_hops.values()) > 250  # drawn uniformly over 1..3
    assert len({q.question for q in world.questions}) == 1000
    assert len({q.id for q in world.questions}) == 1000


def _check_answerable(world):
    text = {p.id: p.title + "\n" + p.text for p in world.passages}
    stated = defaultdict(set)  # (subject, relation, object) -> passages whose sentences state it
    for p in world.passages:
        for fact in parse_facts(p.text):
            stated[fact].add(p.id)
    corpus = "\n".join(text.values())
    for q in world.questions:
        hops = q.metadata["hops"]
        assert q.metadata["num_hops"] == len(hops) and 1 <= len(hops) <= world.config.max_hops
        assert hops[0]["subject"] in q.question
        for hop in hops:
            fact = (hop["subject"], hop["relation"], hop["answer"])
            expected = set(stated[fact])
            if hop["relation"] == "spouse":  # "Y is married to X" states the same marriage
                expected |= stated[(hop["answer"], "spouse", hop["subject"])]
            # the listed passages are exactly those stating the fact, and each names both ends
            assert set(hop["passage_ids"]) == expected != set()
            assert all(hop["answer"] in text[pid] and hop["subject"] in text[pid] for pid in hop["passage_ids"])
            assert hop["query"].startswith(hop["subject"])
        assert all(a["answer"] == b["subject"] for a, b in zip(hops, hops[1:]))
        assert q.golden_answers == [hops[-1]["answer"]] + hops[-1]["aliases"]
        assert all(alias in corpus for alias in q.golden_answers)


@settings(max_examples=12)
@given(st.integers(0, 2**31), st.sampled_from([0.0, 0.3, 1.0]), st.sampled_from([0.0, 0.25, 1.0]))
def test_every_answer_is_derivable_from_the_corpus(seed, twins, distractors):
    _check_answerable(generate_world(ToyWorldConfig(seed=seed, twin_fraction=twins, distractor_fraction=distractors,
                                                    **SMALL)))


def test_default_world_is_answerable_and_unambiguous():
    world = generate_world()
    _check_answerable(world)
    _check_unambiguous(world)


def _check_unambiguous(world):
    objects = defaultdict(set)
    for p in world.passages:
        for s, rel, o in parse_facts(p.text):
            objects[(s, rel)].add(o)
    # the corpus states at most one object per (subject, relation): no passage contradicts a gold hop
    assert all(len(v) == 1 for v in objects.values())
    owner = {}  # normalised name or alias -> entity; a clash would make EM accept a wrong entity
    for name, ent in world.entities.items():
        for label in [name] + ent["aliases"]:
            assert owner.setdefault(normalize_answer(label), name) == name
    names = sorted(world.entities, key=len, reverse=True)
    pattern = re.compile("|".join(r"\b" + re.escape(n) + r"\b" for n in names))
    for q in world.questions:
        # the question names exactly one entity, its subject; following the corpus's facts gives the gold answer
        subject = q.metadata["hops"][0]["subject"]
        assert pattern.findall(q.question) == [subject]
        cur = subject
        for hop in q.metadata["hops"]:
            (cur,) = objects[(cur, hop["relation"])]
        assert exact_match(cur, q.golden_answers) == 1.0
        # and no other entity's name or alias would also score as correct
        assert {owner[normalize_answer(g)] for g in q.golden_answers} == {cur}


def test_twins_are_distractors_with_their_own_passages():
    world = generate_world(ToyWorldConfig(seed=3, **SMALL))
    titles = {p.title for p in world.passages}
    twins = {n: e["twin_of"] for n, e in world.entities.items() if "twin_of" in e}
    assert len(twins) >= 10
    for twin, original in twins.items():
        assert _one_letter_apart(twin, original) and twin in titles and original in titles
        assert world.entities[twin]["type"] == world.entities[original]["type"]
    asked_about = {q.metadata["hops"][0]["subject"] for q in world.questions}
    assert asked_about & (set(twins) | set(twins.values()))
    assert not any("twin_of" in e for e in generate_world(ToyWorldConfig(twin_fraction=0.0, **SMALL)).entities.values())


def test_distractor_passages_state_no_facts():
    world = generate_world(ToyWorldConfig(seed=4, distractor_fraction=0.5, **SMALL))
    fact_ids = {pid for ids in world.facts.values() for pid in ids}
    distractors = [p for p in world.passages if p.id not in fact_ids]
    assert 0.3 * len(world.entities) < len(distractors) < 0.7 * len(world.entities)
    for p in distractors:
        assert parse_facts(p.text) == [] and p.title in world.entities
        assert any(n in p.text for n in world.entities if n != p.title)  # it names someone else
    assert all(parse_facts(world.passage(pid).text) for pid in fact_ids)
    plain = generate_world(ToyWorldConfig(seed=4, distractor_fraction=0.0, **SMALL))
    assert {pid for ids in plain.facts.values() for pid in ids} == {p.id for p in plain.passages}


def test_question_table_is_well_typed():
    for chain, template in QUESTIONS:
        assert template.count("{x}") == 1 and template.endswith("?") and 1 <= len(chain) <= 3
        assert all(RELATIONS[a].object == RELATIONS[b].subject for a, b in zip(chain, chain[1:]))
    for rel, r in RELATIONS.items():
        assert parse_facts(r.sentence.format(s="Aa Bb", o="Cc Dd")) == [("Aa Bb", rel, "Cc Dd")]


def test_max_hops_bounds_the_questions():
    for max_hops in (1, 2):
        world = generate_world(ToyWorldConfig(seed=5, max_hops=max_hops, **SMALL))
        assert {q.metadata["num_hops"] for q in world.questions} == set(range(1, max_hops + 1))


def test_min_hops_leaves_out_the_short_questions():
    world = generate_world(ToyWorldConfig(seed=5, min_hops=2, max_hops=3, **SMALL))
    assert {q.metadata["num_hops"] for q in world.questions} == {2, 3}
    with pytest.raises(ValueError, match=r"min_hops must be in \[1, max_hops = 2\], got 3"):
        generate_world(ToyWorldConfig(min_hops=3, max_hops=2, **SMALL))


def test_oracle_helpers():
    q = QAExample("q", "?", ["a"], "toyworld", {"hops": [{"passage_ids": ["3", "9"]}, {"passage_ids": ["4"]}]})
    assert gold_fact_passages(q) == [{"3", "9"}, {"4"}]
    assert hops_found(q, ["9", "1"]) == [True, False]
    assert hops_found(q.to_record(), [4, 3]) == [True, True]  # a jsonl record and int ids work too
    assert fact_recall(q, []) == 0.0 and fact_recall(q, ["9"]) == 0.5 and fact_recall(q, ["3", "4"]) == 1.0
    with pytest.raises(ValueError, match="no hop labels"):
        fact_recall(QAExample("r", "?", ["a"]), ["1"])
    world = generate_world(ToyWorldConfig(seed=6, **SMALL))
    for ex in world.questions[:20]:
        gold = set().union(*gold_fact_passages(ex))
        assert fact_recall(ex, gold) == 1.0
        assert fact_recall(ex, [p.id for p in world.passages if p.id not in gold]) == 0.0


def test_files_use_searchr1_and_flashrag_formats(tmp_path):
    world = generate_world(ToyWorldConfig(seed=1, **SMALL))
    summary = write_world(world, str(tmp_path))
    lines = (tmp_path / "corpus.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == summary["passages"] == len(world.passages)
    for row, line in enumerate(lines):
        rec = json.loads(line)
        assert set(rec) == {"id", "contents"} and rec["id"] == str(row)
        assert re.fullmatch(r'"[^"\n]+"\n[^\n]+', rec["contents"])
    assert [p for p, _, _ in iter_corpus(str(tmp_path / "corpus.jsonl"))] == [p.id for p in world.passages]
    record = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])
    assert set(record) == {"id", "question", "golden_answers", "data_source", "metadata"}
    assert record["data_source"] == "toyworld" and set(record["metadata"]) == {"hops", "num_hops"}
    assert set(record["metadata"]["hops"][0]) == {"query", "answer", "aliases", "subject", "relation", "passage_ids"}
    row = pq.read_table(tmp_path / "test.parquet").to_pylist()[2]
    q = world.test[2]
    assert row["prompt"] == [{"role": "user", "content": build_prompt(q.question)}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": {"target": q.golden_answers}}
    assert (row["ability"], row["extra_info"], row["data_source"]) == ("fact-reasoning", {"split": "test", "index": 2},
                                                                        "toyworld")
    for split in ("train", "test"):
        assert load_searchr1_parquet(str(tmp_path / f"{split}.parquet")) == world.split(split)
        assert load_toyworld(str(tmp_path), split) == world.split(split)
    assert load_qa(str(tmp_path), split="test") == world.test
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert summary["questions"] == summary["train"] + summary["test"] == 80 and summary["test"] == 8


def test_load_world_round_trip(tmp_path):
    world = generate_world(ToyWorldConfig(seed=2, **SMALL))
    write_world(world, str(tmp_path / "nested" / "dir"))
    back = load_world(str(tmp_path / "nested" / "dir"))
    assert dataclasses.asdict(back.config) == dataclasses.asdict(world.config)
    assert (back.entities, back.facts, back.passages) == (world.entities, world.facts, world.passages)
    assert (back.train, back.test) == (world.train, world.test)
    assert back.passage("5") == world.passages[5]


def test_load_world_errors(tmp_path):
    with pytest.raises(DataError, match=r"world\.json: no such file"):
        load_world(str(tmp_path))
    (tmp_path / "world.json").write_text("{")
    with pytest.raises(DataError, match=r"world\.json: not a readable toy world"):
        load_world(str(tmp_path))
    (tmp_path / "world.json").write_text(json.dumps({"config": {"seeds": 1}, "entities": {}, "facts": {}}))
    with pytest.raises(DataError, match=r"world\.json: not a readable toy world \(TypeError"):
        load_world(str(tmp_path))


@pytest.mark.parametrize("overrides, message", [
    (dict(max_hops=4), r"max_hops must lie in \[1, 3\]"),
    (dict(max_hops=0), r"max_hops must lie in \[1, 3\]"),
    (dict(num_countries=0), r"num_countries must lie in \[1, inf\)"),
    (dict(num_cities=3), r"num_cities \(3\) must be at least num_countries \(5\)"),
    (dict(test_fraction=1.0), r"test_fraction must lie in \[0, 1\)"),
    (dict(twin_fraction=1.5), r"twin_fraction must lie in \[0, 1\]"),
    (dict(num_questions=100_000), "too small for 100000 distinct questions"),
])
def test_bad_configs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        generate_world(ToyWorldConfig(**{**SMALL, **overrides}))


def test_cli(tmp_path):
    cmd = ["--out", str(tmp_path / "w"), "--seed", "2", "--num-people", "50", "--num-companies", "10",
           "--num-questions", "40", "--test-fraction", "0.25"]
    out = run_main("fastcredit.data.toyworld", cmd)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert (summary["questions"], summary["test"], summary["seed"]) == (40, 10, 2)
    assert sorted(os.listdir(tmp_path / "w")) == FILES
    out = run_main("fastcredit.data.toyworld", cmd + ["--max-hops", "5"])
    assert out.returncode == 2 and "max_hops must lie in [1, 3]" in out.stderr
