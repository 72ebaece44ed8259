"""The batched in-process retriever: queries → encoder → index → passages, observations.

    r = open_retriever(corpus="wiki-18.jsonl", index="e5_Flat.index", encoder="/models/e5-base-v2",
                       query_prefix="query: ", passage_prefix="passage: ", tokenizer=policy_tokenizer)
    hits = r.search(["who wrote hamlet"], k=3)              # [[Hit(row, id, score, contents, span)]]
    obs = r.observations(["who wrote hamlet"], k=3)         # Search-R1's observation strings
    ids, cu = r.observation_tokens(queries, 3, max_passage_tokens=256, max_obs_tokens=500)

One batch costs one encoder forward, one index search and, for token observations, one
gather: no HTTP, no host round trip of embeddings, no per-row Python lookups on the GPU path.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from fastcredit.retrieval.corpus import CorpusStore, open_corpus_store
from fastcredit.retrieval.files import read_build_info
from fastcredit.retrieval.encoders import Encoder, resolve_device, resolve_dtype
from fastcredit.retrieval.observation import ObsTemplate, decode_all, format_observation, split_contents, unpack
from fastcredit.retrieval.ops import assemble_observations

log = logging.getLogger(__name__)



@dataclass
class Hit:
    """One retrieved passage."""
    row: int
    id: str
    score: float
    contents: str
    span: Optional[tuple[int, int]] = None  # [start, end) in the token store, when there is one

    @property
    def title(self) -> str:
        return split_contents(self.contents)[0].strip().strip('"')

    @property
    def text(self) -> str:
        return split_contents(self.contents)[1]

    def document(self) -> dict:
        """Search-R1's document record."""
        return {"id": self.id, "contents": self.contents}


class Retriever:
    """Batched dense retrieval over a corpus store (see the module docstring)."""

    def __init__(self, corpus: CorpusStore, index, encoder: Encoder, tokenizer=None, token_store=None,
                 token_device=None):
        if index.ntotal != len(corpus):
            raise ValueError(f"index has {index.ntotal} vectors but corpus store {corpus.root} "
                             f"has {len(corpus)} passages")
        if index.dim != encoder.dim:
            raise ValueError(f"index vectors have {index.dim} dims but encoder {encoder.name} gives {encoder.dim}")
        self.corpus, self.index, self.encoder = corpus, index, encoder
        self.tokenizer, self.token_store = tokenizer, token_store
        self.token_device = torch.device(token_device or "cpu")
        self.template = ObsTemplate(tokenizer) if tokenizer is not None else None

    def search_rows(self, queries: Sequence[str], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[Q] queries → (scores [Q, k] float32, rows [Q, k] int64, -1 = none) on the index's device."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        q = self.encoder.encode_queries(list(queries))
        return self.index.search(q, k)

    def hits(self, scores: torch.Tensor, rows: torch.Tensor) -> list[list[Hit]]:
        """Look the passages of [Q, k] search results up in the corpus store."""
        scores_l, rows_l = scores.cpu().tolist(), rows.cpu().tolist()
        spans = self.token_store.offsets if self.token_store is not None else None
        out = []
        for srow, rrow in zip(scores_l, rows_l):
            out.append([Hit(r, self.corpus.id(r), float(s), self.corpus.contents(r),
                            (int(spans[r]), int(spans[r + 1])) if spans is not None else None)
                        for s, r in zip(srow, rrow) if r >= 0])
        return out

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        """[Q] queries → per query its k best passages, best first."""
        return self.hits(*self.search_rows(queries, k))

    def _require_tokens(self) -> None:
        if self.token_store is None or self.template is None:
            raise ValueError("token observations need a tokenizer (and its token store): "
                             "pass tokenizer= to open_retriever")

    def observation_tokens(self, queries: Optional[Sequence[str]], k: int, max_passage_tokens: Optional[int] = None,
                           max_obs_tokens: Optional[int] = None, rows: Optional[torch.Tensor] = None):
        """Observations as packed token ids: ``(ids int32 [total], cu_seqlens int64 [Q+1])``.

        Pass ``rows`` [Q, k] (from :meth:`search_rows`) to skip the search.
        """
        self._require_tokens()
        if rows is None:
            rows = self.search_rows(queries, k)[1]
        tokens, offsets = self.token_store.tensors(self.token_device)
        return assemble_observations(tokens, offsets, rows.to(self.token_device),
                                     **self.template.tensors(rows.shape[1], self.token_device),
                                     max_passage_tokens=max_passage_tokens, max_obs_tokens=max_obs_tokens)

    def observations(self, queries: Sequence[str], k: int, max_passage_tokens: Optional[int] = None,
                     max_obs_tokens: Optional[int] = None) -> list[str]:
        """Search-R1's observation strings. Without caps they match Search-R1 byte for byte;
        with caps they are the decoded token observations (so text and tokens agree)."""
        if max_passage_tokens is None and max_obs_tokens is None:
            return [format_observation(h.contents for h in hs) for hs in self.search(queries, k)]
        ids, cu = self.observation_tokens(queries, k, max_passage_tokens, max_obs_tokens)
        return decode_all(self.tokenizer, unpack(ids, cu))


def _check_encoder(info: Optional[dict], encoder: Encoder, where: str) -> None:
    if info is None:
        return
    built = info.get("encoder", {})
    for key in ("pooling", "passage_prefix", "max_length", "dim", "normalize"):
        if key in built and built[key] != encoder.fingerprint()[key]:
            log.warning("%s: passages were encoded with %s=%r, queries use %r", where, key, built[key],
                        encoder.fingerprint()[key])


def default_index_dir(corpus: str) -> str:
    """Where the index of ``corpus`` is built when none is named: ``<corpus without .jsonl>.fastcredit/``."""
    return os.path.splitext(os.path.abspath(corpus))[0] + ".fastcredit"


@contextlib.contextmanager
def rank0_first(rank: int, world_size: int, group=None):
    """The block runs on rank 0, then on the other ranks of ``group`` (one barrier each side; every rank enters)."""
    if world_size > 1 and rank != 0:
        import torch.distributed as dist

        dist.barrier(group=group)
    yield
    if world_size > 1 and rank == 0:
        import torch.distributed as dist

        dist.barrier(group=group)


def open_retriever(corpus: Optional[str] = None, index: Optional[str] = None, encoder: str = "minilm",
                   pooling: str = "mean", query_prefix: str = "", passage_prefix: str = "", index_type: str = "flat",
                   device: str = "auto", dtype: str = "auto", max_length: int = 256, batch_size: int = 256,
                   tokenizer=None, store_dir: Optional[str] = None, num_shards: int = 0, nprobe: Optional[int] = None,
                   ef_search: Optional[int] = None, mmap: bool = False, token_device: Optional[str] = None,
                   max_gpu_token_bytes: int = 4 << 30, progress: bool = True, rank: int = 0, world_size: int = 1,
                   group=None, round_cadence_ms: float = 5.0, builders: Optional[tuple] = None) -> Retriever:
    """Open (building what is missing) a retriever over Search-R1-style assets.

    ``index``: a FAISS index file (Search-R1's ``e5_Flat.index`` as is) or a folder written by
    ``python -m fastcredit.retrieval.build``; when None, one is built beside ``corpus``.
    The corpus store and token store live in ``store_dir`` (default: beside the index).
    ``token_device``: where the token store is gathered from (default: ``device`` when the
    store is at most ``max_gpu_token_bytes``, else the CPU). ``num_shards``: GPUs a flat index
    spreads over, consecutive from ``device`` (``cuda:N``, or the current device), 0: all visible.
    ``world_size`` > 1: every rank of ``group`` (default: all) calls this together and keeps
    only its rows of the index (``fastcredit.retrieval.ranks``; ``num_shards`` and ``mmap`` do
    not apply); a missing index is built by rank 0; corpus and token stores stay whole.
    ``builders``: ``(rank, world size, group)`` of the processes opening it together when that is not the split's
    own (every rank of a job opening a whole copy): what is missing is built by their rank 0 before the others look.
    """
    from fastcredit.retrieval.exact import check_splittable
    from fastcredit.retrieval.indexes import load_index

    if world_size > 1:
        check_splittable(index_type)  # before anything loads
    dev = resolve_device(device)
    enc = Encoder.from_pretrained(encoder, pooling, query_prefix, passage_prefix, max_length, batch_size, str(dev),
                                  dtype)
    # what is built on first use (the index, the corpus and token stores) is built by rank 0 alone: the other ranks
    # look only once it is there (two ranks building one store race on its folder)
    with rank0_first(*(builders or (rank, world_size, group))):
        if index is None or not os.path.exists(index):
            if corpus is None:
                raise ValueError(f"index {index!r} does not exist and no corpus jsonl was given to build it from")
            from fastcredit.retrieval.build import build_all

            out = default_index_dir(corpus) if index is None else os.path.dirname(os.path.abspath(index))
            if (builders or (rank,))[0] == 0:
                build_all(corpus, out, index_type=index_type, progress=progress, encoder_obj=enc,
                          index_name=None if index is None else os.path.basename(index))
            index = out if index is None else index
        info, index_path = read_build_info(index)
        if store_dir is None:
            store_dir = os.path.join(info["folder"], info["corpus_store"]) if info else \
                os.path.join(os.path.dirname(os.path.abspath(index_path)), "fastcredit_store")
        store = open_corpus_store(corpus, store_dir, progress=progress)
        tok_store = None
        if tokenizer is not None:
            from fastcredit.retrieval.tokstore import open_token_store

            tok_store = open_token_store(store, tokenizer, progress=progress)
    _check_encoder(info, enc, index_path)
    index_dtype = None if dev.type == "cpu" else resolve_dtype("float16" if dtype == "auto" else dtype, dev)
    if world_size > 1:
        from fastcredit.retrieval.ranks import open_cross_rank_index

        idx = open_cross_rank_index(index_path, index_type, rank, world_size, group, str(dev), index_dtype, nprobe,
                                    round_cadence_ms)
    else:
        idx = load_index(index_path, index_type, str(dev), index_dtype, num_shards, nprobe, ef_search, mmap)
    if tok_store is not None:
        if token_device is None:
            # The whole store moves to the GPU once; past the cap it stays memory-mapped on the
            # CPU and only the gathered observations travel.
            fits = tok_store.tokens.nbytes <= max_gpu_token_bytes
            token_device = str(dev) if dev.type == "cpu" or fits else "cpu"
    return Retriever(store, idx, enc, tokenizer, tok_store, token_device=token_device)


def from_config(rcfg, tokenizer=None, corpus: Optional[str] = None, progress: bool = True,
                device: Optional[str] = None, rank: int = 0, world_size: int = 1, group=None) -> Retriever:
    """A retriever from the ``retrieval`` section of the training config.

    ``corpus`` is used when ``rcfg.corpus`` is unset (the trainer passes the toy world's).
    ``device``: where ``rcfg.device`` is put when given (the trainer passes its rank's own GPU,
    so the index's first shard and the encoder live there; see ``fastcredit.retrieval.searcher.make_searcher``).
    ``rank`` / ``world_size`` / ``group``: the torchrun ranks; with ``rcfg.across_ranks=shard``
    and more than one, every rank calls this together and holds only its rows of the index.
    ``rcfg.build_index`` decides what is built (``fastcredit.config.checks.check_index``): by default
    only the index beside the corpus when ``rcfg.index`` is unset; a set one must exist.
    """
    from fastcredit.config.checks import check_index

    check_index(rcfg)  # before the encoder loads
    if rcfg.index is None and rank == 0 and (rcfg.corpus or corpus):
        where = default_index_dir(rcfg.corpus or corpus)
        if not os.path.exists(os.path.join(where, "build.json")):
            log.warning("retrieval.index is unset: building the index of %s into %s", rcfg.corpus or corpus, where)
    extra = {name: getattr(rcfg, name)
             for name in ("dtype", "max_length", "num_shards", "nprobe", "ef_search", "store_dir", "round_cadence_ms")
             if getattr(rcfg, name, None) is not None}
    split = rcfg.across_ranks == "shard" and world_size > 1
    return open_retriever(corpus=rcfg.corpus or corpus, index=rcfg.index, encoder=rcfg.encoder, pooling=rcfg.pooling,
                          query_prefix=rcfg.query_prefix, passage_prefix=rcfg.passage_prefix,
                          index_type=rcfg.index_type, device=device or rcfg.device, batch_size=rcfg.batch_size,
                          tokenizer=tokenizer, progress=progress, rank=rank if split else 0,
                          world_size=world_size if split else 1, group=group, builders=(rank, world_size, group),
                          **extra)
