"""IG-Search's scoring phase: the information gain of every search turn under the rollout policy (docs/methods.md §11).

Legend (shape suffixes): N packed response tokens, S turns, B trajectories, C scoring contexts, K the gold-answer
tokens of all contexts back to back.

    extras, metrics = score_information_gain(policy, prompts, batch, golds, tokenizer, cfg.credit.igsearch,
                                             device, max_tokens, temperature, seed)

For each search turn t with an observation and each of its question's first ``max_golds`` gold answers: the real
context ``C_t`` (the prompt and the trajectory up to and including turn t's observation) and ``N`` counterfactual
contexts ``C_t^j`` (turn t's observation replaced by the observation of another search turn of this batch: the
pool is every search turn's observation, one with the same tokens as turn t's is never drawn; ``N`` distinct
draws when the pool has that many, else with replacement), each followed by ``<answer>`` and the gold answer,
teacher-forced. One packed no-grad forward of the policy (``fastcredit.models.packed.forward_logprobs``,
micro-batched as the old log-probs are, at the rollout temperature) gives the gold tokens' log-probs; ``s(C)`` is
their weighted mean (:func:`answer_scores`); per turn the gold with the highest ``s(C_t)`` is kept and
``IG_t = s(C_t) − mean_j s(C_t^j)``. A turn without an observation, without a gold answer or without another
observation to draw gets NaN (no gain). The phase also gives each turn's query span (:func:`query_spans`), which
the estimator (``fastcredit.credit.igsearch``) rewards.
"""
from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from fastcredit.credit.types import TurnKind

SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
ANSWER_OPEN = "<answer>"  # what the policy writes before an answer; the gold follows it, space-padded as a policy
ANSWER_OPENING = "\n<answer>"  # the scored contexts' opening, as IG-Search's released code writes it
THINK_CLOSE = "</think>"
HEAD_TOKENS, HEAD_WEIGHT = 3, 3.0  # s(C): the gold's first three tokens weigh three times the rest


def _first_prefix(ids: Sequence[int], decode: Callable, holds: Callable[[int], bool]) -> int:
    """The fewest leading tokens of ``ids`` whose decoded text's length ``holds`` (len(ids) + 1: none); bisection,
    the length growing with the prefix."""
    lo, hi = 0, len(ids) + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if mid <= len(ids) and holds(len(decode(ids[:mid]))):
            hi = mid
        else:
            lo = mid + 1
    return lo


def query_span_by_text(ids: Sequence[int], decode: Callable) -> tuple[int, int]:
    """``(first, count)``: the tokens of an action whose text lies between its last ``<search>`` opening and the
    ``</search>`` closing it (the query, as ``fastcredit.rollout.actions`` reads it); ``(0, 0)`` without one. Any
    tokenizer: a token that straddles a tag is not part of the query."""
    text = decode(ids)
    close = text.rfind(SEARCH_CLOSE)
    opening = text.rfind(SEARCH_OPEN, 0, max(close, 0))
    if close < 0 or opening < 0:
        return 0, 0
    lo, hi = opening + len(SEARCH_OPEN), close
    first = _first_prefix(ids, decode, lambda n: n >= lo)
    end = _first_prefix(ids, decode, lambda n: n > hi) - 1  # the most leading tokens whose text ends by the tag
    return first, max(end - first, 0)


def single_token(tokenizer, text: str) -> Optional[int]:
    """The id of ``text`` when the tokenizer keeps it as one token, else None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def query_spans(batch, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seg_query_start_S, seg_query_len_S)`` int64: each search turn's query tokens (offset inside its action,
    count); 0, 0 on other turns. Tags that are single tokens are found by id, others through the decoded text."""
    start_S = torch.zeros(batch.num_turns, dtype=torch.int64)
    len_S = torch.zeros(batch.num_turns, dtype=torch.int64)
    open_id, close_id = single_token(tokenizer, SEARCH_OPEN), single_token(tokenizer, SEARCH_CLOSE)
    tokens = batch.tokens_N.tolist()
    starts, lengths = batch.seg_start_S.tolist(), batch.seg_action_len_S.tolist()
    for s in torch.nonzero(batch.seg_kind_S.long() == int(TurnKind.SEARCH)).flatten().tolist():
        ids = tokens[starts[s]:starts[s] + lengths[s]]
        if open_id is not None and close_id is not None:
            close = max((k for k, t in enumerate(ids) if t == close_id), default=-1)
            opening = max((k for k, t in enumerate(ids[:max(close, 0)]) if t == open_id), default=-1)
            first, count = (opening + 1, close - opening - 1) if min(close, opening) >= 0 else (0, 0)
        else:
            first, count = query_span_by_text(ids, lambda x: tokenizer.decode(x, skip_special_tokens=False))
        start_S[s], len_S[s] = first, count
    return start_S, len_S


def gold_token_ids(tokenizer, gold: str) -> list[int]:
    """The tokens of ``gold`` as they follow ``<answer>`` (the two encoded together; the opening's own tokens cut
    off); empty for an empty gold."""
    if not gold.strip():
        return []
    opening = tokenizer.encode(ANSWER_OPEN, add_special_tokens=False)
    joint = tokenizer.encode(f"{ANSWER_OPEN} {gold.strip()}", add_special_tokens=False)
    if joint[:len(opening)] == opening:
        return joint[len(opening):]
    return tokenizer.encode(f" {gold.strip()}", add_special_tokens=False)


@dataclass
class Contexts:
    """The scoring contexts of a batch: context ``c`` is ``prompts[c]`` (int64 tokens), its gold ``answers[c]``."""

    prompts: list = field(default_factory=list)  # [C] int64 tensors: the context up to and including <answer>
    answers: list = field(default_factory=list)  # [C] list[int]: the gold answer's tokens
    turn: list = field(default_factory=list)  # [C] the turn scored
    gold: list = field(default_factory=list)  # [C] which of the question's golds
    real: list = field(default_factory=list)  # [C] True: the turn's own observation; False: a counterfactual one


def draw_others(rng: random.Random, pool: list, keys: list, key: int, left: int, n: int) -> list:
    """``n`` turns of ``pool`` whose observation key (``keys``) differs from ``key`` (``left`` of them do):
    distinct when ``left >= n``, else with replacement; rejection sampling, uniform over the pool's turns."""
    got: list = []
    while len(got) < n:
        s = pool[rng.randrange(len(pool))]
        if keys[s] != key and (left < n or s not in got):
            got.append(s)
    return got


def draw_observations(batch, n_random: int, rng: random.Random) -> dict[int, list[int]]:
    """Per search turn with an observation that another search turn's differs from: the turns whose observations
    its contexts read, its own first, then ``n_random`` others (:func:`draw_others`). One draw per turn, in turn
    order, shared by its golds."""
    olen, keys = batch.seg_obs_len_S.tolist(), batch.seg_obs_key_S.tolist()
    kinds = batch.seg_kind_S.tolist()
    pool = [s for s in range(batch.num_turns) if kinds[s] == TurnKind.SEARCH and olen[s] > 0]
    count = Counter(keys[s] for s in pool)
    out = {}
    for s in pool:
        left = len(pool) - count[keys[s]]
        if left:
            out[s] = [s] + draw_others(rng, pool, keys, keys[s], left, n_random)
    return out


def context_head(prompts: Sequence, batch, s: int, o: int) -> torch.Tensor:
    """int64: the prompt and trajectory of turn ``s`` up to and including its action, then turn ``o``'s
    observation (``o == s``: its own)."""
    tokens, cu = batch.tokens_N.long(), batch.cu_seqlens.tolist()
    start, alen, olen = batch.seg_start_S.tolist(), batch.seg_action_len_S.tolist(), batch.seg_obs_len_S.tolist()
    b = int(batch.seg_traj_S[s])
    head = torch.cat([torch.as_tensor(prompts[b], dtype=torch.int64), tokens[cu[b]:start[s] + alen[s]]])
    return torch.cat([head, tokens[start[o] + alen[o]:start[o] + alen[o] + olen[o]]])


def policy_thinks(generate: Callable, prompts: Sequence, batch, draws: dict, max_tokens: int) -> dict:
    """``credit.igsearch.opening=policy``: the think the policy writes after each context's observation, greedy,
    up to its ``</think>`` (or ``max_tokens``): ``(turn, observation turn) -> token ids``. ``generate(prompts,
    params)``: the rollout engine's ``generate``, with the weights the batch was rolled out with."""
    from fastcredit.rollout.engines.base import SamplingParams

    pairs = sorted({(s, o) for s, obs in draws.items() for o in obs})
    if not pairs:
        return {}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=[THINK_CLOSE])
    outs = generate([context_head(prompts, batch, s, o).tolist() for s, o in pairs], params)
    return {pair: list(out.token_ids) for pair, out in zip(pairs, outs)}


def opening_ids(tokenizer) -> torch.Tensor:
    """int64: the answer opening, ``\n<answer>`` (IG-Search's released code writes it after the observation, or the
    policy after its own think); the gold follows it space-padded."""
    return torch.tensor(tokenizer.encode(ANSWER_OPENING, add_special_tokens=False), dtype=torch.int64)


def build_contexts(prompts: Sequence, batch, golds: Sequence, tokenizer, draws: dict, max_golds: int,
                   thinks: Optional[dict] = None) -> Contexts:
    """The real and counterfactual contexts of every drawn search turn (module docstring): its observation or a
    drawn one, then (``thinks``: the policy's opening) the think the policy wrote after it, then the opening."""
    out = Contexts()
    traj = batch.seg_traj_S.tolist()
    opening = opening_ids(tokenizer)
    answers: dict = {}  # gold text -> its tokens, encoded once a batch
    for s, observations in draws.items():
        b = traj[s]
        texts = ([golds[b]] if isinstance(golds[b], str) else list(golds[b]))[:max_golds]
        for g in texts:
            if g not in answers:
                answers[g] = gold_token_ids(tokenizer, g)
        gold_ids = [answers[g] for g in texts]
        if not any(gold_ids):
            continue
        for v, ids in enumerate(gold_ids):
            if not ids:
                continue
            for j, o in enumerate(observations):
                think = torch.tensor(thinks.get((s, o), []) if thinks is not None else [], dtype=torch.int64)
                out.prompts.append(torch.cat([context_head(prompts, batch, s, o), think, opening]))
                out.answers.append(ids)
                out.turn.append(s)
                out.gold.append(v)
                out.real.append(j == 0)
    return out


def answer_scores(logp_K: torch.Tensor, len_C: torch.Tensor) -> torch.Tensor:
    """float64 ``[C]``: ``s(C) = Σ_k w_k·logp_k / Σ_k w_k`` over each context's gold tokens, ``w_k = 3`` for its first
    three tokens and 1 after (the weights' mean is 1 once rescaled, so this is their weighted mean); 0 for a
    context without gold tokens."""
    C = len_C.numel()
    ctx_K = torch.repeat_interleave(torch.arange(C), len_C)
    pos_K = torch.arange(ctx_K.numel()) - (torch.cumsum(len_C, 0) - len_C)[ctx_K]
    w_K = torch.where(pos_K < HEAD_TOKENS, HEAD_WEIGHT, 1.0).to(torch.float64)
    num_C = torch.zeros(C, dtype=torch.float64).index_add_(0, ctx_K, w_K * logp_K.to(torch.float64))
    den_C = torch.zeros(C, dtype=torch.float64).index_add_(0, ctx_K, w_K)
    return num_C / den_C.clamp(min=1e-300)


def information_gain(s_C: torch.Tensor, ctx: Contexts, S: int) -> tuple[torch.Tensor, list, list]:
    """``(ig_S, real, baseline)``: per turn the gold with the highest real score and ``IG = s(C_t) − mean_j
    s(C_t^j)`` for it (NaN for an unscored turn), with the kept real scores and baselines for the metrics."""
    real: dict = {}
    rand: dict = {}
    for c, score in enumerate(s_C.tolist()):
        key = (ctx.turn[c], ctx.gold[c])
        if ctx.real[c]:
            real[key] = score
        else:
            rand.setdefault(key, []).append(score)
    best: dict = {}
    for (s, v), score in real.items():  # the first gold wins a tie
        if s not in best or score > real[(s, best[s])]:
            best[s] = v
    ig_S = torch.full((S,), math.nan, dtype=torch.float64)
    kept, baselines = [], []
    for s, v in best.items():
        baseline = sum(rand[(s, v)]) / len(rand[(s, v)])
        ig_S[s] = real[(s, v)] - baseline
        kept.append(real[(s, v)])
        baselines.append(baseline)
    return ig_S, kept, baselines


def score_information_gain(model, prompts: Sequence, batch, golds: Sequence, tokenizer, cfg, device,
                           max_tokens: int, temperature: float = 1.0, seed: int = 0,
                           max_over_ranks: Callable[[int], int] = lambda n: n, draws: Optional[dict] = None,
                           thinks: Optional[dict] = None) -> tuple[dict, dict]:
    """``(extras, metrics)``: the CreditInputs fields ``ig_S`` (float32, NaN where unscored),
    ``seg_query_start_S`` and ``seg_query_len_S``, and the phase's ``ig/*`` metrics. ``model``: the policy (a
    PolicyModel or the TrainEngine over one); ``cfg``: ``credit.igsearch``; ``draws``: each scored turn's
    observations (:func:`draw_observations`; None: drawn here with ``seed``); ``thinks``: the policy's own
    openings (:func:`policy_thinks`, ``credit.igsearch.opening=policy``; None: the released opening). Every rank
    runs as many micro-batches as the busiest one (a rank without a context runs a dummy one)."""
    from fastcredit.models.packed import forward_logprobs
    from fastcredit.rollout.trajectory import Turn, from_turns

    if draws is None:
        draws = draw_observations(batch, cfg.n_random, random.Random(seed))
    ctx = build_contexts(prompts, batch, golds, tokenizer, draws, cfg.max_golds, thinks)
    start_S, len_S = query_spans(batch, tokenizer)
    C = len(ctx.prompts)
    ig_S = torch.full((batch.num_turns,), math.nan, dtype=torch.float64)
    metrics = {"ig/contexts": float(C), "ig/context_tokens": float(sum(len(p) + len(a) for p, a in
                                                                        zip(ctx.prompts, ctx.answers)))}
    if thinks is not None and thinks:
        closed = sum(THINK_CLOSE in tokenizer.decode(t, skip_special_tokens=False) for t in thinks.values())
        metrics["ig/opening_think_closed"] = closed / len(thinks)
    if max_over_ranks(C) > 0:
        dummy = C == 0  # this rank has nothing to score but the others do: one pass, discarded
        inputs = ctx.prompts if not dummy else [torch.as_tensor(prompts[0], dtype=torch.int64)]
        answers = ctx.answers if not dummy else [tokenizer.encode(ANSWER_OPEN, add_special_tokens=False)]
        gold_batch = from_turns([[Turn(a, "answer")] for a in answers])
        logp_K = forward_logprobs(model, inputs, gold_batch, device, max_tokens, temperature, max_over_ranks)[0]
        if not dummy:
            s_C = answer_scores(logp_K, gold_batch.seqlens_B)
            ig_S, kept, baselines = information_gain(s_C, ctx, batch.num_turns)
            if kept:
                metrics["ig/logp_real_mean"] = sum(kept) / len(kept)
                metrics["ig/logp_baseline_mean"] = sum(baselines) / len(baselines)
    metrics["ig/scored_turns"] = float((~torch.isnan(ig_S)).sum())
    extras = {"ig_S": ig_S.to(torch.float32), "seg_query_start_S": start_S, "seg_query_len_S": len_S}
    return extras, metrics
