"""The HF engine's sampler (fastcredit.rollout.engines.hf._sample) draws exactly from each row's distribution:
temperature, top-k and top-p applied, a token outside them never drawn, the frequencies those of the
probabilities; greedy rows take the argmax; a seeded row draws the same tokens whatever else is in the batch."""
import math

import torch

from fastcredit.rollout.engines.base import SamplingParams
from fastcredit.rollout.engines.hf import _sample

LOGITS = torch.log(torch.tensor([0.05, 0.40, 0.0, 0.25, 0.20, 0.10]))  # token 2 has probability 0


def _draw(params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([_sample(LOGITS[None], [params], [g])[0][0] for _ in range(n)])


def _expected(temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    p = torch.softmax(LOGITS / temperature, -1)
    keep = torch.ones_like(p, dtype=torch.bool)
    if top_k > 0:
        keep &= p >= torch.topk(p, top_k).values[-1]
    if top_p < 1.0:
        sp, order = torch.sort(p, descending=True)
        keep[order[(torch.cumsum(sp, 0) - sp) > top_p]] = False
    q = torch.where(keep, p, torch.zeros_like(p))
    return q / q.sum()


def _close(tokens: torch.Tensor, want: torch.Tensor) -> None:
    """Frequencies within 5 standard errors of the probabilities (fixed seed: no chance in it)."""
    n = len(tokens)
    got = torch.bincount(tokens, minlength=len(want)).double() / n
    for g, w in zip(got.tolist(), want.double().tolist()):
        assert abs(g - w) <= 5 * math.sqrt(max(w * (1 - w), 1e-12) / n) + 1e-12, (got, want)


def test_frequencies_follow_the_distribution_with_temperature_top_k_and_top_p():
    for kw in ({}, {"temperature": 0.5}, {"temperature": 2.0}, {"top_k": 2}, {"top_p": 0.6},
               {"temperature": 1.5, "top_k": 3, "top_p": 0.8}):
        tokens = _draw(SamplingParams(max_tokens=1, **{"temperature": 1.0, **kw}), 4000)
        want = _expected(**{"temperature": 1.0, **kw})
        assert set(tokens.tolist()) <= set(torch.nonzero(want).flatten().tolist()), kw  # never a dropped token
        _close(tokens, want)


def test_log_probs_are_the_temperature_scaled_ones_and_greedy_takes_the_argmax():
    g = torch.Generator().manual_seed(3)
    tok, lp = _sample(LOGITS[None].repeat(2, 1), [SamplingParams(max_tokens=1, temperature=0.0),
                                                  SamplingParams(max_tokens=1, temperature=0.5)], [g, g])
    assert int(tok[0]) == 1 and float(lp[0]) == float(torch.log_softmax(LOGITS, -1)[1])
    assert float(lp[1]) == float(torch.log_softmax(LOGITS / 0.5, -1)[int(tok[1])])


def test_a_seeded_row_draws_the_same_tokens_in_any_batch():
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=11)
    alone = _draw(params, 50, seed=11)
    g_row, g_other = torch.Generator().manual_seed(11), torch.Generator().manual_seed(99)
    other = SamplingParams(max_tokens=1, temperature=0.7, top_p=0.9)
    batched = torch.stack([_sample(torch.stack([LOGITS * 0.3, LOGITS]), [other, params], [g_other, g_row])[0][1]
                           for _ in range(50)])
    assert torch.equal(alone, batched)
