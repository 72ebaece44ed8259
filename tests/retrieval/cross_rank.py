"""Two ranks searching one index split across them (gloo on a CPU), for tests/retrieval/test_cross_rank.py.

    torchrun --standalone --nproc_per_node=2 tests/retrieval/cross_rank.py DATA OUT main
    torchrun --standalone --nproc_per_node=2 tests/retrieval/cross_rank.py DATA OUT errors

DATA holds what the test wrote: vectors.npy, queries.npy, flat.index, ivfpq.index, and toy/
(a toy retriever build, its encoder and corpus). Every scenario runs on both ranks in step
(sessions pair up); each rank writes OUT/rank<r>.json: {scenario: "ok" or what went wrong}.
"""
import json
import os
import sys
import threading
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

from fastcredit.retrieval.exact import exact_scores, load_index_shard
from fastcredit.retrieval.ranks import CrossRankIndex, open_cross_rank_index

DATA, OUT, WHICH = sys.argv[1:4]
CADENCE_MS = 5.0


def truth(x: np.ndarray, q: torch.Tensor, k: int):
    """One flat index over every row: exact scores, best first, ties by lower row
    (np.lexsort, not the code under test)."""
    s = exact_scores(q, torch.from_numpy(x).expand(q.shape[0], *x.shape)).numpy()          # [Q, N]
    order = np.lexsort((np.broadcast_to(np.arange(x.shape[0]), s.shape), -s))[:, :k]
    return torch.from_numpy(np.take_along_axis(s, order, 1)), torch.from_numpy(order).long()


def same(got, want, what: str) -> None:
    (gs, gr), (ws, wr) = got, want
    if not (torch.equal(gr, wr) and torch.equal(gs, ws)):
        bad = (gr != wr).any(1).nonzero().flatten()[:3].tolist()
        raise AssertionError(f"{what}: rows differ in queries {bad}: got {gr[bad].tolist()}, want {wr[bad].tolist()}")


def scenario_concurrent(rank, x, q):
    """Three threads a rank, each with its own k and queries, two searches each, inside one session; flat and torch."""
    for kind in ("flat", "torch"):
        index = open_cross_rank_index(f"{DATA}/flat.index", kind, rank, 2, cadence_ms=CADENCE_MS)
        whole = load_index_shard(f"{DATA}/flat.index", kind)[0]
        ks = (1, 5, 40) if rank == 0 else (3, 7, 12)
        got, errors = {}, []

        def work(t, k):
            try:
                for rep in range(2):
                    sub = q[(t + rep + 3 * rank) % 4::4]
                    got[(t, rep)] = (sub, k, index.search(sub, k))
            except Exception:  # noqa: BLE001
                errors.append(traceback.format_exc())

        with index.session():
            threads = [threading.Thread(target=work, args=(t, k)) for t, k in enumerate(ks)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        assert not errors, errors[0]
        for sub, k, res in got.values():
            same(res, truth(x, sub, k), f"{kind} k={k} vs one flat index")
            same(res, whole.search(sub, k), f"{kind} k={k} vs the whole index, exact ties")


def scenario_idle(rank, x, q):
    """Rank 1 opens a session and does nothing; rank 0 searches four times."""
    index = open_cross_rank_index(f"{DATA}/flat.index", "flat", rank, 2, cadence_ms=CADENCE_MS)
    with index.session():
        if rank == 0:
            for k in (1, 3, 6, 9):
                same(index.search(q[k:k + 9], k), truth(x, q[k:k + 9], k), f"idle peer, k={k}")


def scenario_uneven(rank, x, q):
    """Rank 0 sleeps between its searches; rank 1 searches once and leaves at once."""
    index = open_cross_rank_index(f"{DATA}/flat.index", "flat", rank, 2, cadence_ms=CADENCE_MS)
    t0 = time.time()
    with index.session():
        for i in range(4 if rank == 0 else 1):
            if rank == 0:
                time.sleep(0.3)
            sub = q[i::3]
            same(index.search(sub, 4), truth(x, sub, 4), f"uneven, search {i}")
    left = time.time() - t0
    assert left >= 1.2, f"rank {rank} left its session after {left:.2f} s, before rank 0 had finished"


def scenario_one_shot(rank, x, q):
    """Searches outside a session, on both ranks (rank 1's first one empty)."""
    index = open_cross_rank_index(f"{DATA}/flat.index", "flat", rank, 2, cadence_ms=CADENCE_MS)
    first = q[:0] if rank == 1 else q[:7]
    s, r = index.search(first, 3)
    assert s.shape == r.shape == (first.shape[0], 3)
    same((s, r), truth(x, first, 3), "one-shot")
    same(index.search(q[5:20], 8), truth(x, q[5:20], 8), "second one-shot")


def scenario_ivfpq(rank, x, q):
    """IVF-PQ split over the ranks equals the whole IVF-PQ with the same nprobe (same batch: rank 0 asks alone)."""
    import faiss

    from fastcredit.retrieval.indexes import FaissIndex

    index = open_cross_rank_index(f"{DATA}/ivfpq.index", "ivfpq", rank, 2, nprobe=4, cadence_ms=CADENCE_MS)
    whole = load_index_shard(f"{DATA}/ivfpq.index", "ivfpq", nprobe=4)[0]
    raw = FaissIndex(faiss.read_index(f"{DATA}/ivfpq.index"), nprobe=4)
    with index.session():
        if rank == 0:
            for k in (1, 3, 10):
                got = index.search(q, k)
                same(got, whole.search(q, k), f"ivfpq k={k} vs the whole ivfpq")
                raw_s, raw_r = raw.search(q, k)
                assert torch.equal(got[0], raw_s), f"k={k}: scores differ from FAISS's own whole-index search"
                s = got[0]  # FAISS orders ties its own way: rows agree where a score is not tied
                alone = (s != torch.roll(s, 1, 1)) & (s != torch.roll(s, -1, 1)) & (s > s[:, -1:])
                assert torch.equal(got[1][alone], raw_r[alone]), f"k={k}: rows differ from FAISS's where nothing ties"


def scenario_retriever(rank, x, q):
    """make_searcher with DistInfo on 2 ranks: the same rows and observations as one process's retriever."""
    from fastcredit.retrieval.searcher import make_searcher
    from fastcredit.config import TrainConfig
    from fastcredit.distributed.process_group import DistInfo
    from fastcredit.retrieval.retriever import open_retriever
    from fastcredit.retrieval.testing import tiny_policy_tokenizer
    from fastcredit.retrieval.searcher import retriever_searcher

    toy = json.load(open(f"{DATA}/toy/paths.json"))
    cfg = TrainConfig()
    r = cfg.retrieval
    r.corpus, r.index, r.encoder, r.device, r.topk = toy["corpus"], toy["build"], toy["encoder"], "cpu", 3
    tok = tiny_policy_tokenizer(toy["passages"])
    searcher, retriever = make_searcher(cfg, tok, toy["corpus"], progress=False, device=torch.device("cpu"),
                                        info=DistInfo(rank=rank, world_size=2))
    assert isinstance(retriever.index, CrossRankIndex) and retriever.index.ntotal == len(retriever.corpus)
    single = open_retriever(corpus=toy["corpus"], index=toy["build"], encoder=toy["encoder"], device="cpu",
                            tokenizer=tok, progress=False)
    queries = toy["queries"][rank::2]
    with retriever.index.session():
        got = retriever.search_rows(queries, 5)[1]
        obs = searcher(queries)
    assert torch.equal(got, single.search_rows(queries, 5)[1]), "rows differ from the one-process retriever"
    assert obs == retriever_searcher(single, 3, r.max_passage_tokens, cfg.rollout.max_obs_tokens)(queries)


class Faulty:
    """A shard whose second search raises."""

    def __init__(self, shard):
        self.shard, self.calls = shard, 0
        self.ntotal, self.dim, self.device = shard.ntotal, shard.dim, shard.device

    def search(self, q, k):
        self.calls += 1
        if self.calls == 2:
            raise ValueError("injected shard failure")
        return self.shard.search(q, k)


def scenario_search_fails(rank, x, q):
    """Rank 0's shard raises in a round: the waiting searches of both ranks raise RuntimeError; later ones too."""
    shard, offset, total = load_index_shard(f"{DATA}/flat.index", "flat", rank, 2)
    index = CrossRankIndex(Faulty(shard) if rank == 0 else shard, offset, total, rank, 2, cadence_ms=CADENCE_MS)
    messages = []
    try:
        with index.session():
            for i in range(5):
                try:
                    index.search(q[i:i + 4], 3)
                except RuntimeError as exc:
                    messages.append(str(exc))
                    break
            try:
                index.search(q[:2], 3)
            except RuntimeError as exc:
                messages.append(str(exc))
    except RuntimeError as exc:  # leaving a failed session raises too
        messages.append(str(exc))
    want = "injected shard failure" if rank == 0 else "rank 0's shard search failed"
    assert len(messages) == 3 and want in messages[0] and all(want in m for m in messages[1:]), messages


def scenario_timeout(rank, x, q):
    """Rank 1 never opens its session: rank 0's collective times out and its search raises, within the timeout."""
    shard, offset, total = load_index_shard(f"{DATA}/flat.index", "flat", rank, 2)
    index = CrossRankIndex(shard, offset, total, rank, 2, cadence_ms=CADENCE_MS, timeout_s=2.0)
    if rank == 1:
        time.sleep(4.0)
        return
    t0 = time.time()
    try:
        with index.session():
            index.search(q[:3], 3)
        raise AssertionError("the search did not fail")
    except RuntimeError as exc:
        took = time.time() - t0
        assert "cross-rank retrieval failed" in str(exc) and took < 4.0, (took, str(exc))
    try:
        index.search(q[:3], 3)
        raise AssertionError("a later search did not fail")
    except RuntimeError:
        pass


SCENARIOS = {"main": [scenario_concurrent, scenario_idle, scenario_uneven, scenario_one_shot, scenario_ivfpq,
                      scenario_retriever],
             "errors": [scenario_search_fails, scenario_timeout]}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x, q = np.load(f"{DATA}/vectors.npy"), torch.from_numpy(np.load(f"{DATA}/queries.npy"))
    results = {}
    for fn in SCENARIOS[WHICH]:
        name = fn.__name__.removeprefix("scenario_")
        t0 = time.time()
        try:
            fn(rank, x, q)
            results[name] = "ok"
        except Exception:  # noqa: BLE001  (reported to the test, which names the scenario)
            results[name] = traceback.format_exc()
        results[f"{name}_s"] = round(time.time() - t0, 2)
        dist.barrier()
    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # NOTE: gloo's threads race the interpreter's exit otherwise (aborts 10-20% of runs)


if __name__ == "__main__":
    main()
