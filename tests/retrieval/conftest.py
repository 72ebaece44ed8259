"""The toy search the server tests share: 200 passages, a tiny random encoder (also saved as a
folder, so a server subprocess loads the same weights), its flat index, a retriever over it."""
import pytest

from fastcredit.retrieval.build import build_all
from fastcredit.retrieval.corpus import CorpusStore
from fastcredit.retrieval.indexes import load_index
from fastcredit.retrieval.retriever import Retriever
from fastcredit.retrieval.testing import tiny_encoder, tiny_passages, write_corpus


@pytest.fixture(scope="session")
def toy_search(tmp_path_factory):
    d = tmp_path_factory.mktemp("toy_search")
    passages = tiny_passages(200, seed=8)
    corpus = write_corpus(str(d / "c.jsonl"), passages)
    enc = tiny_encoder(dim=32, seed=9)
    enc_dir = str(d / "encoder")
    enc.model.save_pretrained(enc_dir)
    enc.tokenizer.save_pretrained(enc_dir)
    build = build_all(corpus, str(d / "b"), encoder_obj=enc, progress=False)
    retriever = Retriever(CorpusStore(f"{build}/corpus"), load_index(f"{build}/tiny-bert-32-9_Flat.index"), enc)
    return dict(passages=passages, build=build, enc_dir=enc_dir, retriever=retriever)
