"""Loaders: Search-R1 parquet, FlashRAG jsonl, corpus jsonl; errors name file, line and field."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fastcredit.data.loaders import (
    DataError,
    QAExample,
    iter_corpus,
    load_flashrag_jsonl,
    load_qa,
    load_searchr1_parquet,
    load_split,
    write_searchr1_parquet,
)


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_searchr1_parquet_layout(tmp_path):
    # The nq_hotpotqa_train layout: golden answers may only be in reward_model.ground_truth.target.
    table = pa.Table.from_pylist([
        {"id": "train_0", "question": "who wrote hamlet", "golden_answers": ["Shakespeare"], "data_source": "nq",
         "prompt": [{"role": "user", "content": "..."}], "ability": "fact-reasoning",
         "reward_model": {"style": "rule", "ground_truth": {"target": ["Shakespeare"]}},
         "extra_info": {"split": "train", "index": 0}},
    ])
    pq.write_table(table, tmp_path / "a.parquet")
    (ex,) = load_qa(str(tmp_path / "a.parquet"))
    assert (ex.id, ex.question, ex.golden_answers, ex.data_source) == ("train_0", "who wrote hamlet", ["Shakespeare"], "nq")
    table = table.drop_columns(["golden_answers"])
    pq.write_table(table, tmp_path / "b.parquet")
    assert load_searchr1_parquet(str(tmp_path / "b.parquet"))[0].golden_answers == ["Shakespeare"]


def test_write_then_read_parquet(tmp_path):
    exs = [QAExample("q1", "Where?", ["Here", "there"], "toy", {"hops": [{"query": "x"}]})]
    write_searchr1_parquet(exs, str(tmp_path / "t.parquet"), "train")
    back = load_qa(str(tmp_path / "t.parquet"))
    assert back == exs
    row = pq.read_table(tmp_path / "t.parquet").to_pylist()[0]
    assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].endswith("Question: Where?\n")
    assert row["reward_model"]["ground_truth"]["target"] == ["Here", "there"]


def test_flashrag_jsonl(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"id": 1, "question": "q?", "golden_answers": ["a"], "metadata": {"k": 1}}, ""])
    (ex,) = load_flashrag_jsonl(p)
    assert (ex.id, ex.golden_answers, ex.metadata) == ("1", ["a"], {"k": 1})


@pytest.mark.parametrize(
    "rows, message",
    [
        (['{"question": "q", "golden_answers": ["a"]}', "{not json"], r"d.jsonl line 2: invalid JSON"),
        ([{"golden_answers": ["a"]}], r"d.jsonl line 1: missing field 'question'"),
        ([{"question": "q"}], r"line 1: missing field 'golden_answers'"),
        ([{"question": "q", "golden_answers": [1, 2]}], r"line 1: field 'golden_answers' must be a non-empty list"),
        ([{"question": "q", "golden_answers": []}], r"'golden_answers' must be a non-empty list"),
        ([{"question": "", "golden_answers": ["a"]}], r"field 'question' must be a non-empty string"),
        (["[1, 2]"], r"line 1: expected a JSON object"),
        ([{"question": "q", "golden_answers": ["a"], "metadata": 3}], r"'metadata' must be a mapping"),
    ],
)
def test_jsonl_errors_name_line_and_field(tmp_path, rows, message):
    with pytest.raises(DataError, match=message):
        load_flashrag_jsonl(_jsonl(tmp_path / "d.jsonl", rows))


def test_file_errors(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: no such file"):
        load_qa(str(tmp_path / "nope.jsonl"))
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="bad.parquet: cannot read as parquet"):
        load_qa(str(tmp_path / "bad.parquet"))
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(DataError, match="bin.jsonl: not UTF-8"):
        load_qa(str(tmp_path / "bin.jsonl"))
    with pytest.raises(DataError, match="cannot tell the format"):
        load_qa(str(tmp_path / "x.csv"))
    pq.write_table(pa.Table.from_pylist([{"question": "q", "golden_answers": ["a"]}, {"question": None}]), tmp_path / "r.parquet")
    with pytest.raises(DataError, match=r"r.parquet row 1: missing field 'question'"):
        load_qa(str(tmp_path / "r.parquet"))
    with pytest.raises(DataError, match="data.train_path is required"):
        load_split("searchr1", None, "", "train")


def test_corpus(tmp_path):
    p = _jsonl(tmp_path / "c.jsonl", [{"id": "0", "contents": '"Paris"\nParis is the capital.'},
                                      {"id": 5, "contents": "no title line"}])
    assert list(iter_corpus(p)) == [("0", "Paris", "Paris is the capital."), ("5", "", "no title line")]
    bad = _jsonl(tmp_path / "e.jsonl", [{"id": "0", "text": "x"}])
    with pytest.raises(DataError, match="e.jsonl line 1: missing field 'contents'"):
        list(iter_corpus(bad))
