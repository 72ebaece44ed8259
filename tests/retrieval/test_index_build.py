"""The build command: corpus → embeddings → index → token store, and resuming a killed build."""
import json
import os

import numpy as np
import pytest
import torch

from fastcredit.retrieval.build import EXIT_INCOMPLETE, BuildError, build_all, main
from fastcredit.retrieval.indexes import load_index
from fastcredit.retrieval.testing import tiny_encoder, tiny_passages, tiny_policy_tokenizer, write_corpus


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("build")
    corpus = write_corpus(str(d / "c.jsonl"), tiny_passages(230, seed=4))
    enc = tiny_encoder(dim=32, seed=6)
    full = build_all(corpus, str(d / "full"), encoder_obj=enc, chunk_size=50, progress=False)
    return d, corpus, enc, full


def chunk_bytes(out):
    emb = os.path.join(out, "embeddings")
    return {n: open(os.path.join(emb, n), "rb").read() for n in sorted(os.listdir(emb)) if n.startswith("chunk_")}


def test_interrupted_build_resumes_to_the_same_result(setup):
    d, corpus, enc, full = setup
    out = str(d / "resumed")
    assert build_all(corpus, out, encoder_obj=enc, chunk_size=50, max_chunks=2, progress=False) is None
    manifest = json.load(open(os.path.join(out, "embeddings", "manifest.json")))
    assert sorted(manifest["done"]) == ["0", "1"] and not os.path.exists(os.path.join(out, "build.json"))
    calls = []
    real = enc.encode_passages
    enc.encode_passages = lambda texts: calls.append(len(texts)) or real(texts)
    try:
        assert build_all(corpus, out, encoder_obj=enc, chunk_size=50, progress=False) == out
        assert calls == [50, 50, 30]  # only the three unfinished chunks were encoded
        calls.clear()
        build_all(corpus, out, encoder_obj=enc, chunk_size=50, progress=False)
        assert calls == []  # a finished build encodes nothing again
    finally:
        enc.encode_passages = real
    assert chunk_bytes(out) == chunk_bytes(full) and len(chunk_bytes(out)) == 5
    q = enc.encode_queries(["river castle", "walnut"])
    a = load_index(os.path.join(out, "tiny-bert-32-6_Flat.index")).search(q, 5)
    b = load_index(os.path.join(full, "tiny-bert-32-6_Flat.index")).search(q, 5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    info = json.load(open(os.path.join(out, "build.json")))
    assert info["num_passages"] == 230 and info["encoder"]["dim"] == 32 and info["index"] == "tiny-bert-32-6_Flat.index"


def test_changed_settings_refuse_to_mix_chunks(setup):
    d, corpus, enc, _ = setup
    out = str(d / "mixed")
    build_all(corpus, out, encoder_obj=enc, chunk_size=50, max_chunks=1, progress=False)
    with pytest.raises(BuildError, match=r"chunk_size: 50 -> 60"):
        build_all(corpus, out, encoder_obj=enc, chunk_size=60, progress=False)
    other = tiny_encoder(dim=32, seed=6, pooling="cls")
    with pytest.raises(BuildError, match=r"pooling: 'mean' -> 'cls'"):
        build_all(corpus, out, encoder_obj=other, chunk_size=50, progress=False)
    assert build_all(corpus, out, encoder_obj=other, chunk_size=60, overwrite=True, progress=False) == out
    assert len(chunk_bytes(out)) == 4


def test_approximate_index_types_build_and_load(setup):
    d, corpus, enc, _ = setup
    q = enc.encode_queries(["river castle"])
    for kind, name in (("hnsw", "tiny-bert-32-6_HNSW32.index"), ("ivfpq", "tiny-bert-32-6_IVFPQ.index")):
        out = str(d / kind)
        build_all(corpus, out, encoder_obj=enc, chunk_size=100, index_type=kind, pq_m=8, progress=False)
        s, i = load_index(os.path.join(out, name), kind).search(q, 3)
        assert i.shape == (1, 3) and (i >= 0).all()


def test_cli_builds_with_a_tokenizer_and_stops_early(setup, tmp_path):
    d, corpus, enc, _ = setup
    enc_dir, tok_dir = str(tmp_path / "enc"), str(tmp_path / "tok")
    enc.model.save_pretrained(enc_dir)
    enc.tokenizer.save_pretrained(enc_dir)
    tiny_policy_tokenizer(tiny_passages(50)).save_pretrained(tok_dir)
    out = str(tmp_path / "out")
    args = ["--corpus", corpus, "--out", out, "--encoder", enc_dir, "--max-length", "64", "--chunk-size", "100",
            "--tokenizer", tok_dir, "--device", "cpu", "--quiet"]
    assert main(args + ["--max-chunks", "1"]) == EXIT_INCOMPLETE
    assert main(args) == 0
    info = json.load(open(os.path.join(out, "build.json")))
    assert info["token_store"].startswith("corpus/tokens/tok-")
    offsets = np.load(os.path.join(out, info["token_store"], "offsets.npy"))
    assert len(offsets) == 231 and offsets[-1] > 230
