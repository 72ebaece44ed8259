"""The search agent loop: every trajectory is a small state machine over turns.

    generate until </search>, </answer> or EOS  →  classify the action  →  retrieve (search)
    or a corrective message (invalid)  →  append <information>…</information>  →  generate …

How a turn is cut and classified (stopped at tags, or Search-R1's first complete pair with
``rollout.stop_at_tags: false``) is :mod:`fastcredit.rollout.actions`.

Two schedules over the same state machine (:class:`Episode`):

* ``async``: one coroutine per trajectory; a trajectory continues as soon as its own
  retrieval returns. The engine batches concurrent generation requests (vLLM: continuous
  batching, a returning turn joins the running batch at the next scheduler step; HF:
  micro-batches by size and time) and
  :class:`AsyncSearch` micro-batches retrieval requests by size and time, so a trajectory
  that finished its turn never waits for the slowest one of the batch.
* ``lockstep``: every active trajectory generates one turn in one engine call, then all
  of their searches go to the retriever in one call (Search-R1's ``run_llm_loop``). Kept as
  the baseline of ``bench/bench_rollout.py``.

Both report where the rollout's wall time went (:class:`Activity`): seconds with generation
in flight, with retrieval in flight, and with both (``time/rollout/overlap``: in async mode
some episodes decode while others wait for the retriever; in lockstep never), and each
trajectory's own waits; and what the engine's steps did (``engine/*``, an engine's
``take_step_counters``: sequences in flight a step, the steps that prefilled new requests and their
seconds, prompt tokens and those the prefix cache served, decoded tokens).

Token ids are never re-tokenized: the action's ids are the engine's sampled ids and the
observation's ids come from the retriever's token store (or are tokenized once, for the
corrective message and for a text-only HTTP retriever). Text the policy writes itself — a
fake ``<information>`` block included — stays inside the action span, so it is trained on
and never treated as an observation. Limits (``rollout.max_turns``, ``max_action_tokens``,
``max_obs_tokens``, ``max_response_tokens``): hitting one makes the trajectory's final turn
``truncated``. Where Search-R1 and the papers leave it open: a search action on the last
allowed turn is ``truncated`` (the trajectory ended without an answer); an observation that
would leave no room for another action token truncates the turn instead of being cut.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence, Union

import torch

from fastcredit.rollout.actions import (INVALID_OBSERVATION, STOP_STRINGS, classify_action, classify_searchr1,
                                        cut_at_first_tag)
from fastcredit.rollout.engines.base import Engine, GenOutput, SamplingParams
from fastcredit.retrieval.searcher import Searcher
from fastcredit.rollout.trajectory import TrajectoryBatch, Turn, TurnKind, from_turns


class _Corrective:
    """What :meth:`Episode.on_action` returns for an invalid turn: its observation is the corrective message."""

    def __repr__(self) -> str:
        return "CORRECTIVE"


CORRECTIVE = _Corrective()
# on_action's answer: the query to search, CORRECTIVE, or None when the trajectory ended
NextObservation = Union[str, _Corrective, None]



@dataclass
class AgentLimits:
    """Budgets of one trajectory (``rollout.*``)."""

    max_turns: int = 4
    max_action_tokens: int = 500
    max_obs_tokens: int = 500
    max_response_tokens: int = 4096
    stop_at_tags: bool = True  # False: Search-R1's turns (no stop strings; the action is cut after generating)

    @classmethod
    def from_config(cls, rollout_cfg) -> "AgentLimits":
        return cls(rollout_cfg.max_turns, rollout_cfg.max_action_tokens, rollout_cfg.max_obs_tokens,
                   rollout_cfg.max_response_tokens, rollout_cfg.stop_at_tags)


@dataclass
class StepInfo:
    """Text-level record of one turn, for judges and logs."""

    kind: TurnKind
    action_text: str
    query: Optional[str] = None
    obs_text: str = ""
    retrieved_ids: list = field(default_factory=list)
    refined_from: Optional[str] = None  # ProCeed: the rejected action's text
    critic_score: Optional[int] = None  # ProCeed: the process critic's score of the kept step


class Episode:
    """One trajectory's state: context, turns, budgets. Schedules call ``next_request`` /
    ``on_action`` / ``on_observation`` until ``done``."""

    def __init__(self, prompt_ids: Sequence[int], tokenizer, limits: AgentLimits, sampling: SamplingParams,
                 invalid_ids: list[int], meta: Optional[dict] = None):
        self.prompt_ids = list(prompt_ids)
        self.meta = dict(meta or {})  # question, golds, proceed flag, ... (read by hooks and judges)
        self.context = list(prompt_ids)
        self.tokenizer, self.limits, self.sampling, self.invalid_ids = tokenizer, limits, sampling, invalid_ids
        self.turns: list[Turn] = []
        self.steps: list[StepInfo] = []
        self.logprobs: list[float] = []
        self.logprobs_missing = False  # an action came without the engine's log-probs (not requested)
        self.response_len = 0
        self.decoded_tokens = 0  # every token the engine generated, those cut after a tag included
        self.done = False
        self._pending: Optional[tuple] = None  # (action ids, logprobs, step) awaiting its observation
        self._demo_next = False  # the next finished turn's action is a refined (demonstration) one

    def next_request(self) -> SamplingParams:
        """Sampling parameters of the next action (its token budget is what is left)."""
        budget = min(self.limits.max_action_tokens, self.limits.max_response_tokens - self.response_len)
        s = self.sampling
        seed = self.meta.get("seed", s.seed)
        if seed is not None:  # a trajectory's own seed, moved on every turn: reproducible, never repeated
            seed = int(seed) + 7919 * len(self.turns)
        return SamplingParams(max_tokens=max(budget, 1), temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                              stop=list(STOP_STRINGS) if self.limits.stop_at_tags else [],
                              stop_token_ids=list(s.stop_token_ids), logprobs=s.logprobs,
                              seed=seed)

    def on_action(self, out: GenOutput) -> NextObservation:
        """Record an action; returns the query to search, :data:`CORRECTIVE` for the corrective message, or
        None when the trajectory ended (answer, truncation). The action's kind: :mod:`fastcredit.rollout.actions`
        (Search-R1's first complete pair with ``stop_at_tags`` off)."""
        ids = list(out.token_ids)
        self.decoded_tokens += len(ids)
        lps = list(out.logprobs) if out.logprobs is not None else [0.0] * len(ids)
        self.logprobs_missing |= out.logprobs is None and bool(ids)
        if not self.limits.stop_at_tags:
            keep, tagged = cut_at_first_tag(ids, self.tokenizer)
            ids, lps = ids[:keep], lps[:keep]
            if tagged:  # as if it had stopped there
                out = replace(out, token_ids=ids, finish_reason="stop")
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        kind, query = classify_action(text, out) if self.limits.stop_at_tags else classify_searchr1(text)
        step = StepInfo(kind, text, query)
        out_of_length = self.response_len + len(ids) >= self.limits.max_response_tokens
        last_turn = len(self.turns) + 1 >= self.max_turns
        if kind != TurnKind.ANSWER and (out_of_length or last_turn):
            kind = step.kind = TurnKind.TRUNCATED
        if kind in (TurnKind.ANSWER, TurnKind.TRUNCATED):
            self._finish_turn(ids, lps, step, [], out.version)
            self.done = True
            return None
        self._pending = (ids, lps, step, out.version)
        return query if kind == TurnKind.SEARCH else CORRECTIVE

    def on_observation(self, obs_ids: Sequence[int], retrieved_ids: Sequence[str] = ()) -> None:
        """Append the observation of the pending action (capped by ``max_obs_tokens``)."""
        ids, lps, step, version = self._pending
        self._pending = None
        obs = list(obs_ids)[: self.limits.max_obs_tokens]
        if self.response_len + len(ids) + len(obs) + 1 > self.limits.max_response_tokens:
            step.kind = TurnKind.TRUNCATED  # no room left for another action token
            self._finish_turn(ids, lps, step, [], version)
            self.done = True
            return
        step.obs_text = self.tokenizer.decode(obs, skip_special_tokens=False)
        step.retrieved_ids = list(retrieved_ids)
        self._finish_turn(ids, lps, step, obs, version)

    def replace_last_step(self, out: GenOutput, refined_from: str) -> NextObservation:
        """ProCeed: drop the last finished turn and take ``out`` (refined tokens, ``demo = 1``) in its place."""
        last = self.turns.pop()
        self.steps.pop()
        n = len(last.action_ids) + len(last.obs_ids)
        del self.context[len(self.context) - n:]
        del self.logprobs[len(self.logprobs) - n:]
        self.response_len -= n
        self.done = False
        self._demo_next = True
        if out.version is None:  # a critic's refinement: it belongs to the rollout of the turn it replaces
            out = replace(out, version=last.version)
        query = self.on_action(out)
        step = self.steps[-1] if self.done else self._pending[2]
        step.refined_from = refined_from
        return query

    def _finish_turn(self, ids, lps, step: StepInfo, obs: list[int], version: Optional[int]) -> None:
        demo = [1] * len(ids) if self._demo_next else None
        self._demo_next = False
        self.turns.append(Turn(ids, step.kind, obs, demo=demo, version=version))
        self.steps.append(step)
        self.context += ids + obs
        self.logprobs += lps + [0.0] * len(obs)
        self.response_len += len(ids) + len(obs)

    @property
    def max_turns(self) -> int:
        """The trajectory's action budget: ``rollout.max_turns``, or its question's own budget where that is smaller
        (``meta["max_turns"]``: the lookup world's K + slack searches and the answer)."""
        own = self.meta.get("max_turns")
        return self.limits.max_turns if own is None else min(self.limits.max_turns, int(own))

    @property
    def action_texts(self) -> list[str]:
        return [s.action_text for s in self.steps]


class AsyncSearch:
    """Micro-batched retrieval for concurrent trajectories (``retrieval.batch_size`` / ``batch_timeout_ms``).

    An in-process retriever on a CPU searches on the event loop's thread, between two of the engine's steps and on
    the same cores: there a batch waits past its timeout while more trajectories are generating than wait for a
    search (``generating``: how many, :class:`Activity`), so the encoder's fixed cost a batch is paid for many
    queries, not for the one or two that finish in each ~10 ms engine step; the engine is never left idle by it.
    """

    def __init__(self, searcher: Searcher, max_batch: int = 256, timeout_ms: float = 2.0,
                 generating: Optional[Callable[[], int]] = None):
        from fastcredit.runtime.batching import MicroBatcher
        from fastcredit.runtime.threads import CallerExecutor, rollout_executor

        # An in-process retriever's torch work on a CPU runs on the loop's thread (one OpenMP team a process); a
        # GPU one's, or a server's HTTP round trips, in a worker thread that ends with the rollout (batcher.close).
        device = getattr(searcher, "torch_device", None)
        executor = rollout_executor(device, "retrieval") if device is not None else None
        shares_thread = isinstance(executor, CallerExecutor) and generating is not None
        self.batcher = MicroBatcher(searcher, max_batch=max_batch, timeout_ms=timeout_ms, max_queue=1 << 20,
                                    executor=executor, own_executor=True,
                                    hold=(lambda queued: queued < generating()) if shares_thread else None)
        self.calls = 0

    async def __call__(self, query: str) -> tuple[list[int], list[str]]:
        self.calls += 1
        return (await self.batcher.submit([query]))[0]


class Activity:
    """Wall time of a rollout with generation in flight, with retrieval in flight, and with both at once
    (the overlap: episodes decoding while others wait for the retriever), plus each episode's own waits."""

    KINDS = ("generate", "retrieval")

    def __init__(self):
        self.inflight = dict.fromkeys(self.KINDS, 0)
        self.busy = dict.fromkeys(self.KINDS + ("overlap",), 0.0)
        self.waited = dict.fromkeys(self.KINDS, 0.0)  # summed over episodes
        self._t = time.perf_counter()

    def _advance(self) -> float:
        now = time.perf_counter()
        dt, self._t = now - self._t, now
        on = [k for k in self.KINDS if self.inflight[k]]
        for k in on:
            self.busy[k] += dt
        if len(on) == 2:
            self.busy["overlap"] += dt
        return now

    @contextlib.contextmanager
    def __call__(self, kind: str, requests: int = 1):
        start = self._advance()
        self.inflight[kind] += requests
        try:
            yield
        finally:
            end = self._advance()
            self.inflight[kind] -= requests
            self.waited[kind] += (end - start) * requests

    def stats(self, episodes: int) -> dict:
        self._advance()
        B = max(episodes, 1)
        return {"time/rollout/generating": self.busy["generate"], "time/rollout/retrieving": self.busy["retrieval"],
                "time/rollout/overlap": self.busy["overlap"],
                "time/rollout/generate_wait_per_traj": self.waited["generate"] / B,
                "time/rollout/retrieval_wait_per_traj": self.waited["retrieval"] / B}


def searcher_session(searcher):
    """The searcher's session for one rollout (retrieval sharded across ranks meets the other ranks in
    rounds while it is open, :class:`fastcredit.retrieval.ranks.CrossRankIndex`); a no-op for the others."""
    session = getattr(searcher, "session", None)
    return session() if session is not None else contextlib.nullcontext()


@dataclass
class RolloutResult:
    """What a rollout returns: the packed batch plus what judges, rewards and logs need."""

    batch: TrajectoryBatch
    prompt_ids: list  # [B] list[int]
    episodes: list  # [B] Episode
    seconds: float
    stats: dict


def _stats(episodes: list[Episode], seconds: float, search_calls: int, activity: Activity) -> dict:
    kinds = [s.kind for e in episodes for s in e.steps]
    B = max(len(episodes), 1)
    tokens = sum(e.response_len for e in episodes)
    return {"turns_per_traj": len(kinds) / B, "searches_per_traj": kinds.count(TurnKind.SEARCH) / B,
            # generated tokens, the ones Search-R1's turns cut after the tag included (the decode's real work)
            "decoded_tokens_per_traj": sum(e.decoded_tokens for e in episodes) / B, "trajectories": len(episodes),
            "invalid_per_traj": kinds.count(TurnKind.INVALID) / B,
            "truncated_frac": kinds.count(TurnKind.TRUNCATED) / B,
            "response_tokens_mean": tokens / B, "rollout_s": seconds,
            "trajectories_per_s": len(episodes) / max(seconds, 1e-9),
            "retrieval_batches": search_calls, **activity.stats(len(episodes))}


class AgentLoop:
    """Rolls out trajectories with an engine and a searcher under :class:`AgentLimits`."""

    def __init__(self, engine: Engine, searcher: Searcher, limits: AgentLimits, sampling: SamplingParams,
                 mode: str = "async", retrieval_batch: int = 256, retrieval_timeout_ms: float = 2.0,
                 step_hook=None):
        if mode not in ("async", "lockstep"):
            raise ValueError(f"unknown rollout.mode {mode!r}; valid: async, lockstep")
        self.engine, self.searcher, self.limits, self.sampling, self.mode = engine, searcher, limits, sampling, mode
        self.tokenizer = engine.tokenizer
        self.retrieval_batch, self.retrieval_timeout_ms = retrieval_batch, retrieval_timeout_ms
        self.step_hook = step_hook  # async (loop, episode, search) -> None after each step (ProCeed)
        self.activity = Activity()  # the current rollout's (``run`` starts a new one)
        self.invalid_ids = list(self.tokenizer(INVALID_OBSERVATION, add_special_tokens=False)["input_ids"])

    def _episodes(self, prompts: Sequence[Sequence[int]], metas) -> list[Episode]:
        metas = metas if metas is not None else [None] * len(prompts)
        return [Episode(p, self.tokenizer, self.limits, self.sampling, self.invalid_ids, m)
                for p, m in zip(prompts, metas)]

    def run(self, prompts: Sequence[Sequence[int]], group_id: Optional[Sequence[int]] = None,
            metas: Optional[Sequence[dict]] = None) -> RolloutResult:
        """Roll out one trajectory per prompt (repeat a prompt G times for a group).

        ``metas``: per trajectory a dict kept on its :class:`Episode` (question, gold answers,
        ``proceed`` flag) for step hooks and judges.
        """
        t0 = time.perf_counter()
        if self.mode == "lockstep" and self.step_hook is not None:
            raise ValueError("step hooks (ProCeed rewinds) need rollout.mode=async")
        self.activity = Activity()
        counters = getattr(self.engine, "take_step_counters", None)
        if counters is not None:
            counters()  # what the engine did before (a judge, an evaluation) is not this rollout's
        # Open even with no prompts: a rank with nothing to roll out still meets the others' retrieval rounds.
        try:
            with searcher_session(self.searcher):
                if self.mode == "lockstep":
                    episodes, calls = self._lockstep(prompts, metas)
                else:
                    episodes, calls = asyncio.run(self._async(prompts, metas))
        finally:
            end = getattr(self.engine, "end_rollout", None)
            if end is not None:  # no thread of the rollout outlives it (fastcredit.runtime.threads)
                end()
        seconds = time.perf_counter() - t0
        result = self._result(episodes, group_id, seconds, calls)
        if counters is not None:  # the engine's steps: sequences a step, prefill and prefix-cache tokens (engine/*)
            result.stats.update(counters())
        return result

    async def _async(self, prompts, metas) -> tuple[list[Episode], int]:
        search = AsyncSearch(self.searcher, self.retrieval_batch, self.retrieval_timeout_ms,
                             generating=lambda: self.activity.inflight["generate"])
        search.batcher.start()
        episodes = self._episodes(prompts, metas)
        try:
            await asyncio.gather(*(self._drive(e, search) for e in episodes))
        finally:
            await search.batcher.close()
        return episodes, search.batcher.batches

    async def _drive(self, e: Episode, search: AsyncSearch) -> None:
        while not e.done:
            with self.activity("generate"):
                out = await self.engine.agenerate(e.context, e.next_request())
            query = e.on_action(out)
            if query is not None:
                await self.observe(e, query, search)
            if self.step_hook is not None:
                await self.step_hook(self, e, search)

    async def observe(self, e: Episode, query: Union[str, _Corrective], search) -> None:
        """Search ``query`` (:data:`CORRECTIVE`: the corrective message) and append the observation to ``e``."""
        if query is CORRECTIVE:
            e.on_observation(self.invalid_ids)
            return
        with self.activity("retrieval"):
            obs, ids = await search(query)
        e.on_observation(obs, ids)

    def _lockstep(self, prompts, metas) -> tuple[list[Episode], int]:
        episodes = self._episodes(prompts, metas)
        calls = 0
        while True:
            active = [e for e in episodes if not e.done]
            if not active:
                return episodes, calls
            with self.activity("generate", len(active)):
                outs = self.engine.generate([e.context for e in active], [e.next_request() for e in active])
            queries = [(e, e.on_action(o)) for e, o in zip(active, outs)]
            searching = [(e, q) for e, q in queries if isinstance(q, str)]
            if searching:
                calls += 1
                with self.activity("retrieval", len(searching)):
                    found = self.searcher([q for _, q in searching])
                for (e, _), (obs, ids) in zip(searching, found):
                    e.on_observation(obs, ids)
            for e, q in queries:
                if q is CORRECTIVE:
                    e.on_observation(self.invalid_ids)

    def _result(self, episodes: list[Episode], group_id, seconds: float, calls: int) -> RolloutResult:
        batch = from_turns([e.turns for e in episodes],
                           group_id=list(group_id) if group_id is not None else list(range(len(episodes))))
        # the engine's log-probs of the sampled tokens (0 on observations), only when every action brought them
        if not any(e.logprobs_missing for e in episodes):
            batch.rollout_logp_N = torch.tensor([lp for e in episodes for lp in e.logprobs], dtype=torch.float32)
        return RolloutResult(batch, [e.prompt_ids for e in episodes], episodes, seconds,
                             _stats(episodes, seconds, calls, self.activity))
