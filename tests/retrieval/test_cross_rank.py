"""Retrieval split across ranks (fastcredit.retrieval.ranks): two gloo ranks give what one flat index over
every row gives, ids and order, exact ties included; sessions that do not line up in time; one-shot
searches; failures that raise instead of hanging; IVF-PQ split by id range; the retriever end to end.

The two-rank scenarios run in tests/retrieval/cross_rank.py under torchrun, once per module
(one launch for the scenarios that work, one for those that fail); each test reads its scenario.
"""
import json
import os
import sys

import faiss  # noqa: F401  (the script the tests run needs it)
import numpy as np
import pytest
import torch

from fastcredit.retrieval.exact import exact_scores, load_index_shard, rank_rows, sort_ties
from fastcredit.retrieval.indexes import FaissIndex, build_faiss_index, shard_bounds, write_index
from tests.commands import run_process

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "cross_rank.py")
N, D = 1201, 16  # shard_bounds(1201, 2) = [(0, 601), (601, 1201)]


def tied_vectors(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Unit vectors with exact ties: 23 copies of row 3 across the shard boundary (rows 590-612), and 22 different
    vectors scoring exactly 0.6 against e0 in both shards (below three at 0.7), so e0's k-th place falls in a tie."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, D)).astype(np.float32)
    x[:, 0] *= 0.1
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    x[590:613] = x[3]
    rest = rng.standard_normal((N, D - 1)).astype(np.float32)
    rest /= np.linalg.norm(rest, axis=1, keepdims=True)
    for rows, head in ((list(range(100, 111)) + list(range(700, 711)), 0.6), ([50, 650, 1100], 0.7)):
        x[rows, 0] = head
        x[rows, 1:] = np.sqrt(np.float32(1 - head * head)) * rest[rows]
    e0 = np.zeros((1, D), np.float32)
    e0[0, 0] = 1
    q = np.concatenate([x[[3, 600, 105]], e0, e0, x[rng.integers(0, N, 20)] + 0.05 * rng.standard_normal((20, D)),
                        rng.standard_normal((15, D))]).astype(np.float32)
    return x, q


def truth(x, q, k):
    s = exact_scores(q, torch.from_numpy(x).expand(q.shape[0], *x.shape)).numpy()
    order = np.lexsort((np.broadcast_to(np.arange(x.shape[0]), s.shape), -s))[:, :k]
    return torch.from_numpy(np.take_along_axis(s, order, 1)), torch.from_numpy(order).long()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("cross_rank")
    x, q = tied_vectors()
    np.save(d / "vectors.npy", x)
    np.save(d / "queries.npy", q)
    write_index(build_faiss_index([x], "flat", progress=False), str(d / "flat.index"))
    write_index(build_faiss_index([x], "ivfpq", nlist=16, pq_m=4, progress=False), str(d / "ivfpq.index"))
    write_index(build_faiss_index([x], "hnsw", hnsw_m=8, progress=False), str(d / "hnsw.index"))
    _toy_build(d / "toy")
    return d


def _toy_build(d):
    from fastcredit.retrieval.build import build_all
    from fastcredit.retrieval.retriever import open_retriever
    from fastcredit.retrieval.testing import tiny_encoder, tiny_passages, tiny_policy_tokenizer, write_corpus

    d.mkdir()
    passages = tiny_passages(150, seed=4)
    corpus = write_corpus(str(d / "corpus.jsonl"), passages)
    enc = tiny_encoder(dim=32, seed=5)
    enc.model.save_pretrained(str(d / "encoder"))
    enc.tokenizer.save_pretrained(str(d / "encoder"))
    build = build_all(corpus, str(d / "build"), encoder_obj=enc, chunk_size=64, progress=False)
    # the token store too, so that the two ranks do not both build it
    open_retriever(index=build, encoder=str(d / "encoder"), tokenizer=tiny_policy_tokenizer(passages), device="cpu",
                   progress=False)
    queries = ["river castle", "violet harbor engine", "walnut prism summit", "ember", "item 17", "copper lantern"]
    paths = {"corpus": corpus, "build": build, "encoder": str(d / "encoder"), "passages": passages, "queries": queries}
    (d / "paths.json").write_text(json.dumps(paths))


def _launch(data, which, tmp_path_factory):
    out = tmp_path_factory.mktemp(which)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT, str(data),
           str(out), which]
    proc = run_process(cmd, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.load(open(out / f"rank{r}.json")) for r in range(2)]


@pytest.fixture(scope="module")
def main_run(data, tmp_path_factory):
    return _launch(data, "main", tmp_path_factory)


@pytest.fixture(scope="module")
def error_run(data, tmp_path_factory):
    return _launch(data, "errors", tmp_path_factory)


def _ok(run, name):
    for rank, results in enumerate(run):
        assert results[name] == "ok", f"rank {rank}, scenario {name}:\n{results[name]}"


def test_the_data_has_ties_at_the_kth_place_and_across_the_boundary():
    x, q = tied_vectors()
    assert rank_rows(N, 2, 0) == (0, 601) and rank_rows(N, 2, 1) == (601, 1201) and rank_rows(3, 4, 3) == (3, 3)
    s, r = truth(x, torch.from_numpy(q[[0, 3]]), 40)
    assert r[0, :24].tolist() == [3] + list(range(590, 613)) and (s[0, :24] == s[0, 0]).all()
    assert r[1, :3].tolist() == [50, 650, 1100] and (s[1, 3:25] == np.float32(0.6)).all()
    assert r[1, 3:25].tolist() == list(range(100, 111)) + list(range(700, 711))
    # FAISS on its own orders these ties highest id first, so a split index would not match it:
    raw = FaissIndex(build_faiss_index([x], "flat", progress=False)).search(torch.from_numpy(q[[0]]), 5)[1]
    assert raw[0].tolist() != r[0, :5].tolist()


@pytest.mark.parametrize("kind", ["flat", "torch"])
def test_one_process_split_and_merged_equals_one_flat_index(data, kind):
    """The in-process core of the cross-rank search: shards with exact ties merged by merge_topk."""
    from fastcredit.retrieval.ops import merge_topk

    x, q = tied_vectors()
    qt = torch.from_numpy(q)
    for world in (1, 2, 3):
        shards = [load_index_shard(str(data / "flat.index"), kind, w, world) for w in range(world)]
        assert [(o, o + s.ntotal) for s, o, _ in shards] == shard_bounds(N, world)
        for k in (1, 4, 5, 30):
            parts = [s.search(qt, k) for s, _, _ in shards]
            rows = [torch.where(r >= 0, r + o, r) for (_, r), (_, o, _) in zip(parts, shards)]
            merged = merge_topk(torch.stack([s for s, _ in parts]), torch.stack(rows), k)
            want = truth(x, qt, k)
            assert torch.equal(merged[1], want[1]) and torch.equal(merged[0], want[0]), (world, k)


def test_exact_scores_do_not_depend_on_the_batch_or_position():
    x, q = tied_vectors()
    xt, qt = torch.from_numpy(x), torch.from_numpy(q)
    full = exact_scores(qt, xt.expand(len(q), *x.shape))
    assert torch.equal(exact_scores(qt[5:6], xt[None, 590:613]), full[5:6, 590:613])
    assert (full[0, 590:613] == full[0, 3]).all()
    assert torch.allclose(full, qt @ xt.T, atol=1e-5)
    s, r = sort_ties(torch.tensor([[0.5, 0.9, 0.5, -float("inf")]]), torch.tensor([[7, 2, 3, -1]]))
    assert r.tolist() == [[2, 3, 7, -1]]


def test_hnsw_cannot_be_split(data):
    from fastcredit.retrieval.retriever import open_retriever

    with pytest.raises(ValueError, match=r"across_ranks=replicate"):
        load_index_shard(str(data / "hnsw.index"), "hnsw", 0, 2)
    with pytest.raises(ValueError, match=r"retrieval.index_type=hnsw.*across_ranks=replicate"):
        open_retriever(index=str(data / "hnsw.index"), index_type="hnsw", rank=0, world_size=2)


def test_two_ranks_concurrent_searches_equal_one_flat_index(main_run):
    _ok(main_run, "concurrent")


def test_a_rank_that_never_searches(main_run):
    _ok(main_run, "idle")


def test_ranks_that_finish_at_different_times(main_run):
    _ok(main_run, "uneven")


def test_one_shot_searches_outside_a_session(main_run):
    _ok(main_run, "one_shot")


def test_ivfpq_split_by_id_range_equals_the_whole(main_run):
    _ok(main_run, "ivfpq")


def test_retriever_end_to_end_over_two_ranks(main_run):
    _ok(main_run, "retriever")


def test_a_failing_shard_raises_on_every_rank(error_run):
    _ok(error_run, "search_fails")


def test_a_missing_peer_times_out(error_run):
    _ok(error_run, "timeout")
