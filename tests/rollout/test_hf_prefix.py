"""The HF engine's prefix caching: a prompt that extends a finished row's tokens prefills only its new tokens, and
generates what the engine without the cache generates (the same tokens greedily, log-probs to float error)."""
import torch

from fastcredit.data.tokenizer import build_tiny_tokenizer
from fastcredit.rollout.engines.base import SamplingParams
from fastcredit.rollout.engines.hf import HFEngine
from fastcredit.rollout.engines.hf_prefix import PrefixCache


def engines(caching: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tiny_tokenizer(["<search>where was Ada born</search> <answer>Paris</answer>"] * 20, vocab_size=300)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return HFEngine(Qwen2ForCausalLM(cfg), tok, "cpu", prefix_caching=caching), tok


def test_turns_extending_a_row_reuse_its_kv_and_generate_the_same():
    cached, _ = engines(True)
    plain, _ = engines(False)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    # rows end at different steps, so later rows' KV is read after earlier ones left the batch
    params = [SamplingParams(max_tokens=m, temperature=0.0, logprobs=True) for m in (3, 6, 4, 5)]
    for turn in range(3):
        a, b = cached.generate(prompts, params), plain.generate(prompts, params)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        for x, y in zip(a, b):
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)
        # the next turn: the action and an observation of a different length per row, as the agent loop appends
        prompts = [p + o.token_ids + torch.randint(3, 250, (3 + 4 * r,), generator=g).tolist()
                   for r, (p, o) in enumerate(zip(prompts, a))]
    assert cached.prefix.hits == 8 and plain.prefix is None  # every row of turns 2 and 3
    assert cached.prefix.reused_tokens > 0
    cached.end_rollout()
    assert len(cached.prefix) == 0


def test_a_prompt_takes_its_longest_kept_prefix_once_and_new_weights_drop_them():
    cache = PrefixCache(budget_bytes=1 << 20)
    kv = [(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))]
    cache.put([1, 2, 3], kv)
    cache.put([1, 2], [(torch.ones(2, 2, 4), torch.ones(2, 2, 4))])
    n, got = cache.take([1, 2, 3, 9])
    assert n == 3 and got is kv  # the longest, and never the whole prompt
    assert cache.take([1, 2, 3, 9])[0] == 2 and cache.take([1, 2, 3, 9]) == (0, None)
    cache.put([1, 2, 3], kv)
    assert cache.take([1, 2, 3]) == (0, None)  # at least one token must be left to run
    small = PrefixCache(budget_bytes=kv[0][0].numel() * 4 * 2)  # one entry's keys and values
    small.put([1], kv)
    small.put([2], kv)
    assert len(small) == 1 and small.take([2, 5])[0] == 1 and small.take([1, 5]) == (0, None)  # oldest dropped
    engine, _ = engines(True)
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(engine.prefix) == 1
    engine.update_weights([])
    assert len(engine.prefix) == 0
