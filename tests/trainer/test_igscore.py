"""IG-Search's scoring phase (docs/methods.md §11): its contexts, its query spans, and its information gain equal to
a direct computation of s(C) with the model on contexts built here by hand."""
import copy
import math
import random

import pytest
import torch

from fastcredit.config.credit import IGSearchConfig
from fastcredit.data.tokenizer import build_tiny_tokenizer
from fastcredit.models.packed import PolicyModel
from fastcredit.models.tiny import build_tiny_policy
from fastcredit.rollout.trajectory import Turn, from_turns
from fastcredit.trainer.igscore import (Contexts, answer_scores, build_contexts, draw_observations, information_gain,
                                        policy_thinks, query_span_by_text, query_spans, score_information_gain)

PROMPT = "Question: where was the founder of Acme born?"
ACTIONS = {"q1": "<think> I need Acme founder.</think>\n<search> Acme founder </search>",
           "q2": "<think> Bob Smith.</think>\n<search> Bob Smith birthplace </search>",
           "q3": "<search> Acme </search>", "answer": "<think> done.</think>\n<answer> Paris </answer>",
           "bad": "<think> hmm </think> no tag"}
OBS = {"o1": "\n\n<information>Doc 1: Acme was founded by Bob Smith.</information>\n\n",
       "o2": "\n\n<information>Doc 1: Bob Smith was born in Paris.</information>\n\n",
       "o3": "\n\n<information>Doc 1: Acme sells rockets.</information>\n\n",
       "bad": "\nMy previous action is invalid.\n"}
GOLDS = ["Paris", "City of Paris", "Bob Smith", "the City of Light in northern France"]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer([PROMPT, *ACTIONS.values(), *OBS.values(), *GOLDS] * 20, vocab_size=400)


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _batch(tok, trajectories):
    """Trajectories given as ``[(action name, observation name or None), ...]``."""
    turns = [[Turn(_ids(tok, ACTIONS[a]), "search" if a.startswith("q") else "answer" if a == "answer" else
                   "invalid", _ids(tok, OBS[o]) if o else []) for a, o in traj] for traj in trajectories]
    return from_turns(turns, group_id=[0] * len(turns))


def test_query_spans_by_id_equal_those_by_text(tok):
    batch = _batch(tok, [[("q1", "o1"), ("q2", "o2"), ("answer", None)], [("bad", "bad"), ("q3", "o3"),
                                                                          ("answer", None)]])
    start_S, len_S = query_spans(batch, tok)
    toks = batch.tokens_N.tolist()
    got = []
    for s in range(batch.num_turns):
        action = toks[int(batch.seg_start_S[s]):int(batch.seg_start_S[s] + batch.seg_action_len_S[s])]
        query = action[int(start_S[s]):int(start_S[s] + len_S[s])]
        got.append(tok.decode(query))
        if len_S[s]:  # the general path, through the decoded text, finds the same tokens
            assert query_span_by_text(action, lambda x: tok.decode(x, skip_special_tokens=False)) == \
                (int(start_S[s]), int(len_S[s]))
    assert got == [" Acme founder ", " Bob Smith birthplace ", "", "", " Acme ", ""]


def test_query_span_by_text_skips_tokens_that_straddle_a_tag():
    pieces = lambda *p: (list(p), lambda ids: "".join(ids))  # noqa: E731  tokens as their own text
    assert query_span_by_text(*pieces("<think>", "x", "</think>", "<search>", " a", "b", " </search>")) == (4, 2)
    assert query_span_by_text(*pieces("<sea", "rch> a", "b </", "search>")) == (2, 0)
    assert query_span_by_text(*pieces("<", "search", ">", " q", "</", "search", ">")) == (3, 1)
    # the last opening before the closing wins; no closing, no query
    assert query_span_by_text(*pieces("<search>", "x", "<search>", "y", "z", "</search>")) == (3, 2)
    assert query_span_by_text(*pieces("<search>", "x")) == (0, 0)


def test_contexts_replace_only_the_turns_observation_and_never_with_the_same_tokens(tok):
    """o1 twice (turns 0 and 4): neither ever draws the other; a trajectory that never searched has no context."""
    batch = _batch(tok, [[("q1", "o1"), ("q2", "o2"), ("answer", None)], [("answer", None)],
                         [("q3", "o3"), ("answer", None)], [("q1", "o1"), ("answer", None)]])
    prompts = [_ids(tok, PROMPT)] * 4
    toks = batch.tokens_N.tolist()
    opening = _ids(tok, "\n<answer>")
    obs_of = {s: toks[int(batch.seg_start_S[s] + batch.seg_action_len_S[s]):
                      int(batch.seg_start_S[s] + batch.seg_action_len_S[s] + batch.seg_obs_len_S[s])]
              for s in range(batch.num_turns)}
    for seed in range(20):
        ctx = build_contexts(prompts, batch, [["Paris", "Bob Smith"]] * 4, tok,
                             draw_observations(batch, 2, random.Random(seed)), 3)
        assert sorted(set(ctx.turn)) == [0, 1, 4, 6] and len(ctx.prompts) == 4 * 2 * 3  # 2 golds x (1 + N)
        drawn: dict = {}
        for c, s in enumerate(ctx.turn):
            b = int(batch.seg_traj_S[s])
            head = prompts[b] + toks[int(batch.cu_seqlens[b]):int(batch.seg_start_S[s] + batch.seg_action_len_S[s])]
            ids = ctx.prompts[c].tolist()
            assert ids[:len(head)] == head and ids[-len(opening):] == opening
            shown = ids[len(head):-len(opening)]
            assert (shown == obs_of[s]) == ctx.real[c], (seed, c)
            assert shown in [obs_of[u] for u in (0, 1, 4, 6)]
            assert ctx.answers[c] == (_ids(tok, "<answer> Paris")[1:] if ctx.gold[c] == 0 else
                                      _ids(tok, "<answer> Bob Smith")[1:])
            if not ctx.real[c]:
                drawn.setdefault((s, ctx.gold[c]), []).append(shown)
        for s in (0, 1, 4, 6):
            assert drawn[(s, 0)] == drawn[(s, 1)] and len(drawn[(s, 0)]) == 2  # one draw, shared by the golds
        for s in (0, 6):  # o1's counterfactuals: o2 and o3, the only other observations
            assert sorted(drawn[(s, 0)]) == sorted([obs_of[1], obs_of[4]])
    # no other observation at all (every search saw o1), or no gold answer: nothing to score
    same = _batch(tok, [[("q1", "o1"), ("answer", None)], [("q1", "o1"), ("answer", None)]])
    assert draw_observations(same, 3, random.Random(0)) == {}
    assert build_contexts(prompts, batch, [[" "]] * 4, tok, draw_observations(batch, 2, random.Random(0)), 3).turn == []


def test_information_gain_keeps_the_gold_with_the_best_real_score():
    ctx = Contexts(turn=[3] * 6 + [5] * 3, gold=[0, 0, 0, 1, 1, 1, 0, 0, 0],
                   real=[True, False, False] * 3)
    s_C = torch.tensor([-2.0, -3.0, -4.0, -1.0, -0.5, -2.5, -1.0, -1.0, -1.0], dtype=torch.float64)
    ig_S, kept, baselines = information_gain(s_C, ctx, 6)
    assert ig_S[3].item() == pytest.approx(-1.0 - (-1.5)) and ig_S[5].item() == 0.0  # gold 1's -1.0 beats -2.0
    assert torch.isnan(ig_S[[0, 1, 2, 4]]).all() and kept == [-1.0, -1.0] and baselines == [-1.5, -1.0]


def test_answer_scores_weigh_the_first_three_tokens_three_times():
    logp = torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -0.5])
    got = answer_scores(logp, torch.tensor([5, 1, 1]))
    assert got.tolist() == pytest.approx([(3 * (-6) - 9) / 11, -6.0, -0.5])


def _direct_score(lm, ids, gold, temperature):
    """s(C) by hand: the plain HF forward of one unpadded sequence, its log-softmax, the weighted mean."""
    with torch.no_grad():
        logits = lm(input_ids=torch.tensor([ids + gold])).logits[0].double() / temperature
    logp = torch.log_softmax(logits, -1)
    lp = [float(logp[len(ids) + k - 1, g]) for k, g in enumerate(gold)]
    w = [3.0 if k < 3 else 1.0 for k in range(len(gold))]
    return sum(a * b for a, b in zip(w, lp)) / sum(w)


def test_information_gain_equals_a_direct_computation(tok):
    """Three searches with three different observations and N = 2: each turn's counterfactuals are the other two.
    A trajectory that never searched, and an invalid turn, get no gain; the best of several golds is kept (one of
    them longer than the three tokens weighted 3)."""
    batch = _batch(tok, [[("q1", "o1"), ("bad", "bad"), ("q2", "o2"), ("answer", None)], [("answer", None)],
                         [("q3", "o3"), ("answer", None)]])
    golds = [["Paris", "City of Paris", "Bob Smith"], ["Paris"], ["the City of Light in northern France"]]
    prompts = [_ids(tok, PROMPT + f" {b}") for b in range(3)]
    lm = build_tiny_policy(tok, hidden=32, layers=2, heads=2, seed=3)
    with torch.no_grad():  # a fresh model's logits are nearly uniform: its gains would be ~1e-3, hiding an error
        g = torch.Generator().manual_seed(3)
        for p in lm.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2, generator=g)
    direct = copy.deepcopy(lm)
    cfg = IGSearchConfig(n_random=2, max_golds=3)
    temperature = 0.7
    extras, metrics = score_information_gain(PolicyModel(lm, "torch"), prompts, batch, golds, tok, cfg, "cpu",
                                             max_tokens=64, temperature=temperature, seed=11)
    toks = batch.tokens_N.tolist()
    start, alen, olen = batch.seg_start_S.tolist(), batch.seg_action_len_S.tolist(), batch.seg_obs_len_S.tolist()
    searches = {0: 0, 2: 0, 5: 2}  # turn -> trajectory
    opening = _ids(tok, "\n<answer>")
    want = [math.nan] * batch.num_turns
    for s, b in searches.items():
        head = prompts[b] + toks[int(batch.cu_seqlens[b]):start[s] + alen[s]]
        real_obs = toks[start[s] + alen[s]:start[s] + alen[s] + olen[s]]
        others = [toks[start[u] + alen[u]:start[u] + alen[u] + olen[u]] for u in searches if u != s]
        scores = []
        for g in golds[b]:
            gold = _ids(tok, "<answer> " + g)[len(_ids(tok, "<answer>")):]
            real = _direct_score(direct, head + real_obs + opening, gold, temperature)
            base = [_direct_score(direct, head + o + opening, gold, temperature) for o in others]
            scores.append((real, real - sum(base) / len(base)))
        want[s] = max(scores, key=lambda x: x[0])[1]
    got = extras["ig_S"]
    assert got.dtype == torch.float32 and torch.isnan(got).tolist() == [math.isnan(w) for w in want]
    # gains the context really moves (the smallest is about 0.02 here, a thousand times the tolerance below)
    assert min(abs(w) for w in want if not math.isnan(w)) > 0.01
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), atol=2e-5, rtol=0,
                               equal_nan=True)
    assert (extras["seg_query_len_S"] > 0).tolist() == [True, False, True, False, False, True, False]
    assert metrics["ig/contexts"] == 3 * 3 + 3 * 3 + 1 * 3 and metrics["ig/scored_turns"] == 3  # golds x (1 + N)


def test_a_rank_without_a_search_runs_one_dummy_pass_when_others_score(tok):
    batch = _batch(tok, [[("answer", None)], [("bad", "bad"), ("answer", None)]])
    calls = []

    class Policy(torch.nn.Module):
        def forward(self, x, temperature=1.0):
            calls.append(x.num_tokens)
            return torch.zeros(x.target_N.numel()), torch.zeros(x.target_N.numel())

    args = ([_ids(tok, PROMPT)] * 2, batch, [["Paris"]] * 2, tok, IGSearchConfig(), "cpu", 64)
    extras, metrics = score_information_gain(Policy(), *args)  # alone: nothing to score, no pass
    assert calls == [] and torch.isnan(extras["ig_S"]).all() and metrics["ig/contexts"] == 0
    extras, _ = score_information_gain(Policy(), *args, max_over_ranks=lambda n: max(n, 5))
    assert len(calls) == 5 and torch.isnan(extras["ig_S"]).all()  # as many passes as the busiest rank, discarded


def test_the_policys_opening_puts_its_own_think_between_each_observation_and_the_answer(tok):
    """opening=policy: each context (the real one and every counterfactual) is followed by the think the policy
    writes after that very observation, generated greedily up to </think>, then the opening."""
    from fastcredit.rollout.engines.base import GenOutput

    batch = _batch(tok, [[("q1", "o1"), ("q2", "o2"), ("answer", None)], [("q3", "o3"), ("answer", None)]])
    prompts = [_ids(tok, PROMPT)] * 2
    draws = draw_observations(batch, 2, random.Random(0))
    seen = []

    def generate(heads, params):  # a think that names the observation it read: it differs per context
        seen.append((heads, params))
        return [GenOutput(_ids(tok, f"<think> read {len(h)} </think>"), None, "stop") for h in heads]

    thinks = policy_thinks(generate, prompts, batch, draws, max_tokens=17)
    (heads, params), = seen
    assert params.temperature == 0.0 and params.stop == ["</think>"] and params.max_tokens == 17
    assert len(heads) == len(thinks) == len({(s, o) for s, obs in draws.items() for o in obs})
    ctx = build_contexts(prompts, batch, [["Paris"]] * 2, tok, draws, 3, thinks)
    opening = _ids(tok, "\n<answer>")
    released = build_contexts(prompts, batch, [["Paris"]] * 2, tok, draws, 3)
    assert len(ctx.prompts) == len(released.prompts) == 3 * 3
    for c, (mine, plain) in enumerate(zip(ctx.prompts, released.prompts)):
        head = plain.tolist()[:-len(opening)]  # the context up to and including the observation shown
        think = _ids(tok, f"<think> read {len(head)} </think>")
        assert mine.tolist() == head + think + opening, c
