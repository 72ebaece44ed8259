"""The batched retriever: row alignment, Search-R1's observation format as text and as tokens,
length caps, Search-R1 assets as is, the config entry, and MiniLM on the toy world."""
import dataclasses
import os

import faiss
import numpy as np
import pytest
import torch

from fastcredit.config import RetrievalConfig
from fastcredit.retrieval.build import build_all
from fastcredit.retrieval.observation import PREFIX, SUFFIX, decode_all, format_observation, passages_to_string, unpack
from fastcredit.retrieval.retriever import from_config, open_retriever
from fastcredit.retrieval.testing import tiny_encoder, tiny_passages, tiny_policy_tokenizer, write_corpus

ODD = [("odd0", "Zürich", "Line one.\nLine two ✓"), ("odd1", "Spaces", "ends with spaces   ")]


def searchr1_observation(docs):
    """Search-R1's _passages2string + execute_predictions wrapping, transcribed from its source."""
    format_reference = ""
    for idx, doc_item in enumerate(docs):
        content = doc_item["document"]["contents"]
        title = content.split("\n")[0]
        text = "\n".join(content.split("\n")[1:])
        format_reference += f"Doc {idx+1}(Title: {title}) {text}\n"
    return f"\n\n<information>{format_reference.strip()}</information>\n\n"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("ret")
    passages = ODD + tiny_passages(300, seed=2)
    corpus = write_corpus(str(d / "corpus.jsonl"), passages)
    enc = tiny_encoder(dim=32, seed=5)
    enc_dir = str(d / "tiny-encoder")
    enc.model.save_pretrained(enc_dir)
    enc.tokenizer.save_pretrained(enc_dir)
    tok = tiny_policy_tokenizer(passages)
    build = build_all(corpus, str(d / "build"), encoder_obj=enc, chunk_size=128, progress=False)
    r = open_retriever(index=build, encoder=enc_dir, max_length=enc.max_length, tokenizer=tok, device="cpu",
                       progress=False)
    return dict(dir=d, corpus=corpus, passages=passages, enc=enc, enc_dir=enc_dir, tok=tok, build=build, r=r)


def test_a_passage_finds_itself(assets):
    r, passages = assets["r"], assets["passages"]
    rows = [2, 50, 301, 0]
    hits = r.search([r.corpus.contents(i) for i in rows], 4)
    for row, hs in zip(rows, hits):
        assert hs[0].row == row and hs[0].id == passages[row][0] and hs[0].score == pytest.approx(1.0, abs=1e-5)
        assert [h.score for h in hs] == sorted((h.score for h in hs), reverse=True)
        assert hs[0].span == r.token_store.span(row) and hs[0].contents == r.corpus.contents(row)
    assert hits[3][0].title == "Zürich" and hits[3][0].text == "Line one.\nLine two ✓"


def test_text_observations_match_searchr1(assets):
    r = assets["r"]
    queries = ["river castle engine", "Zürich", "violet harbor", "ends with spaces"]
    got = r.observations(queries, 3)
    for q, obs, hs in zip(queries, got, r.search(queries, 3)):
        assert obs == searchr1_observation([{"document": h.document(), "score": h.score} for h in hs])
        assert obs == format_observation(h.contents for h in hs)
        assert obs.startswith("\n\n<information>Doc 1(Title: \"") and obs.endswith("</information>\n\n")


def test_token_observations_decode_to_the_text(assets):
    r, tok = assets["r"], assets["tok"]
    rows = torch.tensor([[5, 0, 7], [9, 10, 11], [1, 40, 2], [3, -1, 4]])  # -1: a missing passage is skipped
    ids, cu = r.observation_tokens(None, 3, rows=rows)
    texts = decode_all(tok, unpack(ids, cu))
    for row_list, text in zip(rows.tolist(), texts):
        contents = [r.corpus.contents(i) for i in row_list if i >= 0]
        assert text == format_observation(contents)
    # NOTE: Search-R1 strips the joined passages, which also drops trailing spaces of the last
    # passage's text; the token path keeps them (only the final newline is left out).
    last_spaces = decode_all(tok, unpack(*r.observation_tokens(None, 2, rows=torch.tensor([[0, 1]]))))[0]
    body = passages_to_string([r.corpus.contents(0), r.corpus.contents(1)])
    assert (last_spaces == PREFIX + body[:-1] + SUFFIX
            != format_observation([r.corpus.contents(0), r.corpus.contents(1)]))


def test_length_caps_keep_the_wrappers(assets):
    r, tok = assets["r"], assets["tok"]
    queries = ["river", "castle engine violet", "harbor"]
    wrap_p, wrap_s = r.template.prefix.tolist(), r.template.suffix.tolist()
    for cap, limit in ((0, None), (3, None), (8, 40), (None, 25), (None, r.template.wrapper_len)):
        ids, cu = r.observation_tokens(queries, 3, cap, limit)
        for seq in unpack(ids, cu):
            assert seq[:len(wrap_p)] == wrap_p and seq[-len(wrap_s):] == wrap_s
            if limit is not None:
                assert len(seq) <= limit
        assert r.observations(queries, 3, cap, limit) == decode_all(tok, unpack(ids, cu))
    headers_only = r.observations(["river"], 3, max_passage_tokens=0)[0]
    assert headers_only == "\n\n<information>Doc 1\nDoc 2\nDoc 3</information>\n\n"
    with pytest.raises(ValueError, match="cannot hold the wrappers"):
        r.observation_tokens(queries, 3, None, r.template.wrapper_len - 1)


def test_more_passages_asked_than_exist(tmp_path):
    enc = tiny_encoder(dim=32, seed=5)
    corpus = write_corpus(str(tmp_path / "c.jsonl"), tiny_passages(4))
    build_all(corpus, str(tmp_path / "b"), encoder_obj=enc, progress=False)
    from fastcredit.retrieval.corpus import CorpusStore
    from fastcredit.retrieval.indexes import load_index
    from fastcredit.retrieval.retriever import Retriever

    r = Retriever(CorpusStore(str(tmp_path / "b" / "corpus")),
                  load_index(str(tmp_path / "b" / "tiny-bert-32-5_Flat.index")), enc)
    hits = r.search(["river", "castle"], 7)
    assert [len(h) for h in hits] == [4, 4]
    assert r.observations(["river"], 7)[0].count("Doc ") == 4
    with pytest.raises(ValueError, match="k must be at least 1"):
        r.search(["river"], 0)
    with pytest.raises(ValueError, match="need a tokenizer"):
        r.observation_tokens(["river"], 2)


def test_searchr1_assets_load_as_is(assets, tmp_path):
    """A corpus jsonl and an e5_Flat.index written the way Search-R1's index_builder writes it."""
    enc, corpus = assets["enc"], assets["corpus"]
    emb = enc.encode_passages([r for r in assets["r"].corpus.iter_contents()]).numpy()
    index = faiss.index_factory(emb.shape[1], "Flat", faiss.METRIC_INNER_PRODUCT)
    index.add(emb)
    path = str(tmp_path / "e5_Flat.index")
    faiss.write_index(index, path)
    queries = ["river castle", "walnut prism summit"]
    want = [[h.id for h in hs] for hs in assets["r"].search(queries, 5)]
    for index_type in ("flat", "torch"):
        r = open_retriever(corpus=corpus, index=path, encoder=assets["enc_dir"], max_length=enc.max_length,
                           index_type=index_type, device="cpu", progress=False)
        assert [[h.id for h in hs] for hs in r.search(queries, 5)] == want
    assert os.path.exists(tmp_path / "fastcredit_store" / "meta.json")  # the corpus store, beside the index


def test_from_config_builds_what_is_missing(assets, tmp_path):
    corpus = write_corpus(str(tmp_path / "c.jsonl"), tiny_passages(40, seed=3))
    cfg = RetrievalConfig(corpus=corpus, index=str(tmp_path / "idx" / "my.index"), encoder=assets["enc_dir"],
                          device="cpu", build_index="missing")  # asked for: a set index that is missing is built
    r = from_config(cfg, tokenizer=assets["tok"], progress=False)
    assert os.path.exists(tmp_path / "idx" / "my.index") and len(r.corpus) == 40
    assert r.search([r.corpus.contents(7)], 1)[0][0].row == 7
    again = from_config(dataclasses.replace(cfg, corpus=None), corpus=corpus, progress=False)
    assert again.search([r.corpus.contents(9)], 1)[0][0].row == 9
    with pytest.raises(ValueError, match="does not exist and no corpus"):
        open_retriever(index=str(tmp_path / "nowhere.index"))


@pytest.mark.slow
def test_minilm_finds_the_toy_worlds_gold_passages(tmp_path):
    from fastcredit.data.toyworld import ToyWorldConfig, generate_world, write_world

    names = {f.name for f in dataclasses.fields(ToyWorldConfig)}
    small = dict(seed=1, num_people=60, num_cities=15, num_countries=5, num_universities=6, num_companies=20,
                 num_bands=10, num_questions=40)
    world = generate_world(ToyWorldConfig(**{k: v for k, v in small.items() if k in names}))
    write_world(world, str(tmp_path))
    r = open_retriever(corpus=str(tmp_path / "corpus.jsonl"), encoder="minilm", device="cpu", progress=False)
    hops = [h for q in world.questions for h in q.metadata["hops"]]
    hits = r.search([h["query"] for h in hops], 3)
    found = np.mean([bool(set(map(str, h["passage_ids"])) & {x.id for x in hs}) for h, hs in zip(hops, hits)])
    assert found >= 0.9, f"MiniLM found the gold passage of only {found:.0%} of the hop sub-queries"


def test_closed_book_searchers_show_nothing_or_random_passages(assets):
    """eval.observations: ``none`` answers with an empty information block, ``shuffled`` with k random passages of
    the corpus (the same ones for the same query and seed), both in the real observations' format."""
    from fastcredit.retrieval.searcher import ablated_searcher, retriever_searcher

    r, tok = assets["r"], assets["tok"]
    real = retriever_searcher(r, 3, 64, 400)
    assert ablated_searcher("real", real, r, tok, 3, 64, 400) is real
    queries = ["river castle engine", "violet harbor", "river castle engine"]
    blank = ablated_searcher("none", real, r, tok, 3, 64, 400)(queries)
    assert [tok.decode(ids, skip_special_tokens=False) for ids, _ in blank] == [PREFIX + SUFFIX] * 3
    assert all(ids == [] for _, ids in blank)
    shuffled = ablated_searcher("shuffled", real, r, tok, 3, 64, 400, seed=4)
    got = shuffled(queries)
    honest = real(queries)
    for (obs, ids), (_, true_ids) in zip(got, honest):
        assert len(ids) == 3 and tok.decode(obs, skip_special_tokens=False).startswith(PREFIX + "Doc 1(Title:")
        assert ids != true_ids
    assert got[0] == got[2] != got[1]  # the same query draws the same passages; another query others
    assert shuffled(queries) == got and ablated_searcher("shuffled", real, r, tok, 3, 64, 400, seed=5)(queries) != got
    with pytest.raises(ValueError, match="unknown observations mode"):
        ablated_searcher("hidden", real, r, tok, 3, 64, 400)
