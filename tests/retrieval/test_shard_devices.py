"""Where an index's shards go: from the process's own GPU, consecutive, wrapping (fastcredit.retrieval.indexes)."""
import pytest
import torch

from fastcredit.retrieval.indexes import shard_devices


def test_one_shard_is_the_process_own_gpu():
    assert shard_devices(3, 1, 8) == [3]
    assert [shard_devices(rank, 1, 8) for rank in range(8)] == [[r] for r in range(8)]


def test_shards_are_consecutive_from_the_own_gpu_and_wrap():
    assert shard_devices(0, 4, 8) == [0, 1, 2, 3]
    assert shard_devices(6, 4, 8) == [6, 7, 0, 1]
    assert shard_devices(2, 0, 4) == [2, 3, 0, 1]  # 0: every visible GPU (a standalone server)
    assert shard_devices(0, 0, 8) == list(range(8))  # the server's default, as before


def test_impossible_placements_say_why():
    with pytest.raises(ValueError, match="only 2 CUDA devices"):
        shard_devices(0, 3, 2)
    with pytest.raises(ValueError, match="cuda:5 is not one of the 4"):
        shard_devices(5, 1, 4)
    with pytest.raises(ValueError, match="no CUDA device"):
        shard_devices(0, 1, 0)


def test_make_searcher_puts_the_retriever_on_the_process_device(monkeypatch):
    import fastcredit.retrieval.retriever as retriever_mod
    from fastcredit.retrieval.searcher import make_searcher
    from fastcredit.config import load_config

    seen = []
    monkeypatch.setattr(retriever_mod, "from_config", lambda r, **kw: seen.append(kw["device"]) or object())
    cfg = load_config(None, ["retrieval.device=cuda"])
    make_searcher(cfg, None, "corpus.jsonl", device=torch.device("cuda:3"))
    make_searcher(cfg, None, "corpus.jsonl", device=torch.device("cpu"))
    make_searcher(cfg, None, "corpus.jsonl")
    make_searcher(load_config(None, ["retrieval.device=cpu"]), None, "corpus.jsonl", device=torch.device("cuda:3"))
    assert seen == ["cuda:3", None, None, None]  # None: retrieval.device as configured
