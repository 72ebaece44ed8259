"""Verdict grammars on the vLLM engine (structured outputs, a regex compiled by xgrammar): every verdict parses.

Slow (engine start ~20 s on 2 cores): marked ``slow``; skipped where vLLM is not installed.
"""
import re

import pytest
import torch

from fastcredit.data.tokenizer import build_tiny_tokenizer
from fastcredit.judges.grammar import verdict_grammar
from fastcredit.judges.parsers import parse_criticsearch, parse_cwgrpo, parse_process
from fastcredit.models.tiny import build_tiny_policy
from fastcredit.rollout.engines import SamplingParams

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

TEXT = "<search>where is the river</search> <answer>Paris</answer> hello world score rating critique 1, 0"


@pytest.fixture(scope="module")
def setup():
    from fastcredit.rollout.engines.vllm import VLLMEngine

    tok = build_tiny_tokenizer([TEXT] * 30, vocab_size=360)
    lm = build_tiny_policy(tok, hidden=64, layers=2, heads=2, seed=0)
    eng = VLLMEngine.from_module(lm, tok, device="cuda" if torch.cuda.is_available() else "cpu")
    yield tok, eng
    eng.close()


def test_constrained_vllm_always_parses(setup):
    tok, eng = setup
    prompt = tok("hello world where is", add_special_tokens=False)["input_ids"]
    cases = [("criticsearch", n, lambda t, n=n: parse_criticsearch(t, n)) for n in (0, 1, 3, 7)]
    cases += [("cwgrpo", None, parse_cwgrpo), ("process", None, parse_process)]
    rows = []
    for kind, n, parse in cases:
        g = verdict_grammar(kind, n, critique_tokens=12)
        for m in (g.reserve(), g.reserve() + 30):
            for t, s in ((0.0, None), (1.0, 1), (2.0, 2)):
                rows.append((g, parse, SamplingParams(max_tokens=m, temperature=t, seed=s, constraint=g,
                                                      stop_token_ids=[tok.eos_token_id])))
    outs = eng.generate([prompt] * len(rows), [p for *_, p in rows])
    for (g, parse, p), o in zip(rows, outs):
        text = tok.decode(o.token_ids, skip_special_tokens=True)
        assert parse(text) is not None, (g.name, p.max_tokens, p.temperature, text)
        assert re.fullmatch(g.regex(p.max_tokens), text, re.DOTALL) and len(o.token_ids) <= p.max_tokens
