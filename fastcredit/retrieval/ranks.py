"""Retrieval split across the ranks of a torchrun job: each of W ranks holds 1/W of the index rows.

    index = open_cross_rank_index("e5_Flat.index", "flat", rank, world_size, device="cuda")  # every rank
    with index.session():                      # every rank, as many times, in the same order
        scores, rows = index.search(q, k)      # any thread; rows are global

While a session is open, a round thread meets the other ranks in retrieval rounds. One round,
on a process group of its own:

    1. take the pending searches (at most ``max_batch`` queries; none: wait up to ``cadence_ms``)
    2. all_gather [count, k, done] of every rank       all done and nothing asked: leave together
    3. all_gather the queries, padded to the largest count            [W, Qmax, D]
    4. search every rank's queries in the local shard, rows made global  [Qtotal, K], K = largest k
    5. all_gather every shard's lists, merge_topk                       [W, Qtotal, K] -> [Qtotal, K]
    6. each search takes its own queries and its first k columns

A round where nobody asks anything ends after step 2. Each shard orders ties by lower row
(:class:`~fastcredit.retrieval.exact.ExactTiesIndex`), shards are contiguous row ranges in
rank order and merge_topk keeps the lower shard first on ties: the merged lists are those of
one index over every row, ids and order. Shapes: W ranks, Q queries, K results, D dims.
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import threading
from typing import Optional

import torch
import torch.distributed as dist

from fastcredit.runtime.devices import bind_thread, hand_over, record, side_stream
from fastcredit.distributed.process_group import serves
from fastcredit.retrieval.ops import merge_topk

_FAILED = -2  # a row no shard returns (rows are >= 0, or -1 for none): "my search failed" in step 5


class _Search:
    """One search call waiting for its round."""

    def __init__(self, q: torch.Tensor, k: int):
        self.q, self.k = q, k
        self.ready = record(q.device)  # the caller's stream wrote q; the round thread's stream waits for it
        self.done = threading.Event()
        self.result: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.written = None  # the round stream's event after the result
        self.error: Optional[BaseException] = None


def _empty(n: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((n, k), float("-inf"), device=device),
            torch.full((n, k), -1, dtype=torch.long, device=device))


class CrossRankIndex:
    """One rank's shard of an index, searched together with the other ranks' shards (module docstring).

    ``shard``: an index over this rank's rows (``search(q, k)`` → local rows, ties by lower row);
    ``row_offset`` turns them into global rows; ``ntotal``: the global row count. Every rank of
    ``group`` (default: all) constructs its CrossRankIndex at the same point (a process group is
    made: gloo for a CPU shard, the default backend for a GPU one). Collectives time out after
    ``timeout_s``; a rank whose peer is late by more than that fails.

    Sessions pair up across ranks: every rank opens the same number of sessions in the same
    order (the agent loop's rollouts; the trainer's warm-start search). A session
    entered while one is open on this rank joins it; a ``search`` made with none open opens a
    one-shot session around itself, so it must be made on every rank too (its queries may be
    empty). On leaving a session the rank keeps answering rounds until every rank has left.
    """

    def __init__(self, shard, row_offset: int, ntotal: int, rank: int, world_size: int, group=None,
                 device=None, cadence_ms: float = 5.0, max_batch: int = 1024, timeout_s: float = 1800.0):
        self.shard, self.row_offset, self.ntotal, self.dim = shard, int(row_offset), int(ntotal), shard.dim
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device) if device is not None else shard.device
        self.cadence_s, self.max_batch = cadence_ms / 1000, max_batch
        ranks = None if group is None else dist.get_process_group_ranks(group)
        # a group of some ranks of the job (a split placement's rollout ranks): only they take part in making it
        local = {} if ranks is None else {"use_local_synchronization": True}
        self._group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s),
                                     backend="gloo" if shard.device.type == "cpu" else None, **local)
        if (dist.get_rank(self._group), dist.get_world_size(self._group)) != (rank, world_size):
            raise ValueError(f"rank {rank} of {world_size} given, but the process group has this process as rank "
                             f"{dist.get_rank(self._group)} of {dist.get_world_size(self._group)}")
        # on a GPU the group is cpu:gloo,cuda:nccl (process_group.backend_for): the rounds gather on the device
        cuda = shard.device.type == "cuda" and serves("cuda", self._group)
        self._comm = shard.device if cuda else torch.device("cpu")
        self._cv = threading.Condition()
        self._pending: collections.deque[_Search] = collections.deque()
        self._taken: list[_Search] = []     # the round thread's current searches
        self._depth = 0                     # sessions open on this rank (inner ones join the outermost)
        self._done = False                  # the outermost session was left: answer rounds with nothing
        self._closing = False               # ... and its round thread has not finished yet
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    # ---------------------------------------------------------------- callers' side

    def search(self, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [Q, D] → (scores float32 [Q, k], rows int64 [Q, k], -1 = none) on ``self.device``.

        Blocks until a round answers; thread-safe. Raises RuntimeError if the rounds failed.
        """
        if q.dim() != 2 or q.shape[1] != self.dim:
            raise ValueError(f"queries must be [Q, {self.dim}], got {tuple(q.shape)}")
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        job = _Search(q.detach().to(self._comm, torch.float32).contiguous(), k)
        with self._cv:
            self._raise_if_failed()
            inside = self._depth > 0 and not self._done
            if inside and q.shape[0] and k:
                self._pending.append(job)
                self._cv.notify_all()
        if not inside:
            with self.session():  # one-shot: the other ranks make the same call
                return self.search(q, k)
        if not (q.shape[0] and k):
            return _empty(q.shape[0], k, self.device)
        job.done.wait()
        if job.error is not None:
            raise RuntimeError(f"cross-rank retrieval failed: {job.error}") from job.error
        hand_over(job.written, *job.result)
        return job.result

    @contextlib.contextmanager
    def session(self):
        """Meet the other ranks in retrieval rounds while inside. Leaving waits until every rank has left, and
        raises RuntimeError when the rounds failed.

        An exception leaving the block does not wait: the other ranks may be waiting for this one elsewhere (in the
        caller's next collective, say, as every rank's evaluation gathers its shard inside the session), so waiting
        for them to leave would wait for ever. The round thread goes on answering rounds with nothing, and the
        exception goes on at once, to end the process (torchrun then stops the job). A session entered later on
        this rank waits for that thread to finish first."""
        self._enter()
        try:
            yield self
        except BaseException:
            self._leave(quiet=True, wait=False)
            raise
        self._leave()

    def _enter(self) -> None:
        with self._cv:
            while self._closing:
                self._cv.wait()
            self._raise_if_failed()
            if self._depth == 0:
                self._done = False
                self._thread = threading.Thread(target=self._rounds, name=f"retrieval-rounds-{self.rank}", daemon=True)
                self._thread.start()
            self._depth += 1

    def _leave(self, quiet: bool = False, wait: bool = True) -> None:
        with self._cv:
            self._depth -= 1
            if self._depth:
                return
            thread = self._thread  # None: it ended already (the rounds failed)
            self._done, self._closing = True, thread is not None
            self._cv.notify_all()
        if thread is not None and wait:  # it ends when every rank is done, and clears _closing then (_rounds)
            thread.join()
        if not quiet:
            with self._cv:
                self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"cross-rank retrieval failed: {self._error}") from self._error

    # ---------------------------------------------------------------- the round thread

    def _rounds(self) -> None:
        try:
            bind_thread(self._comm)
            # a stream of its own: the gathers and syncs every few ms must not queue behind vLLM's decode
            with side_stream(self._comm):
                while self._round():
                    pass
        except BaseException as exc:  # every waiting and later search raises it
            with self._cv:
                self._error = exc
                jobs, self._taken = self._taken + list(self._pending), []
                self._pending.clear()
            for job in jobs:
                job.error = exc
                job.done.set()
        finally:
            with self._cv:
                if self._thread is threading.current_thread():
                    self._thread, self._closing = None, False
                self._cv.notify_all()

    def _take(self) -> tuple[list[_Search], bool]:
        """This round's searches (at least one when any is pending, at most ``max_batch`` queries) and the done flag."""
        with self._cv:
            if not self._pending and not self._done:
                self._cv.wait(self.cadence_s)
            taken, n = [], 0
            while self._pending and (not taken or n + self._pending[0].q.shape[0] <= self.max_batch):
                taken.append(self._pending.popleft())
                n += taken[-1].q.shape[0]
            self._taken = taken
            return taken, self._done

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """all_gather over the ranks: [...] → [W, ...]."""
        out = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(out, x, group=self._group)
        return torch.stack(out)

    def _round(self) -> bool:
        """One round (module docstring); False when every rank is done."""
        taken, done = self._take()
        count, k = sum(j.q.shape[0] for j in taken), max((j.k for j in taken), default=0)
        head = self._gather(torch.tensor([count, k, int(done)], device=self._comm)).cpu()    # [W, 3]
        counts, K = head[:, 0].tolist(), int(head[:, 1].max())
        if sum(counts) == 0:
            return not bool(head[:, 2].all())
        padded = torch.zeros(max(counts), self.dim, device=self._comm)
        for job in taken:
            hand_over(job.ready, job.q)
        if taken:
            padded[:count] = torch.cat([j.q for j in taken])
        everyone = self._gather(padded)                                                    # [W, Qmax, D]
        queries = torch.cat([everyone[w, :n] for w, n in enumerate(counts)])               # [Qtotal, D]
        mine, failure = self._search_shard(queries, K)
        lists = self._gather(mine)                                                         # [W, Qtotal, 2K]
        rows = lists[..., K:]
        bad = (rows == _FAILED).flatten(1).any(1).nonzero().flatten().tolist()
        if failure is not None:
            raise RuntimeError(f"rank {self.rank}'s shard search failed: "
                               f"{type(failure).__name__}: {failure}") from failure
        if bad:
            raise RuntimeError(f"rank {bad[0]}'s shard search failed (that rank raised the cause)")
        # NOTE: the float32 scores travel as int64 holding their bits (one collective, not two)
        scores = lists[..., :K].to(torch.int32).view(torch.float32)
        s, r = merge_topk(scores.contiguous(), rows.contiguous(), K)                         # [Qtotal, K]
        start = sum(counts[:self.rank])
        for job in taken:
            n = job.q.shape[0]
            job.result = (s[start:start + n, :job.k].to(self.device), r[start:start + n, :job.k].to(self.device))
            job.written = record(self.device)
            start += n
            job.done.set()
        with self._cv:
            self._taken = []
        return True

    def _search_shard(self, queries: torch.Tensor, K: int) -> tuple[torch.Tensor, Optional[Exception]]:
        """This shard's [Qtotal, K] lists packed as int64 [Qtotal, 2K] (score bits, global rows). A failed
        search sends rows of _FAILED: every rank then fails the same round, none waits on a collective."""
        try:
            s, r = self.shard.search(queries, K)
            r = torch.where(r >= 0, r + self.row_offset, r)
            return torch.cat([s.float().view(torch.int32).to(torch.int64), r.long()], 1).to(self._comm), None
        except Exception as exc:  # noqa: BLE001  (raised on every rank after the collective)
            return torch.full((queries.shape[0], 2 * K), _FAILED, dtype=torch.int64, device=self._comm), exc


def open_cross_rank_index(path: str, index_type: str, rank: int, world_size: int, group=None, device: str = "cpu",
                          dtype: Optional[torch.dtype] = None, nprobe: Optional[int] = None, cadence_ms: float = 5.0,
                          timeout_s: float = 1800.0) -> CrossRankIndex:
    """This rank's rows of an index file (``exact.load_index_shard``) as a :class:`CrossRankIndex`.

    Every rank calls it at the same point."""
    from fastcredit.retrieval.exact import load_index_shard

    shard, offset, total = load_index_shard(path, index_type, rank, world_size, device, dtype, nprobe)
    return CrossRankIndex(shard, offset, total, rank, world_size, group, cadence_ms=cadence_ms, timeout_s=timeout_s)
