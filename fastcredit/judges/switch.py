"""A frozen critic that shares the policy's architecture runs in the policy's own engine.

    weights = CriticWeights.load("models/Qwen2.5-3B-Instruct", dtype=torch.bfloat16, pin=True)
    problem = architecture_mismatch(policy_config, weights.config)   # None: the weights fit the engine
    engine.update_weights(weights.tensors())    # the judge phase; the rollout loads the policy back

CriticSearch pairs a Qwen2.5-3B base policy with Qwen2.5-3B-Instruct (7B with 7B), and a
ProCeedRL-style self-critic is the policy itself: in both the critic's tensors have the
policy's names and shapes. So one engine per GPU serves both (one copy of weights, one KV
cache): the critic's tensors wait in pinned host memory, read straight from its
safetensors files in the engine's dtype (no model is built; a tied LM head is stored
once), and the phase manager streams them into the engine for the judge phase
(``fastcredit.distributed.colocate``). A critic of another architecture cannot be loaded
this way: it runs in an engine of its own (the HF engine) or, with vLLM, in its own
process behind ``judges.backend=http`` (never a second sleep-mode vLLM engine in the
trainer's process: vLLM's sleep-mode allocator is one per process).
"""
from __future__ import annotations

import glob
import json
import os
from typing import Iterator, Optional

import torch

# What decides whether one model's tensors can run in another's engine: shapes, and what the
# engine computes with them (activation, norms, positions). Token ids and generation limits
# do not matter: the critic brings its own tokenizer.
STRUCTURE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size", "tie_word_embeddings", "head_dim", "hidden_act", "rms_norm_eps",
                  "rope_theta", "rope_scaling", "rope_parameters", "use_sliding_window", "attention_bias")


def _structure(config) -> dict:
    d = config if isinstance(config, dict) else config.to_dict()
    out = {k: d.get(k) for k in STRUCTURE_KEYS}
    if out["head_dim"] is None and out["hidden_size"] and out["num_attention_heads"]:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    if out["num_key_value_heads"] is None:
        out["num_key_value_heads"] = out["num_attention_heads"]
    return out


def architecture_mismatch(policy_config, critic_config) -> Optional[str]:
    """None when the critic's weights fit the policy's engine, else the differing keys, e.g.
    ``hidden_size: policy 2048, critic 3584``."""
    a, b = _structure(policy_config), _structure(critic_config)
    diffs = [f"{k}: policy {a[k]!r}, critic {b[k]!r}" for k in STRUCTURE_KEYS if a[k] != b[k]]
    return "; ".join(diffs) or None


def read_config(folder: str) -> dict:
    """A model folder's ``config.json`` (the architecture is decided before any weight is read)."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as exc:
        raise FileNotFoundError(f"judges.model={folder}: no readable config.json ({exc.strerror})") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


class CriticWeights:
    """A critic's tensors by HF name in host memory (pinned for fast copies to a GPU), with its config and tokenizer."""

    def __init__(self, folder: str, state: dict, config: dict, tokenizer):
        self.folder, self.state, self.config, self.tokenizer = folder, state, config, tokenizer

    @classmethod
    def load(cls, folder: str, dtype: torch.dtype = torch.float32, pin: bool = False) -> "CriticWeights":
        from safetensors import safe_open
        from transformers import AutoTokenizer

        config = read_config(folder)
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"judges.model={folder}: a critic whose weights switch into the policy's engine "
                                    "needs its weights as *.safetensors")
        state: dict = {}
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    t = t.to(dtype) if t.is_floating_point() else t
                    state[name] = t.pin_memory() if pin else t
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        return cls(folder, state, config, tok)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, tensor)`` one at a time, what ``Engine.update_weights`` streams.

        A tied LM head is named too (the same tensor as the embeddings), as the policy's
        weight sync names it: vLLM's in-place reload re-initialises a layer it is not given.
        """
        yield from self.state.items()
        embed = self.state.get("model.embed_tokens.weight")
        if self.config.get("tie_word_embeddings") and "lm_head.weight" not in self.state and embed is not None:
            yield "lm_head.weight", embed

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())
