"""The toy world: determinism, answerability from the corpus, unambiguous questions, formats."""
import hashlib
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastcredit.data.loaders import iter_corpus, load_searchr1_parquet, load_toyworld
from fastcredit.data.toyworld import ToyWorldConfig, generate_world, hops_found, load_world, write_world
from fastcredit.rewards import exact_match

SMALL = dict(num_people=60, num_cities=15, num_countries=5, num_companies=20, num_universities=6, num_questions=80)


def _digest(folder):
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as fh:
            out[name] = hashlib.sha256(fh.read()).hexdigest()
    return out


def test_same_seed_same_bytes(tmp_path):
    cfg = ToyWorldConfig(seed=7, **SMALL)
    write_world(generate_world(cfg), str(tmp_path / "a"))
    write_world(generate_world(cfg), str(tmp_path / "b"))
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    write_world(generate_world(ToyWorldConfig(seed=8, **SMALL)), str(tmp_path / "c"))
    assert _digest(tmp_path / "a")["corpus.jsonl"] != _digest(tmp_path / "c")["corpus.jsonl"]


def test_default_size():
    w = generate_world()
    assert 2000 <= len(w.passages) <= 5000
    assert len(w.questions) == 1000 and len(w.split("test")) == 100
    assert {q["metadata"]["num_hops"] for q in w.questions} == {1, 2, 3}


@settings(max_examples=8)
@given(st.integers(0, 10_000))
def test_every_hop_is_stated_in_its_passages(seed):
    w = generate_world(ToyWorldConfig(seed=seed, **SMALL))
    text = {p.id: p.title + "\n" + p.text for p in w.passages}
    for q in w.questions:
        hops = q["metadata"]["hops"]
        assert 1 <= len(hops) <= 3
        for hop in hops:
            assert hop["passage_ids"]
            for pid in hop["passage_ids"]:
                assert hop["answer"] in text[pid] and hop["subject"] in text[pid]
        # the chain ends at the gold answer, and each hop starts where the last one ended
        assert hops[-1]["answer"] == q["golden_answers"][0]
        assert all(a["answer"] == b["subject"] for a, b in zip(hops, hops[1:]))


def test_questions_are_unambiguous_despite_twins():
    w = generate_world(ToyWorldConfig(seed=3, **SMALL))
    names = list(w.entities)
    twins = [a for a in names for b in names if a < b and len(a) == len(b) and sum(x != y for x, y in zip(a, b)) == 1]
    assert twins, "the world should contain one-letter-apart distractor entities"
    for q in w.questions:
        # the subject is named exactly once, and following its relations gives the gold answer
        subject = q["metadata"]["hops"][0]["subject"]
        cur = subject
        for hop in q["metadata"]["hops"]:
            cur = w.entities[cur]["relations"][hop["relation"]]
        assert exact_match(cur, q["golden_answers"]) == 1.0


def test_hops_found():
    q = {"metadata": {"hops": [{"passage_ids": ["3", "9"]}, {"passage_ids": ["4"]}]}}
    assert hops_found(q, ["9", "1"]) == [True, False]
    assert hops_found(q, []) == [False, False]


def test_files_use_searchr1_formats(tmp_path):
    world = generate_world(ToyWorldConfig(seed=1, **SMALL))
    summary = write_world(world, str(tmp_path))
    with open(tmp_path / "corpus.jsonl") as fh:
        first = json.loads(fh.readline())
    assert set(first) == {"id", "contents"} and first["contents"].startswith('"') and "\n" in first["contents"]
    assert len(list(iter_corpus(str(tmp_path / "corpus.jsonl")))) == summary["passages"]
    parquet = load_searchr1_parquet(str(tmp_path / "train.parquet"))
    jsonl = load_toyworld(str(tmp_path), "train")
    assert [(e.id, e.question, e.golden_answers, e.metadata) for e in parquet] == [
        (e.id, e.question, e.golden_answers, e.metadata) for e in jsonl]
    back = load_world(str(tmp_path))
    assert back.entities == world.entities and len(back.questions) == len(world.questions)
    assert [p.text for p in back.passages] == [p.text for p in world.passages]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="max_hops"):
        generate_world(ToyWorldConfig(max_hops=4))
    with pytest.raises(ValueError, match="too small"):
        generate_world(ToyWorldConfig(**{**SMALL, "num_questions": 100_000}))


def test_cli(tmp_path):
    out = subprocess.run([sys.executable, "-m", "fastcredit.data.toyworld", "--out", str(tmp_path), "--seed", "2",
                          "--num-people", "50", "--num-questions", "40", "--num-companies", "10"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["questions"] == 40
