"""Verdict grammars: constrained decoding always yields a verdict the real parsers accept (HF engine, tiny random
model, several label counts, greedy and sampled, budgets down to the worst case); the same format as vLLM's
regex; re-asks sample at the retry temperature with a seed of their own. The vLLM path is in
``test_grammar_vllm.py`` (slow: an engine start)."""
import asyncio
import re

import pytest
import torch

from fastcredit.data.tokenizer import build_tiny_tokenizer
from fastcredit.judges.backends import EngineBackend, HTTPBackend, JudgeRequest, retry_seed
from fastcredit.judges.grammar import verdict_grammar
from fastcredit.judges.parsers import parse_criticsearch, parse_cwgrpo, parse_process
from fastcredit.judges.runner import CriticSearchCritic, CWGRPOJudge, ProcessCritic
from fastcredit.judges.types import JudgeItem, StepText
from fastcredit.models.tiny import build_tiny_policy
from fastcredit.rollout.engines import HFEngine, SamplingParams

TEXT = "<search>where is the river</search> <answer>Paris</answer> hello world score rating critique 1, 0"
KINDS = [("criticsearch", n) for n in (0, 1, 3, 7)] + [("cwgrpo", None), ("process", None)]


def parse(kind, n, text):
    if kind == "criticsearch":
        return parse_criticsearch(text, n)
    return parse_cwgrpo(text) if kind == "cwgrpo" else parse_process(text)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer([TEXT] * 30, vocab_size=360)


@pytest.fixture(scope="module")
def engine(tok):
    return HFEngine(build_tiny_policy(tok, hidden=32, layers=2, heads=2, seed=0), tok, max_batch=8)


def test_automaton_accepts_exactly_the_format():
    g = verdict_grammar("criticsearch", 3)
    assert g.complete(g.step(g.start, "the first search helped. <score>1, 0, 1</score>"))
    assert not g.step(g.start, "x <score>1, 0, 1, 1") and not g.step(g.start, "<score>2")
    assert not g.complete(g.step(g.start, "<score>1, 0"))
    p = verdict_grammar("process")
    assert p.complete(p.step(p.start, "fine.<rating>10</rating>\n<critique>search less</critique>"))
    assert re.fullmatch(g.regex(64), "ok <score>0, 0, 1</score>")
    assert not re.fullmatch(g.regex(24), "a" * 3 + "<score>0, 0, 1</score>")  # 24 tokens leave 2 for analysis
    with pytest.raises(ValueError, match="cannot hold"):
        g.analysis_budget(g.reserve() - 1)
    with pytest.raises(ValueError, match="number of labels"):
        verdict_grammar("criticsearch")


def _reference_mask(d, tok):
    """Every token checked one by one: its text keeps the automaton alive, and it leaves a spent free piece."""
    g, t = d.grammar, d.table
    stay = d.piece is not None and d.spent < d.budgets[d.piece]
    ref = torch.zeros(len(tok), dtype=torch.bool)
    for k in range(len(tok)):
        after = g.step(d.states, t.text[k]) if t.usable[k] else frozenset()
        ref[k] = bool(after) and (stay or d.piece is None or g.free_piece(after) != d.piece)
    return ref


@pytest.mark.parametrize("kind,n,text", [("criticsearch", 3, "fine <score>1, 0, 1</score>"),
                                         ("cwgrpo", None, 'ok ```json\n{"thinking_reward": 0, "retrieval_reward": 1}'),
                                         ("process", None, "so-so<rating>10</rating>\n<critique>be brief</critique>")])
@pytest.mark.parametrize("slack", [0, 3, 30])
def test_masks_match_a_token_by_token_reference(tok, kind, n, text, slack):
    g = verdict_grammar(kind, n, critique_tokens=12)
    d = g.decoder(tok, g.reserve() + slack, len(tok))
    for k in tok(text, add_special_tokens=False)["input_ids"]:
        allowed, leaving = d.allowed()
        assert torch.equal(allowed, _reference_mask(d, tok))
        assert not (leaving & ~allowed).any()
        if not allowed[k]:  # a free budget is spent: this text can no longer be written
            assert slack < 30
            return
        d.advance(k)
    assert d.done


def test_a_stop_token_in_free_text_starts_the_verdict(tok):
    g = verdict_grammar("criticsearch", 2)
    d = g.decoder(tok, 64, len(tok), stop_ids=[tok.eos_token_id])
    logits = torch.zeros(len(tok))
    logits[tok.eos_token_id] = 10.0
    d.apply(logits)
    best = int(logits.argmax())
    assert "<" in d.table.text[best] and logits[tok.eos_token_id] == -float("inf") and logits[best] >= 10.0


@pytest.mark.parametrize("kind,n", KINDS, ids=[f"{k}-n{n}" for k, n in KINDS])
def test_constrained_hf_always_parses(tok, engine, kind, n):
    g = verdict_grammar(kind, n, critique_tokens=12)
    prompt = tok("hello world where is", add_special_tokens=False)["input_ids"]
    budgets = [g.reserve(), g.reserve() + 5, g.reserve() + 40]  # no analysis, a little, more than a random model uses
    params = [SamplingParams(max_tokens=m, temperature=t, seed=s, constraint=g, stop_token_ids=[tok.eos_token_id])
              for m in budgets for t, s in ((0.0, None), (1.0, 1), (2.0, 2))]
    outs = engine.generate([prompt] * len(params), params)
    for p, o in zip(params, outs):
        text = tok.decode(o.token_ids, skip_special_tokens=True)
        assert len(o.token_ids) <= p.max_tokens and o.finish_reason == "stop", (p, text)
        got = parse(kind, n, text)
        assert got is not None, (p.max_tokens, p.temperature, text)
        assert re.fullmatch(g.regex(None), text, re.DOTALL), text  # the format vLLM is given
    assert len({tuple(o.token_ids) for o in outs}) > 1  # sampling still chooses


def test_unconstrained_rows_are_unchanged(tok, engine):
    prompt = tok("hello world", add_special_tokens=False)["input_ids"]
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    alone = engine.generate([prompt], plain)[0]
    mixed = engine.generate([prompt, prompt], [plain, SamplingParams(max_tokens=50, temperature=0.0,
                                                                     constraint=verdict_grammar("cwgrpo"))])
    assert mixed[0].token_ids == alone.token_ids


def _item(n_search):
    steps = [StepText("search", f"<search>q{k}</search>", "\n<information>doc</information>\n", f"q{k}")
             for k in range(n_search)]
    return JudgeItem("Who?", ["B"], steps + [StepText("answer", "<answer>B</answer>")], "B", 1.0)


def test_constrained_judges_end_to_end(tok, engine):
    backend = EngineBackend(engine, max_tokens=48, constrained=True)
    items = [_item(n) for n in (0, 1, 2, 4)]
    labels, ok, stats = asyncio.run(CriticSearchCritic(backend, retries=0).score(items))
    assert ok.all() and stats["parse_failures"] == 0
    assert torch.isnan(labels).sum() == len(items)  # every search turn labelled, answers not
    u, v, ok, stats = asyncio.run(CWGRPOJudge(backend, retries=0).score(items[1:], [True] * 3))
    assert ok.all() and stats["parse_failures"] == 0
    score, _ = asyncio.run(ProcessCritic(EngineBackend(engine, max_tokens=72, constrained=True), retries=0)
                           .ascore_step("q", "", "<search>x</search>", "obs"))
    assert score is not None and 0 <= score <= 10
    # A verdict whose markup cannot fit is asked unconstrained (and fails to parse here) rather than raising.
    _, ok, stats = asyncio.run(CriticSearchCritic(backend, retries=0).score([_item(20)]))
    assert not ok.any() and stats["failed"] == 1


class Recording:
    """An engine that records what it is asked and answers garbage (every parse fails)."""

    def __init__(self):
        self.calls = []

    def generate_text(self, prompts, max_tokens, temperature=0.0, tokenizer=None, seeds=None, constraints=None):
        self.calls.append((list(temperature), list(seeds)))
        return ["no verdict"] * len(prompts)


def test_retries_sample_with_a_seed_of_their_own():
    rec = Recording()
    _, ok, stats = asyncio.run(CriticSearchCritic(EngineBackend(rec, retry_temperature=0.7), retries=2)
                               .score([_item(2), _item(3)]))
    assert not ok.any() and stats["retries"] == 4
    (t0, s0), (t1, s1), (t2, s2) = rec.calls
    assert t0 == [0.0, 0.0] and s0 == [None, None]
    assert t1 == t2 == [0.7, 0.7] and None not in s1 + s2
    assert len(set(s1 + s2)) == 4  # per prompt and per attempt
    r = JudgeRequest("p", "criticsearch", attempt=1)
    assert retry_seed(r) == retry_seed(JudgeRequest("p", "criticsearch", attempt=1)) != retry_seed(
        JudgeRequest("p", "criticsearch", attempt=2))


def test_http_reasks_carry_temperature_seed_and_grammar():
    backend = HTTPBackend("http://127.0.0.1:1/v1", "m", max_tokens=64, constrained=True, retry_temperature=0.7)
    first = backend._body(JudgeRequest("p", "criticsearch", n_labels=2))
    again = backend._body(JudgeRequest("p", "criticsearch", n_labels=2, attempt=1))
    assert first["temperature"] == 0.0 and "seed" not in first
    assert again["temperature"] == 0.7 and again["seed"] == retry_seed(JudgeRequest("p", "criticsearch", attempt=1))
    regex = first["structured_outputs"]["regex"]
    assert regex == verdict_grammar("criticsearch", 2).regex(64) and re.fullmatch(regex, "ok<score>1, 0</score>")


def test_a_real_retry_differs_from_the_first_attempt(tok, engine):
    prompt = "hello world where is the river"
    backend = EngineBackend(engine, max_tokens=16, retry_temperature=0.7)
    asks = [JudgeRequest(prompt, "cwgrpo", attempt=a) for a in range(4)]
    first, *retries = asyncio.run(backend.complete(asks))
    assert first == asyncio.run(backend.complete(asks[:1]))[0]  # greedy first ask
    assert all(r != first for r in retries) and len(set(retries)) == 3
    assert asyncio.run(backend.complete(asks[1:2]))[0] == retries[0]  # seeded: a rerun repeats
