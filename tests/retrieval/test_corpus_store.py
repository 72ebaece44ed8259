"""The memory-mapped corpus store and the token store."""
import json
import os

import numpy as np
import pytest
import torch

from fastcredit.retrieval.corpus import CorpusError, CorpusStore, build_corpus_store, open_corpus_store
from fastcredit.retrieval.testing import tiny_passages, tiny_policy_tokenizer, write_corpus
from fastcredit.retrieval.tokstore import TokenStore, TokenStoreError, build_token_store, open_token_store

ODD = [  # multi-line text, no title line, unicode, empty text, quotes inside the title
    ("a", "Zürich", "Line one.\nLine two.\n\nLine four ✓"),
    ("b", "", "no title here"),
    ("c", 'He said "hi"', ""),
    ("d", "Tab\tTitle", "text with trailing spaces   "),
]


def jsonl_rows(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    path = write_corpus(str(d / "c.jsonl"), ODD + tiny_passages(300, seed=1))
    with open(path, "a", encoding="utf-8") as fh:  # a row without a title line, as some corpora have
        fh.write(json.dumps({"id": "raw", "contents": "just one line"}) + "\n")
    return path, build_corpus_store(path, str(d / "store"), progress=False)


def test_rows_match_the_jsonl(corpus):
    path, store = corpus
    rows = jsonl_rows(path)
    assert len(store) == len(rows) == 305 and not store.meta["ids_are_rows"]
    for i, row in enumerate(rows):
        c = row["contents"]
        assert store.contents(i) == c and store.id(i) == row["id"] and store.document(i) == row
        # Search-R1's split, spelled the way its generation code does it.
        assert store.title_and_text(i) == (c.split("\n")[0], "\n".join(c.split("\n")[1:]))
        assert store.row_of(row["id"]) == i
    assert store.title(0) == "Zürich" and store.text(0).endswith("✓") and store.title(2) == 'He said "hi'
    assert store.title_and_text(304) == ("just one line", "")
    assert list(store.rows_of(["d", "a"])) == [3, 0]


def test_unknown_ids_and_rows_are_named(corpus):
    _, store = corpus
    with pytest.raises(KeyError, match="'nope'"):
        store.row_of("nope")
    with pytest.raises(IndexError, match="row 305 out of range"):
        store.contents(305)


def test_ids_that_are_row_numbers_need_no_table(tmp_path):
    path = write_corpus(str(tmp_path / "c.jsonl"), tiny_passages(50), ids_are_rows=True)
    store = build_corpus_store(path, str(tmp_path / "s"), progress=False)
    assert store.meta["ids_are_rows"] and not os.path.exists(tmp_path / "s" / "id_hash.npy")
    assert store.row_of("17") == 17 and store.id(17) == "17"
    for bad in ("017", "50", "-1", "x"):
        with pytest.raises(KeyError):
            store.row_of(bad)


def test_flashrag_rows_and_errors_name_the_line(tmp_path):
    p = tmp_path / "f.jsonl"
    p.write_text(json.dumps({"id": 1, "title": "T", "text": "body"}) + "\n\n"
                 + json.dumps({"id": 2, "contents": "\"U\"\nx"}) + "\n")
    store = build_corpus_store(str(p), str(tmp_path / "s"), progress=False)
    assert store.contents(0) == '"T"\nbody' and store.id(0) == "1" and len(store) == 2
    cases = {'{"id": 1, "contents": "a"}\n{"id": 2, "contents": \n': "line 2: invalid JSON",
             '{"contents": "a"}\n': "line 1: missing field 'id'",
             '{"id": 3}\n': "line 1: missing string field 'contents'",
             '[1, 2]\n': "line 1: expected a JSON object"}
    for text, msg in cases.items():
        p.write_text(text)
        with pytest.raises(CorpusError, match=msg):
            build_corpus_store(str(p), str(tmp_path / "bad"), progress=False)
    p.write_text("")
    with pytest.raises(CorpusError, match="no passages"):
        build_corpus_store(str(p), str(tmp_path / "bad"), progress=False)
    with pytest.raises(CorpusError, match="not a corpus store"):
        CorpusStore(str(tmp_path))


def test_open_rebuilds_a_stale_store(tmp_path):
    path = write_corpus(str(tmp_path / "c.jsonl"), tiny_passages(20))
    store = open_corpus_store(path, str(tmp_path / "s"), progress=False)
    assert open_corpus_store(path, str(tmp_path / "s"), progress=False).meta["built_at"] == store.meta["built_at"]
    write_corpus(path, tiny_passages(25))
    assert len(open_corpus_store(path, str(tmp_path / "s"), progress=False)) == 25
    assert len(open_corpus_store(None, str(tmp_path / "s"))) == 25  # no jsonl: the store as it is
    with pytest.raises(CorpusError, match="no corpus store here"):
        open_corpus_store(None, str(tmp_path / "none"))


@pytest.fixture(scope="module")
def policy_tokenizer():
    return tiny_policy_tokenizer()


def test_token_store_holds_each_passage_piece(corpus, policy_tokenizer):
    _, store = corpus
    ts = build_token_store(store, policy_tokenizer, batch_size=64, progress=False)
    assert len(ts) == len(store) and ts.meta["num_tokens"] == len(ts.tokens)
    for row in (0, 1, 2, 3, 100, 304):
        piece = store.observation_piece(row)
        assert piece == f"(Title: {store.title_and_text(row)[0]}) {store.title_and_text(row)[1]}"
        assert ts.ids(row).tolist() == policy_tokenizer(piece, add_special_tokens=False)["input_ids"]
        assert policy_tokenizer.decode(ts.ids(row).tolist()) == piece
    tokens, offsets = ts.tensors("cpu")
    assert tokens.dtype == torch.int32 and offsets.dtype == torch.int64 and offsets.shape == (len(store) + 1,)
    assert ts.tensors("cpu")[0] is tokens  # cached, not copied again
    assert np.array_equal(offsets.numpy(), np.asarray(ts.offsets))


def test_token_store_is_bound_to_its_tokenizer(corpus, policy_tokenizer):
    _, store = corpus
    ts = open_token_store(store, policy_tokenizer, progress=False)
    assert open_token_store(store, policy_tokenizer, progress=False).root == ts.root  # reused, not rebuilt
    other = tiny_policy_tokenizer(tiny_passages(50, seed=9), vocab_size=400)
    with pytest.raises(TokenStoreError, match="fingerprints differ"):
        TokenStore(ts.root, other)
    assert open_token_store(store, other, progress=False).root != ts.root  # side by side
