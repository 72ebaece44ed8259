"""The HF engine: stop strings and tokens, lengths, per-row parameters, log-probs, seeds, async batching,
weight updates."""
import asyncio

import pytest
import torch

from fastcredit.data.tokenizer import build_tiny_tokenizer
from fastcredit.models.tiny import build_tiny_policy, save_tiny_policy
from fastcredit.rollout.engines import HFEngine, SamplingParams, make_engine


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(["<search>where is the river</search> <answer>Paris</answer> hello world"] * 30,
                                vocab_size=320)


@pytest.fixture(scope="module")
def lm(tok):
    return build_tiny_policy(tok, hidden=32, layers=2, heads=2, seed=0)


def prompt(tok, text="hello world where"):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_logprobs_match_a_forward_pass_and_greedy_is_argmax(tok, lm):
    eng = HFEngine(lm, tok)
    p = prompt(tok)
    out = eng.generate([p], SamplingParams(max_tokens=6, temperature=0.0, logprobs=True))[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    full = torch.tensor([p + out.token_ids])
    logits = lm(full).logits[0, len(p) - 1:-1].log_softmax(-1)
    ref = logits.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-5, rtol=0)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_sampled_logprobs_use_the_temperature(tok, lm):
    eng = HFEngine(lm, tok)
    p = prompt(tok)
    out = eng.generate([p], SamplingParams(max_tokens=4, temperature=0.7, logprobs=True, seed=3))[0]
    logits = lm(torch.tensor([p + out.token_ids])).logits[0, len(p) - 1:-1] / 0.7
    ref = logits.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-5, rtol=0)


def test_stop_strings_tokens_and_per_row_parameters(tok, lm):
    eng = HFEngine(lm, tok)
    p = prompt(tok)
    free = eng.generate([p], SamplingParams(max_tokens=12, temperature=0.0))[0].token_ids
    stop_tok = free[3]
    text_after = tok.decode(free[:5], skip_special_tokens=False)
    stop_str = text_after[-2:]  # ends inside token 5 (or earlier: then it stops there)
    outs = eng.generate([p, p, p], [SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_tok]),
                                    SamplingParams(max_tokens=12, temperature=0.0, stop=[stop_str]),
                                    SamplingParams(max_tokens=2, temperature=0.0)])
    assert outs[0].token_ids == free[:free.index(stop_tok) + 1] and outs[0].stop_reason == stop_tok
    assert outs[1].finish_reason == "stop" and outs[1].stop_reason == stop_str
    assert tok.decode(outs[1].token_ids, skip_special_tokens=False).find(stop_str) >= 0
    assert outs[1].token_ids == free[:len(outs[1].token_ids)] and len(outs[1].token_ids) <= 5
    assert outs[2].token_ids == free[:2] and outs[2].finish_reason == "length"


def test_batched_rows_equal_single_rows_and_seeds_repeat(tok, lm):
    eng = HFEngine(lm, tok)
    ps = [prompt(tok), prompt(tok, "where"), prompt(tok, "the river is where hello")]
    sp = SamplingParams(max_tokens=7, temperature=1.0, seed=11)
    batched = eng.generate(ps, sp)
    single = [eng.generate([p], sp)[0] for p in ps]
    assert [b.token_ids for b in batched] == [s.token_ids for s in single]
    other = eng.generate(ps, SamplingParams(max_tokens=7, temperature=1.0, seed=12))
    assert [b.token_ids for b in batched] != [o.token_ids for o in other]


def test_concurrent_agenerate_calls_share_a_batch(tok, lm):
    eng = HFEngine(lm, tok, batch_timeout_ms=50)
    ps = [prompt(tok), prompt(tok, "where"), prompt(tok, "river")]
    sp = SamplingParams(max_tokens=5, temperature=0.0)

    async def main():
        return await asyncio.gather(*(eng.agenerate(p, sp) for p in ps))

    outs = asyncio.run(main())
    assert eng.batches_run == [3]
    assert [o.token_ids for o in outs] == [o.token_ids for o in eng.generate(ps, sp)]


def test_update_weights_changes_outputs_and_rejects_unknown_names(tok, lm):
    eng = HFEngine(build_tiny_policy(tok, hidden=32, layers=2, heads=2, seed=1), tok)
    p = prompt(tok)
    sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True)
    before = eng.generate([p], sp)[0]
    eng.update_weights((k, v) for k, v in lm.state_dict().items())
    after, target = eng.generate([p], sp)[0], HFEngine(lm, tok).generate([p], sp)[0]
    assert (after.token_ids, after.logprobs) == (target.token_ids, target.logprobs)
    assert after.logprobs != before.logprobs
    with pytest.raises(KeyError, match="no_such"):
        eng.update_weights([("no_such.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="valid: hf, vllm"):
        make_engine("tgi", lm, tok)


def test_generate_text_and_saved_model_reload(tok, lm, tmp_path):
    from transformers import AutoModelForCausalLM

    eng = HFEngine(lm, tok)
    text = eng.generate_text(["hello world"], max_tokens=4)
    assert isinstance(text[0], str)
    folder = save_tiny_policy(lm, tok, str(tmp_path / "tiny"))
    again = AutoModelForCausalLM.from_pretrained(folder)
    assert HFEngine(again, tok).generate_text(["hello world"], max_tokens=4) == text


@pytest.mark.gpu
def test_sampling_on_a_gpu_repeats_per_seed(tok, lm):
    """On CUDA the per-request generator lives on the engine's device (a CPU generator makes
    ``torch.multinomial`` raise on CUDA probabilities: the first GPU run of the trainer did)."""
    import copy

    eng = HFEngine(copy.deepcopy(lm), tok, device="cuda")
    p = prompt(tok)
    params = [SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, logprobs=True, seed=s)
              for s in (5, 5, 6)]
    a, b, c = eng.generate([p, p, p], params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8
    assert a.logprobs == b.logprobs and all(lp <= 0 for lp in a.logprobs)
    assert len(c.token_ids) == 8
