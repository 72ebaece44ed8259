"""Indexes: exactness of flat search (FAISS and torch), recall of HNSW / IVF-PQ, sharding,
padding past the index size, and reading Search-R1-style flat index files."""
import faiss
import numpy as np
import pytest
import torch

from fastcredit.retrieval.indexes import (FaissIndex, IndexFileError, ShardedIndex, TorchFlatIndex, build_faiss_index,
                                          factory_string, load_index, read_flat_vectors, shard_bounds, write_index)


def unit(n, d, seed):
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def data():
    return unit(2000, 32, 0), torch.from_numpy(unit(63, 32, 1))


def exact(base, q, k):
    s = q.numpy() @ base.T
    order = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(s, order, 1), order


def same_up_to_ties(rows, scores, ref_rows, ref_scores, tol=1e-5):
    """Scores equal; ids equal except where two scores tie within tol."""
    assert np.allclose(scores, ref_scores, atol=tol)
    diff = rows != ref_rows
    if diff.any():
        s = ref_scores[diff]
        assert np.all(np.isclose(s, np.roll(ref_scores, 1, 1)[diff], atol=tol)
                      | np.isclose(s, np.roll(ref_scores, -1, 1)[diff], atol=tol))


def test_flat_faiss_and_torch_are_exact(data):
    base, q = data
    ref_s, ref_i = exact(base, q, 10)
    for index in (FaissIndex(build_faiss_index([base[:700], base[700:]], "flat", progress=False)),
                  TorchFlatIndex(base), TorchFlatIndex(base, max_scores=63 * 100)):  # last: 20 chunks
        s, i = index.search(q, 10)
        assert s.dtype == torch.float32 and i.dtype == torch.int64 and s.shape == (63, 10)
        same_up_to_ties(i.numpy(), s.numpy(), ref_i, ref_s)


def test_half_storage_is_rescored_in_float32(data):
    base, q = data
    ref_s, ref_i = exact(base, q, 5)
    for dtype, agree in ((torch.float16, 0.97), (torch.bfloat16, 0.9)):
        s, i = TorchFlatIndex(base, dtype=dtype).search(q, 5)
        # Re-scored in float32 from the stored vectors: exact for those vectors, no half-precision output rounding.
        stored = torch.from_numpy(base).to(dtype).float().numpy()
        np.testing.assert_allclose(s.numpy(), np.take_along_axis(q.numpy() @ stored.T, i.numpy(), 1), atol=2e-6)
        assert (np.diff(s.numpy(), axis=1) <= 0).all()
        assert (i.numpy() == ref_i).mean() > agree


def test_results_are_padded_past_the_index_size(data):
    base, q = data
    for index in (FaissIndex(build_faiss_index([base[:3]], "flat", progress=False)), TorchFlatIndex(base[:3])):
        s, i = index.search(q[:4], 5)
        assert (i[:, 3:] == -1).all() and (i[:, :3] >= 0).all() and s.shape == (4, 5)
        assert (s[:, 3:] < -1e30).all()
    s, i = TorchFlatIndex(base).search(q[:0], 3)
    assert s.shape == (0, 3) and i.shape == (0, 3)


def clustered(n, d, seed, centres):
    """Unit vectors around a few centres: embeddings cluster, and PQ is only meaningful on such data."""
    rng = np.random.default_rng(seed)
    x = centres[rng.integers(0, len(centres), n)] + 0.4 * rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


# NOTE: IVF-PQ on 2000 training vectors is coarse (5-bit codes); 0.5 is 100x the recall of chance.
@pytest.mark.parametrize("index_type,min_recall", [("hnsw", 0.95), ("ivfpq", 0.5)])
def test_approximate_indexes_recall(index_type, min_recall):
    centres = np.random.default_rng(7).standard_normal((40, 32))
    base, q = clustered(2000, 32, 0, centres), torch.from_numpy(clustered(63, 32, 1, centres))
    _, ref_i = exact(base, q, 10)
    raw = build_faiss_index([base[:1000], base[1000:]], index_type, pq_m=16, progress=False)
    index = FaissIndex(raw, nprobe=raw.nlist if index_type == "ivfpq" else None,
                       ef_search=128 if index_type == "hnsw" else None)
    _, i = index.search(q, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(i.numpy(), ref_i)])
    assert recall >= min_recall, f"{index_type} recall@10 = {recall:.2f}"


def test_factory_strings_follow_the_size():
    assert factory_string("flat", 10, 8) == "Flat" and factory_string("hnsw", 10, 8, hnsw_m=64) == "HNSW64"
    assert factory_string("ivfpq", 21_000_000, 768) == "IVF18330,PQ96x8"
    assert factory_string("ivfpq", 2000, 32) == "IVF51,PQ4x5"
    with pytest.raises(ValueError, match="pq_m=5 must divide"):
        factory_string("ivfpq", 2000, 32, pq_m=5)
    with pytest.raises(ValueError, match="index type 'bm25'"):
        factory_string("bm25", 10, 8)


@pytest.mark.parametrize("kind", ["torch", "faiss"])
def test_sharded_equals_unsharded(data, kind):
    base, q = data
    ref_s, ref_i = TorchFlatIndex(base).search(q, 7)
    bounds = [(0, 5), (5, 1200), (1200, 1203), (1203, 2000)]  # uneven, one shard smaller than k
    shards = [TorchFlatIndex(base[s:e]) if kind == "torch" else
              FaissIndex(build_faiss_index([base[s:e]], "flat", progress=False)) for s, e in bounds]
    s, i = ShardedIndex(shards).search(q, 7)
    same_up_to_ties(i.numpy(), s.numpy(), ref_i.numpy(), ref_s.numpy())
    assert shard_bounds(10, 3) == [(0, 4), (4, 8), (8, 10)]


def test_searchr1_flat_file_loads_as_is(tmp_path, data):
    base, q = data
    # What Search-R1's index_builder writes: index_factory(dim, "Flat", METRIC_INNER_PRODUCT).
    raw = faiss.index_factory(32, "Flat", faiss.METRIC_INNER_PRODUCT)
    raw.add(base)
    path = str(tmp_path / "e5_Flat.index")
    faiss.write_index(raw, path)
    vecs = read_flat_vectors(path)
    assert isinstance(vecs, np.memmap) and np.array_equal(np.asarray(vecs), base)
    ref_s, ref_i = exact(base, q, 4)
    for kw in (dict(index_type="flat"), dict(index_type="flat", mmap=True), dict(index_type="torch")):
        s, i = load_index(path, **kw).search(q, 4)
        same_up_to_ties(i.numpy(), s.numpy(), ref_i, ref_s)


def test_bad_index_files_are_named(tmp_path, data):
    base, _ = data
    l2 = faiss.IndexFlatL2(32)
    l2.add(base[:10])
    faiss.write_index(l2, str(tmp_path / "l2.index"))
    with pytest.raises(IndexFileError, match="L2 flat index"):
        read_flat_vectors(str(tmp_path / "l2.index"))
    with pytest.raises(IndexFileError, match="metric 1 is not inner product"):
        load_index(str(tmp_path / "l2.index"))
    (tmp_path / "junk.index").write_bytes(b"not an index at all, clearly")
    with pytest.raises(IndexFileError, match="junk.index: not a FAISS flat index"):
        load_index(str(tmp_path / "junk.index"), index_type="torch")
    with pytest.raises(IndexFileError, match="no such index file"):
        load_index(str(tmp_path / "missing.index"))
    hnsw = build_faiss_index([base], "hnsw", progress=False)
    write_index(hnsw, str(tmp_path / "h.index"))
    with pytest.raises(ValueError, match="nprobe=4 given for a non-IVF index"):
        load_index(str(tmp_path / "h.index"), "hnsw", nprobe=4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_torch_index_on_gpu_matches_cpu(data, dtype):
    base, q = data
    ref_s, ref_i = exact(base, q, 10)
    s, i = TorchFlatIndex(base, "cuda", dtype).search(q.cuda(), 10)
    assert s.is_cuda and i.is_cuda
    assert (i.cpu().numpy() == ref_i).mean() > 0.97
    stored = torch.from_numpy(base).to(dtype).float().numpy()
    np.testing.assert_allclose(s.cpu().numpy(), np.take_along_axis(q.numpy() @ stored.T, i.cpu().numpy(), 1), atol=1e-5)


@pytest.mark.gpu
def test_flat_file_sharded_over_gpus(tmp_path, data):
    base, q = data
    path = str(tmp_path / "f.index")
    write_index(build_faiss_index([base], "flat", progress=False), path)
    ref_s, ref_i = exact(base, q, 10)
    index = load_index(path, "flat", "cuda")  # FAISS GPU when installed, else the torch index; all GPUs
    s, i = index.search(q.cuda(), 10)
    assert (i.cpu().numpy() == ref_i).mean() > 0.98
    np.testing.assert_allclose(s.cpu().numpy(), ref_s, atol=2e-3)  # FAISS GPU fp16 storage: no re-scoring
