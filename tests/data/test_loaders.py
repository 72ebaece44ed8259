"""Loaders: Search-R1 parquet, FlashRAG jsonl, the corpus; every error names file, line/row and field."""
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastcredit.data.loaders import (
    DataError,
    QAExample,
    iter_corpus,
    load_flashrag_jsonl,
    load_qa,
    load_searchr1_parquet,
    load_split,
    load_toyworld,
    parse_example,
    write_searchr1_parquet,
)
from fastcredit.data.prompts import build_prompt

SEARCHR1_COLUMNS = ["id", "question", "golden_answers", "data_source", "prompt", "ability", "reward_model",
                    "extra_info", "metadata"]


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _searchr1_row(i, question, answers, source="nq", **extra):
    row = {"id": f"train_{i}", "question": question, "golden_answers": answers, "data_source": source,
           "prompt": [{"role": "user", "content": build_prompt(question)}], "ability": "fact-reasoning",
           "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
           "extra_info": {"split": "train", "index": i}}
    row.update(extra)
    return row


def test_searchr1_parquet_layout(tmp_path):
    # As nq_search.py writes it: FlashRAG's columns kept, Search-R1's added; hotpotqa rows carry metadata.
    rows = [_searchr1_row(0, "who wrote hamlet?", ["Shakespeare", "William Shakespeare"], metadata=None),
            _searchr1_row(1, "which city is older?", ["Rome"], "hotpotqa",
                          metadata={"type": "comparison", "level": "hard"})]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    a, b = load_qa(str(tmp_path / "a.parquet"))
    assert (a.id, a.question, a.golden_answers, a.data_source) == (
        "train_0", "who wrote hamlet?", ["Shakespeare", "William Shakespeare"], "nq")
    assert b.metadata == {"type": "comparison", "level": "hard"} and a.metadata == {}


def test_searchr1_answers_and_question_fallbacks(tmp_path):
    # Files made by other Search-R1 forks keep only the prompt and reward_model.
    table = pa.Table.from_pylist([_searchr1_row(0, "who wrote hamlet?", ["Shakespeare"])])
    table = table.drop_columns(["golden_answers", "question", "id"])
    pq.write_table(table, tmp_path / "b.parquet")
    (ex,) = load_searchr1_parquet(str(tmp_path / "b.parquet"))
    assert (ex.id, ex.question, ex.golden_answers) == ("0", "who wrote hamlet?", ["Shakespeare"])


def test_numpy_answers_become_lists_of_str():
    ex = parse_example({"question": "q", "golden_answers": np.array(["a", "b"], dtype=object)}, "here", 0)
    assert ex.golden_answers == ["a", "b"] and all(type(a) is str for a in ex.golden_answers)
    ex = parse_example({"question": "q", "reward_model": {"ground_truth": {"target": np.array(["x"])}}}, "here", 3)
    assert (ex.id, ex.golden_answers) == ("3", ["x"])
    ex = parse_example({"question": "q", "golden_answers": ["1998", 1998]}, "here", 0)
    assert ex.golden_answers == ["1998", "1998"]


_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20).filter(lambda s: s.strip())
_examples = st.lists(st.builds(
    QAExample, id=_text, question=_text, golden_answers=st.lists(_text, min_size=1, max_size=3),
    data_source=st.sampled_from(["nq", "hotpotqa", "toyworld"]),
    metadata=st.dictionaries(_text, st.integers() | _text | st.lists(st.integers(), max_size=2), max_size=3),
), max_size=4)


@settings(max_examples=25)
@given(_examples)
def test_written_files_read_back_unchanged(tmp_path_factory, examples):
    folder = tmp_path_factory.mktemp("rt")
    write_searchr1_parquet(examples, str(folder / "t.parquet"), split="test")
    assert load_qa(str(folder / "t.parquet")) == examples
    jsonl = _jsonl(folder / "t.jsonl", [ex.to_record() for ex in examples])
    assert load_qa(jsonl) == examples


def test_written_parquet_has_searchr1_columns(tmp_path):
    ex = QAExample("q1", "Where?", ["Here", "there"], "toyworld", {"hops": [{"query": "x"}]})
    write_searchr1_parquet([ex], str(tmp_path / "t.parquet"), split="test")
    table = pq.read_table(tmp_path / "t.parquet")
    assert table.column_names == SEARCHR1_COLUMNS
    row = table.to_pylist()[0]
    assert row["prompt"] == [{"role": "user", "content": build_prompt("Where?")}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": {"target": ["Here", "there"]}}
    assert (row["ability"], row["extra_info"]) == ("fact-reasoning", {"split": "test", "index": 0})
    write_searchr1_parquet([ex], str(tmp_path / "u.parquet"), prompt_fn=str.upper)
    assert pq.read_table(tmp_path / "u.parquet").to_pylist()[0]["prompt"][0]["content"] == "WHERE?"
    assert sorted(os.listdir(tmp_path)) == ["t.parquet", "u.parquet"]  # no temporary left behind


def test_flashrag_jsonl(tmp_path):
    (tmp_path / "nq").mkdir()
    p = _jsonl(tmp_path / "nq" / "test.jsonl", [
        {"id": 1, "question": "q?", "golden_answers": ["a"], "metadata": {"k": 1}}, "",
        {"question": "r?", "golden_answers": "b", "data_source": "other"},
    ])
    a, b = load_flashrag_jsonl(p)
    assert (a.id, a.golden_answers, a.metadata, a.data_source) == ("1", ["a"], {"k": 1}, "nq")
    assert (b.id, b.golden_answers, b.metadata, b.data_source) == ("1", ["b"], {}, "other")
    assert load_flashrag_jsonl(p, default_source="x")[0].data_source == "x"
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"question": "q", "golden_answers": ["a"]}\n')
    assert load_flashrag_jsonl(str(tmp_path / "bom.jsonl"))[0].question == "q"


@pytest.mark.parametrize("rows, message", [
    (['{"question": "q", "golden_answers": ["a"]}', "{not json"], r"d\.jsonl line 2: invalid JSON"),
    (["[1, 2]"], r"d\.jsonl line 1: expected a JSON object, got list"),
    ([{"golden_answers": ["a"]}], r"d\.jsonl line 1: missing field 'question'"),
    ([{"question": 5, "golden_answers": ["a"]}], r"line 1: field 'question' must be a string, got int"),
    ([{"question": " ", "golden_answers": ["a"]}], r"line 1: field 'question' must be a non-empty string"),
    (["", {"question": "q"}], r"line 2: missing field 'golden_answers'"),
    ([{"question": "q", "golden_answers": []}], r"line 1: field 'golden_answers' must be a non-empty list"),
    ([{"question": "q", "golden_answers": 7}], r"line 1: field 'golden_answers' must be a non-empty list"),
    ([{"question": "q", "golden_answers": ["a", {"b": 1}]}],
     r"line 1: field 'golden_answers' must hold strings, got dict"),
    ([{"question": "q", "golden_answers": [True]}], r"field 'golden_answers' must hold strings, got bool"),
    ([{"id": [1], "question": "q", "golden_answers": ["a"]}],
     r"line 1: field 'id' must be a string or an integer, got list"),
    ([{"id": True, "question": "q", "golden_answers": ["a"]}],
     r"field 'id' must be a string or an integer, got bool"),
    ([{"question": "q", "golden_answers": ["a"], "data_source": 3}],
     r"line 1: field 'data_source' must be a string"),
    ([{"question": "q", "golden_answers": ["a"], "metadata": [1]}],
     r"line 1: field 'metadata' must be a mapping, got list"),
    ([{"question": "q", "golden_answers": ["a"], "metadata": "{x"}],
     r"field 'metadata' is a string but not valid JSON"),
])
def test_jsonl_errors_name_line_and_field(tmp_path, rows, message):
    with pytest.raises(DataError, match=message):
        load_flashrag_jsonl(_jsonl(tmp_path / "d.jsonl", rows))


def test_target_fallback_error_names_the_nested_field(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"question": "q", "reward_model": {"ground_truth": {"target": 3}}}])
    with pytest.raises(DataError, match=r"line 1: field 'reward_model.ground_truth.target' must be a non-empty list"):
        load_flashrag_jsonl(p)


def test_file_errors(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file"):
        load_qa(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match=r"nope\.parquet: no such file"):
        load_qa(str(tmp_path / "nope.parquet"))
    (tmp_path / "adir.jsonl").mkdir()
    with pytest.raises(DataError, match=r"adir\.jsonl: cannot read"):
        load_flashrag_jsonl(str(tmp_path / "adir.jsonl"))
    (tmp_path / "bin.jsonl").write_bytes(b'{"question": "q", "golden_answers": ["a"]}\n\n\xff\xfe\n')
    with pytest.raises(DataError, match=r"bin\.jsonl line 3: not UTF-8"):
        load_qa(str(tmp_path / "bin.jsonl"))
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"bad\.parquet: cannot read as parquet"):
        load_qa(str(tmp_path / "bad.parquet"))


def test_parquet_errors_name_row_and_field(tmp_path):
    rows = [{"question": "q", "golden_answers": ["a"]}, {"question": None, "golden_answers": ["a"]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "r.parquet")
    with pytest.raises(DataError, match=r"r\.parquet row 1: missing field 'question'"):
        load_qa(str(tmp_path / "r.parquet"))
    pq.write_table(pa.Table.from_pylist([{"question": "q", "golden_answers": [1.5], "id": 2.5}]),
                   tmp_path / "s.parquet")
    with pytest.raises(DataError, match=r"s\.parquet row 0: field 'id' must be a string or an integer, got float"):
        load_qa(str(tmp_path / "s.parquet"))


def test_format_dispatch(tmp_path):
    row = {"id": "x", "question": "q?", "golden_answers": ["a"]}
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "train.parquet")
    _jsonl(tmp_path / "test.jsonl", [row])
    _jsonl(tmp_path / "odd.txt", [row])
    assert load_qa(str(tmp_path))[0].id == "x"  # folder: <split>.parquet
    assert load_qa(str(tmp_path), split="test")[0].question == "q?"  # folder: <split>.jsonl
    assert load_qa(str(tmp_path / "odd.txt"), fmt="jsonl")[0].id == "x"
    assert load_split("searchr1", str(tmp_path / "train.parquet"), "", "train")[0].id == "x"
    assert load_split("flashrag", str(tmp_path), "", "test")[0].id == "x"
    with pytest.raises(DataError, match=r"odd\.txt: cannot tell the format"):
        load_qa(str(tmp_path / "odd.txt"))
    with pytest.raises(DataError, match="unknown format 'csv'; valid: auto, parquet, jsonl, toyworld"):
        load_qa(str(tmp_path / "odd.txt"), fmt="csv")
    with pytest.raises(DataError, match=r"a folder without world\.json or dev\.parquet, dev\.jsonl"):
        load_qa(str(tmp_path), split="dev")
    with pytest.raises(DataError, match="data.train_path is required for data.source=searchr1"):
        load_split("searchr1", None, "", "train")
    with pytest.raises(DataError, match="unknown data.source 'hf'"):
        load_split("hf", "x", "", "train")
    with pytest.raises(DataError, match="unknown toy-world split 'dev'"):
        load_toyworld(str(tmp_path), "dev")


def test_corpus(tmp_path):
    p = _jsonl(tmp_path / "c.jsonl", [
        {"id": "0", "contents": '"Paris"\nParis is the capital.\nIt is on the Seine.'},
        {"id": 5, "contents": "no title line"},
        {"id": "7", "contents": '""Weird Al" Yankovic"\nA musician.'},
        {"id": "8", "contents": "Bare title\n"},
    ])
    assert list(iter_corpus(p)) == [
        ("0", "Paris", "Paris is the capital.\nIt is on the Seine."),
        ("5", "", "no title line"),
        ("7", '"Weird Al" Yankovic', "A musician."),
        ("8", "Bare title", ""),
    ]


@pytest.mark.parametrize("row, message", [
    ({"id": "0", "text": "x"}, r"e\.jsonl line 3: missing field 'contents'"),
    ({"id": "0", "contents": ["x"]}, r"e\.jsonl line 3: field 'contents' must be a string, got list"),
    ({"contents": "x"}, r"e\.jsonl line 3: missing field 'id'"),
    ({"id": {"a": 1}, "contents": "x"}, r"e\.jsonl line 3: field 'id' must be a string or an integer"),
])
def test_corpus_errors_stream(tmp_path, row, message):
    good = {"id": "0", "contents": '"T"\nt'}
    rows = iter_corpus(_jsonl(tmp_path / "e.jsonl", [good, good, row]))
    assert next(rows) == next(rows) == ("0", "T", "t")  # the good lines come out before the bad one is read
    with pytest.raises(DataError, match=message):
        next(rows)
