"""What the agent loop searches with, from the config: ``searcher(queries) -> [(observation ids, passage ids)]``.

    searcher, retriever = make_searcher(cfg, tokenizer, corpus, device=info.device, info=info)

The in-process retriever (``retrieval.backend=local``: a batched index, split over the ranks with
``retrieval.across_ranks=shard``) or a Search-R1 ``/retrieve`` server (``http``). Observations come back as token
ids in Search-R1's ``<information>`` format (``fastcredit.retrieval.observation``): the retriever's token store
gathers them, a server's texts are tokenized once here.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from fastcredit.config import TrainConfig

# searcher(queries) -> per query (observation token ids, retrieved passage ids)
Searcher = Callable[[list[str]], list[tuple[list[int], list[str]]]]


def retriever_searcher(retriever, k: int, max_passage_tokens: Optional[int] = None,
                       max_obs_tokens: Optional[int] = None) -> Searcher:
    """A :data:`Searcher` over an in-process ``Retriever``: one search and one token gather per batch."""

    def search(queries: list[str]) -> list[tuple[list[int], list[str]]]:
        if not queries:
            return []
        rows = retriever.search_rows(queries, k)[1]
        ids, cu = retriever.observation_tokens(None, k, max_passage_tokens, max_obs_tokens, rows=rows)
        ids, cu, rows = ids.cpu().tolist(), cu.cpu().tolist(), rows.cpu().tolist()
        return [(ids[cu[i]:cu[i + 1]], [retriever.corpus.id(r) for r in rows[i] if r >= 0])
                for i in range(len(queries))]

    # where its torch work runs (the encoder's device; an encoder without one, such as the toy world's hashing, on
    # the host): the asynchronous rollout keeps a CPU's on the loop's own thread (fastcredit.runtime.threads)
    search.torch_device = getattr(getattr(retriever, "encoder", None), "device", None) or torch.device("cpu")
    session = getattr(getattr(retriever, "index", None), "session", None)
    if session is not None:  # split across ranks: each rollout meets the other ranks in retrieval rounds
        search.session = session
    return search


def http_searcher(client, tokenizer, k: int) -> Searcher:
    """A :data:`Searcher` over a Search-R1 ``/retrieve`` server (text answers, tokenized here once)."""
    from fastcredit.retrieval.observation import format_observation

    def search(queries: list[str]) -> list[tuple[list[int], list[str]]]:
        results = client.retrieve(queries, k)
        out = []
        for docs in results:
            docs = [d.get("document", d) for d in docs]
            text = format_observation(d["contents"] for d in docs)
            out.append((list(tokenizer(text, add_special_tokens=False)["input_ids"]), [str(d.get("id")) for d in docs]))
        return out

    return search


def make_searcher(cfg: TrainConfig, tokenizer, corpus: str, progress: bool = True,
                  device: Optional[torch.device] = None, info=None) -> tuple[Searcher, Optional[object]]:
    """``(searcher, retriever)``: the rollout's :data:`Searcher` and the in-process retriever behind it (None with a
    ``/retrieve`` server).

    ``device``: the process's own device (the trainer's ``info.device``); a GPU index starts
    there and spreads over ``retrieval.num_shards`` consecutive GPUs (1: only this one).
    ``info``: the :class:`~fastcredit.distributed.process_group.DistInfo`; with several ranks and
    ``retrieval.across_ranks=shard`` every rank holds 1/W of the index and searches go through
    retrieval rounds with the other ranks (``fastcredit.retrieval.ranks``): every rank must
    call this, and search, in step.
    """
    r = cfg.retrieval
    if r.backend == "http":
        from fastcredit.retrieval.client import RetrievalClient

        return http_searcher(RetrievalClient(r.url), tokenizer, r.topk), None
    from fastcredit.retrieval.retriever import from_config

    # retrieval.device "cuda" / "auto" in a CUDA process means the process's own GPU
    if device is None and info is not None:
        device = info.device
    own = str(device) if device is not None and torch.device(device).type == "cuda" and r.device != "cpu" else None
    ranks = {} if info is None else {"rank": info.rank, "world_size": info.world_size, "group": info.group}
    retriever = from_config(r, tokenizer=tokenizer, corpus=corpus, progress=progress, device=own, **ranks)
    return retriever_searcher(retriever, r.topk, r.max_passage_tokens, cfg.rollout.max_obs_tokens), retriever


def ablated_searcher(mode: str, searcher: Searcher, retriever, tokenizer, k: int, max_passage_tokens: Optional[int],
                     max_obs_tokens: Optional[int], seed: int = 0) -> Searcher:
    """The closed-book controls of an evaluation (``eval.observations``): ``real`` gives ``searcher`` back; ``none``
    answers every search with an empty ``<information></information>`` block (no passage); ``shuffled`` with ``k``
    passages drawn at random from the corpus (the in-process ``retriever``'s), seeded by ``seed`` and the query's
    text, so an observation has a real one's form and length but nothing the query asked for. Either shows how
    much of a held-out score comes from retrieval."""
    if mode == "real":
        return searcher
    if mode == "none":
        from fastcredit.retrieval.observation import information_block

        empty = list(tokenizer(information_block(""), add_special_tokens=False)["input_ids"])

        def blank(queries: list[str]) -> list[tuple[list[int], list[str]]]:
            return [(list(empty), []) for _ in queries]

        return blank
    if mode != "shuffled":
        raise ValueError(f"unknown observations mode {mode!r}; valid: real, none, shuffled")
    if retriever is None:
        from fastcredit.config import ConfigError

        raise ConfigError("eval.observations=shuffled draws passages from the in-process index; it needs "
                          "retrieval.backend=local")
    import hashlib

    n = len(retriever.corpus)

    def shuffled(queries: list[str]) -> list[tuple[list[int], list[str]]]:
        if not queries:
            return []
        rows = []
        for q in queries:
            key = int.from_bytes(hashlib.blake2b(f"{seed}\x1f{q}".encode(), digest_size=8).digest(), "big") >> 1
            rows.append(torch.randint(n, (k,), generator=torch.Generator().manual_seed(key)))
        rows = torch.stack(rows)
        ids, cu = retriever.observation_tokens(None, k, max_passage_tokens, max_obs_tokens, rows=rows)
        ids, cu = ids.cpu().tolist(), cu.cpu().tolist()
        return [(ids[cu[i]:cu[i + 1]], [retriever.corpus.id(r) for r in rows[i].tolist()]) for i in range(len(queries))]

    shuffled.torch_device = getattr(searcher, "torch_device", torch.device("cpu"))
    return shuffled


def eval_searcher(cfg: TrainConfig, searcher: Searcher, retriever, tokenizer, distributed: bool = False) -> Searcher:
    """What held-out searches go to: the rollout's ``searcher``, or the closed-book control ``eval.observations``
    names (:func:`ablated_searcher`), seeded by the evaluation's seed. A shuffled control draws from one process's
    whole index: not under torchrun (``distributed``) with ``retrieval.across_ranks=shard``."""
    mode = cfg.eval.observations
    if mode == "shuffled" and distributed and cfg.retrieval.across_ranks == "shard":
        from fastcredit.config import ConfigError

        raise ConfigError("eval.observations=shuffled draws from one process's whole index; under torchrun set "
                          "retrieval.across_ranks=replicate")
    r = cfg.retrieval
    return ablated_searcher(mode, searcher, retriever, tokenizer, r.topk, r.max_passage_tokens,
                            cfg.rollout.max_obs_tokens, seed=cfg.eval.seed_for(cfg.seed))
