"""The micro-batcher's ``hold``: work that shares the caller's thread goes first (fastcredit.runtime.batching), and
the rollout's searches use it only where they share the engine's thread (fastcredit.rollout.agent.AsyncSearch)."""
import asyncio

import torch

from fastcredit.rollout.agent import AsyncSearch
from fastcredit.runtime.batching import MicroBatcher
from fastcredit.runtime.threads import CallerExecutor


def test_a_held_batch_waits_past_its_timeout_and_goes_when_hold_lets_go():
    seen, gate = [], [3]

    def fn(items):
        seen.append(list(items))
        return [f"r-{x}" for x in items]

    async def main():
        b = MicroBatcher(fn, max_batch=8, timeout_ms=1.0, executor=CallerExecutor(), hold=lambda q: q < gate[0])
        b.start()
        first = [asyncio.ensure_future(b.submit([x])) for x in ("a", "b")]
        await asyncio.sleep(0.05)  # fifty timeouts: without hold the two would have gone
        assert seen == []
        third = asyncio.ensure_future(b.submit(["c"]))  # three queued: hold lets go at this arrival
        assert await asyncio.gather(*first, third) == [["r-a"], ["r-b"], ["r-c"]]
        assert seen == [["a", "b", "c"]]
        late = asyncio.ensure_future(b.submit(["d"]))
        await asyncio.sleep(0.02)
        assert seen == [["a", "b", "c"]]
        gate[0] = 0  # what hold depends on changes with no arrival: the batch goes at the next timeout
        assert await late == ["r-d"] and seen[-1] == ["d"]
        full = await asyncio.gather(*(b.submit([str(i)]) for i in range(8)))  # a full batch never waits
        assert len(full) == 8
        await b.close()

    asyncio.run(main())


def test_searches_hold_for_generation_only_where_they_share_its_thread():
    def searcher(queries):
        return [([1], ["d"]) for _ in queries]

    generating = [5]
    searcher.torch_device = torch.device("cpu")  # in process, on the host: the loop's thread
    hold = AsyncSearch(searcher, 64, 2.0, generating=lambda: generating[0]).batcher.hold
    assert hold(4) and not hold(5)
    generating[0] = 1
    assert not hold(1) and hold(0)
    del searcher.torch_device  # a server's round trips run in a worker thread of their own
    assert AsyncSearch(searcher, 64, 2.0, generating=lambda: 5).batcher.hold is None
