"""Inner-product indexes over unit vectors: FAISS (flat, HNSW, IVF-PQ; CPU or GPU), a torch
matmul flat index for GPUs without FAISS GPU, and sharding across devices.

Every index answers ``search(q [Q, D] float32 tensor, k) -> (scores [Q, k] float32,
rows [Q, k] int64)``, best first; missing results (k above the index size) have row -1.
Row ``i`` is passage ``i`` of the corpus store. A Search-R1 ``e5_Flat.index`` (a FAISS
``IndexFlatIP``) loads as is, or is memory-mapped straight into torch shards.

One rank's row range for retrieval across ranks, with results that depend only on the stored
vectors, is ``fastcredit.retrieval.exact``.
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import warnings
from typing import Optional, Sequence

import faiss
import numpy as np
import torch

from fastcredit.retrieval.files import faiss_header
from fastcredit.retrieval.ops import merge_topk

log = logging.getLogger(__name__)

# NOTE: faiss-cpu only takes its BLAS path for batches above this many queries (default 20,
# then 256 queries over 100k x 384 cost 1.2 s instead of 0.13 s on the CI machines).
faiss.cvar.distance_compute_blas_threshold = 20

INDEX_TYPES = ("flat", "hnsw", "ivfpq", "torch")
_FLAT_HEADER = 4 + 4 + 8 + 8 + 8 + 1 + 4  # fourcc, d, ntotal, two dummies, is_trained, metric_type


class IndexFileError(ValueError):
    """An index file is unreadable or does not match the corpus / encoder; names the file."""


def faiss_has_gpu() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def pad_results(scores: torch.Tensor, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad [Q, k'] results to [Q, k] with (-inf, -1), as FAISS does past the index size."""
    short = k - scores.shape[1]
    if short <= 0:
        return scores, rows
    pad_s = torch.full((scores.shape[0], short), -math.inf, dtype=scores.dtype, device=scores.device)
    pad_r = torch.full((rows.shape[0], short), -1, dtype=rows.dtype, device=rows.device)
    return torch.cat([scores, pad_s], 1), torch.cat([rows, pad_r], 1)


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """Zero-copy tensor over a (possibly read-only, memory-mapped) array; it is only ever read."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the memmap is not writable
        return torch.from_numpy(a)


def factory_string(index_type: str, n: int, dim: int, hnsw_m: int = 32, nlist: Optional[int] = None,
                   pq_m: Optional[int] = None) -> str:
    """FAISS factory string; IVF-PQ sizes follow FAISS's rules of thumb unless given.

    nlist ~ 4 sqrt(N) but at most N/39 (FAISS wants 39 training points per centroid); PQ
    sub-quantizers of 8 dims; 8-bit codes when N allows 39 x 256 training points, fewer bits below.
    """
    if index_type in ("flat", "torch"):
        return "Flat"
    if index_type == "hnsw":
        return f"HNSW{hnsw_m}"
    if index_type != "ivfpq":
        raise ValueError(f"index type {index_type!r} is not one of {', '.join(INDEX_TYPES)}")
    nlist = nlist or max(1, min(int(4 * math.sqrt(n)), n // 39))
    if pq_m is None:
        pq_m = max(m for m in range(1, max(1, dim // 8) + 1) if dim % m == 0)
    if dim % pq_m:
        raise ValueError(f"pq_m={pq_m} must divide the embedding dimension {dim}")
    nbits = 8 if n >= 39 * 256 else max(1, min(8, int(math.log2(max(2, n // 39)))))
    return f"IVF{nlist},PQ{pq_m}x{nbits}"


def build_faiss_index(chunks: Sequence[np.ndarray], index_type: str = "flat", hnsw_m: int = 32,
                      nlist: Optional[int] = None, pq_m: Optional[int] = None, train_size: int = 262144,
                      seed: int = 0, progress: bool = True) -> faiss.Index:
    """Inner-product FAISS index over the rows of ``chunks`` (each [n_i, D] float32), in order."""
    from fastcredit.runtime.progress import progress_bar

    n, dim = sum(len(c) for c in chunks), int(chunks[0].shape[1])
    spec = factory_string(index_type, n, dim, hnsw_m, nlist, pq_m)
    index = faiss.index_factory(dim, spec, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        # A uniform sample across all chunks, so training sees the whole corpus, not its head.
        rng = np.random.default_rng(seed)
        picks = np.sort(rng.choice(n, size=min(n, train_size), replace=False))
        starts = np.cumsum([0] + [len(c) for c in chunks])
        sample = np.concatenate([
            np.asarray(chunks[c][picks[(picks >= starts[c]) & (picks < starts[c + 1])] - starts[c]])
            for c in range(len(chunks))])
        index.train(np.ascontiguousarray(sample, dtype=np.float32))
    with progress_bar(total=n, unit="vec", desc=f"index {spec}", disable=not progress) as bar:
        for c in chunks:
            index.add(np.ascontiguousarray(c, dtype=np.float32))
            bar.update(len(c))
    return index


def write_index(index: faiss.Index, path: str) -> None:
    """Write atomically: a killed build never leaves a truncated index behind."""
    tmp = f"{path}.tmp-{os.getpid()}"
    faiss.write_index(index, tmp)
    os.replace(tmp, path)


def read_flat_vectors(path: str) -> np.ndarray:
    """The vectors of a FAISS ``IndexFlatIP`` file, memory-mapped: [N, D] float32, no copy in RAM.

    Layout (faiss/impl/index_write.cpp): fourcc ``IxFI``, int32 d, int64 ntotal, two int64
    dummies, uint8 is_trained, int32 metric, then a uint64 count of floats and the floats.
    """
    with open(path, "rb") as fh:
        head = fh.read(_FLAT_HEADER + 8)
    if len(head) < _FLAT_HEADER + 8 or head[:4] not in (b"IxFI", b"IxF2"):
        raise IndexFileError(f"{path}: not a FAISS flat index (fourcc {head[:4]!r}); use index_type=flat/hnsw/ivfpq")
    if head[:4] == b"IxF2":
        raise IndexFileError(f"{path}: an L2 flat index; fastcredit searches by inner product (IxFI)")
    _, d, ntotal = faiss_header(head)
    count = int.from_bytes(head[_FLAT_HEADER:_FLAT_HEADER + 8], "little")
    if count != d * ntotal:
        raise IndexFileError(f"{path}: header says {ntotal} x {d} vectors but holds {count} floats")
    return np.memmap(path, dtype=np.float32, mode="r", offset=_FLAT_HEADER + 8, shape=(ntotal, d))


class FaissIndex:
    """A FAISS index (CPU, or one GPU); queries go in and results come out as torch tensors."""

    def __init__(self, index: faiss.Index, nprobe: Optional[int] = None, ef_search: Optional[int] = None):
        self.index = index
        self.ntotal, self.dim = int(index.ntotal), int(index.d)
        self.on_gpu = hasattr(index, "getDevice")
        if nprobe is not None:
            try:
                faiss.extract_index_ivf(index).nprobe = nprobe
            except RuntimeError:
                raise ValueError(f"nprobe={nprobe} given for a non-IVF index ({type(index).__name__})") from None
        if ef_search is not None and hasattr(faiss.downcast_index(index), "hnsw"):
            faiss.downcast_index(index).hnsw.efSearch = ef_search
        self.device = torch.device(f"cuda:{index.getDevice()}") if self.on_gpu else torch.device("cpu")

    def search(self, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [Q, D] → (scores [Q, k] float32, rows [Q, k] int64) on ``self.device``."""
        kk = min(k, self.ntotal)
        if q.shape[0] == 0 or kk == 0:
            return pad_results(torch.empty(q.shape[0], 0, device=self.device),
                        torch.empty(q.shape[0], 0, dtype=torch.long, device=self.device), k)
        if self.on_gpu:
            import faiss.contrib.torch_utils  # noqa: F401  (lets a GPU index read CUDA tensors in place)
            s, i = self.index.search(q.to(self.device, torch.float32).contiguous(), kk)
        else:
            x = np.ascontiguousarray(q.detach().to("cpu", torch.float32).numpy())
            s, i = self.index.search(x, kk)
            s, i = torch.from_numpy(s), torch.from_numpy(i)
        return pad_results(s, i, k)


class TorchFlatIndex:
    """Exact inner-product search as chunked matmuls on any torch device.

    Vectors are stored in ``dtype`` (fp16 on a GPU halves memory and doubles throughput). With
    a half dtype the scan's scores are rounded to it (bf16 keeps 8 bits: near scores tie), so
    the best ``2k+8`` candidates are re-scored in float32 against the stored vectors: scores
    are then exact for those vectors (within ~1e-4 of float32 ones for fp16 storage) and
    their order is no longer decided by rounding.
    """

    def __init__(self, vectors, device="cpu", dtype: Optional[torch.dtype] = None, max_scores: int = 1 << 27):
        self.device = torch.device(device)
        self.dtype = dtype or (torch.float16 if self.device.type == "cuda" else torch.float32)
        src = from_numpy(vectors) if isinstance(vectors, np.ndarray) else vectors
        self.emb = src.to(self.device, self.dtype).contiguous()  # [N, D]
        self.ntotal, self.dim = self.emb.shape
        self.rescore = self.dtype != torch.float32
        self.max_scores = max_scores

    def _scan(self, q: torch.Tensor, kk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-kk by chunked matmul: never more than ``max_scores`` scores in memory at once."""
        chunk = max(kk, self.max_scores // max(1, q.shape[0]))
        qd = q.to(self.dtype)
        best_s = best_i = None
        for start in range(0, self.ntotal, chunk):
            block = qd @ self.emb[start:start + chunk].T                        # [Q, chunk]
            s, i = block.topk(min(kk, block.shape[1]), dim=1)
            i = i + start
            if best_s is not None:
                s, j = torch.cat([best_s, s], 1).topk(kk, dim=1)
                i = torch.cat([best_i, i], 1).gather(1, j)
            best_s, best_i = s, i
        return best_s, best_i

    @torch.inference_mode()
    def search(self, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [Q, D] → (scores [Q, k] float32, rows [Q, k] int64) on ``self.device``."""
        q = q.to(self.device, torch.float32)
        kk = min(self.ntotal, 2 * k + 8 if self.rescore else k)
        if q.shape[0] == 0 or kk == 0:
            return pad_results(torch.empty(q.shape[0], 0, device=self.device),
                        torch.empty(q.shape[0], 0, dtype=torch.long, device=self.device), k)
        s, i = self._scan(q, kk)
        if self.rescore:
            exact = torch.einsum("qd,qkd->qk", q, self.emb[i].float())     # [Q, kk] float32
            s, j = exact.topk(min(k, kk), dim=1)
            i = i.gather(1, j)
        return pad_results(s.float(), i, k)


class ShardedIndex:
    """Row-range shards (one per device), searched in parallel and merged with ``merge_topk``."""

    def __init__(self, shards: Sequence, out_device="cpu"):
        self.shards = list(shards)
        sizes = [s.ntotal for s in self.shards]
        self.offsets = [0] + list(np.cumsum(sizes)[:-1])
        self.ntotal, self.dim = int(sum(sizes)), self.shards[0].dim
        self.device = torch.device(out_device)
        needs_threads = any(isinstance(s, FaissIndex) for s in self.shards) and len(self.shards) > 1
        self._pool = concurrent.futures.ThreadPoolExecutor(len(self.shards)) if needs_threads else None

    def search(self, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [Q, D] → (scores [Q, k], rows [Q, k]) on ``self.device``; rows are global."""
        # FAISS releases the GIL in search, so threads overlap shards; torch shards on
        # different GPUs overlap anyway because their kernels launch asynchronously.
        def run(shard):
            return shard.search(q, k)

        parts = list(self._pool.map(run, self.shards)) if self._pool else [run(sh) for sh in self.shards]
        scores = torch.stack([s.to(self.device, non_blocking=True) for s, _ in parts])   # [S, Q, k]
        rows = torch.stack([torch.where(r >= 0, r + off, r).to(self.device, non_blocking=True)
                            for (_, r), off in zip(parts, self.offsets)])
        return merge_topk(scores.float().contiguous(), rows.long().contiguous(), k)


def shard_bounds(n: int, num_shards: int) -> list[tuple[int, int]]:
    step = -(-n // num_shards)
    return [(s, min(n, s + step)) for s in range(0, n, step)]


def shard_devices(first: int, num_shards: int, count: int) -> list[int]:
    """CUDA device indices of an index's shards: ``num_shards`` consecutive devices from ``first`` (the
    process's own: under torchrun each rank's copy starts on its own GPU), wrapping past the last;
    ``num_shards <= 0``: all ``count`` visible devices (a standalone server)."""
    if count < 1:
        raise ValueError("no CUDA device is visible")
    if not 0 <= first < count:
        raise ValueError(f"device cuda:{first} is not one of the {count} visible CUDA devices")
    num = count if num_shards <= 0 else num_shards
    if num > count:
        raise ValueError(f"num_shards={num_shards} but only {count} CUDA devices are visible")
    return [(first + i) % count for i in range(num)]


def gpu_devices(num_shards: int, device: torch.device) -> list[torch.device]:
    """The shards' devices from ``device`` (a bare "cuda": the current device, which torchrun ranks set)."""
    first = device.index if device.index is not None else torch.cuda.current_device()
    return [torch.device(f"cuda:{i}") for i in shard_devices(first, num_shards, torch.cuda.device_count())]


def _faiss_gpu_shard(vectors: np.ndarray, device: torch.device, fp16: bool) -> FaissIndex:
    cpu = faiss.IndexFlatIP(vectors.shape[1])
    cpu.add(np.ascontiguousarray(vectors, dtype=np.float32))
    res = faiss.StandardGpuResources()
    co = faiss.GpuClonerOptions()
    co.useFloat16 = fp16
    gpu = faiss.index_cpu_to_gpu(res, device.index, cpu, co)
    gpu.referenced_resources = res  # NOTE: keep the resources alive as long as the index
    return FaissIndex(gpu)


def load_index(path: str, index_type: str = "flat", device: str = "cpu", dtype: Optional[torch.dtype] = None,
               num_shards: int = 0, nprobe: Optional[int] = None, ef_search: Optional[int] = None, mmap: bool = False):
    """Open an index file for search on ``device`` ("cpu", "cuda" or "cuda:N").

    flat on a GPU uses FAISS GPU when installed, else the torch index; both shard the rows
    over ``num_shards`` consecutive GPUs starting at ``device`` (the current one for a bare
    "cuda"), wrapping (:func:`shard_devices`; 0: all visible). ``torch`` reads a flat file memory-mapped.
    hnsw / ivfpq stay on the CPU (FAISS GPU has no HNSW; IVF-PQ GPU is left to FAISS users).
    """
    if not os.path.exists(path):
        raise IndexFileError(f"{path}: no such index file")
    if index_type not in INDEX_TYPES:
        raise ValueError(f"index type {index_type!r} is not one of {', '.join(INDEX_TYPES)}")
    on_gpu = torch.device(device).type == "cuda"
    if index_type in ("hnsw", "ivfpq") or (index_type == "flat" and not on_gpu):
        flags = faiss.IO_FLAG_MMAP_IFC if mmap and index_type == "flat" else 0
        index = faiss.read_index(path, flags)
        if index.metric_type != faiss.METRIC_INNER_PRODUCT:
            raise IndexFileError(f"{path}: metric {index.metric_type} is not inner product")
        if on_gpu:
            log.info("%s: %s indexes are searched on the CPU", path, index_type)
        return FaissIndex(index, nprobe=nprobe, ef_search=ef_search)
    vectors = read_flat_vectors(path)
    if not on_gpu:
        return TorchFlatIndex(vectors, "cpu", dtype)
    devices = gpu_devices(num_shards, torch.device(device))
    use_faiss = index_type == "flat" and faiss_has_gpu()
    if index_type == "flat" and not use_faiss:
        log.info("faiss has no GPU support here: searching %s with the torch flat index", path)
    shards = []
    for dev, (s, e) in zip(devices, shard_bounds(len(vectors), len(devices))):
        half = dtype in (None, torch.float16, torch.bfloat16)
        shards.append(_faiss_gpu_shard(vectors[s:e], dev, half) if use_faiss
                      else TorchFlatIndex(vectors[s:e], dev, dtype))
    return shards[0] if len(shards) == 1 else ShardedIndex(shards, devices[0])
