"""Model sizes the memory plan is computed from: a decoder's shape from its folder, a preset, or the tiny policy.

    shape = lookup_shape("models/Qwen2.5-3B", "model.policy")   # the folder's config.json, else a preset
    shape.params, shape.layer_params(), kv_bytes_per_token(shape)

``params`` is exact: summed from the safetensors headers (the tensors are never read), or the
public count of a preset, which :meth:`ModelShape.formula_params` reproduces.
"""
from __future__ import annotations

import glob
import json
import math
import os
import struct
from dataclasses import dataclass, replace


class ShapeError(ValueError):
    """A config's model key names neither a folder with config.json nor a preset."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder's size. ``params`` is exact (from safetensors headers or the public count)."""
    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = True   # Qwen2 has q/k/v biases, Llama and Qwen3 do not
    qk_norm: bool = False   # Qwen3's per-head q/k RMSNorm
    name: str = ""

    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention, SwiGLU MLP, two RMSNorms)."""
        hidden = self.hidden
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = hidden * q_width + 2 * hidden * kv_width + q_width * hidden
        if self.qkv_bias:
            attention += q_width + 2 * kv_width
        norms = 2 * hidden + (2 * self.head_dim if self.qk_norm else 0)
        return attention + 3 * hidden * self.intermediate + norms

    def formula_params(self) -> int:
        """L x layer + embeddings (+ an untied LM head) + final norm."""
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_params() + embeddings + self.hidden

    def value_params(self) -> int:
        """The value model (ppo, pica): this backbone without an untied LM head, plus a scalar head (H + 1)."""
        return self.params - (0 if self.tied else self.vocab * self.hidden) + self.hidden + 1

    def same_architecture(self, other: "ModelShape") -> bool:
        """Whether ``other``'s tensors have this model's names and shapes (a critic switched into its engine)."""
        keys = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "tied", "qkv_bias")
        return all(getattr(self, key) == getattr(other, key) for key in keys)

    @classmethod
    def from_folder(cls, path: str) -> "ModelShape":
        """From a HF folder's ``config.json``; ``params`` summed from ``*.safetensors`` headers
        (8-byte little-endian length, then the JSON header; the tensors are never read), else the formula."""
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
        config = config.get("text_config", config)
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        model_type = config.get("model_type", "")
        shape = cls(params=0, layers=config["num_hidden_layers"], hidden=hidden, heads=heads,
                    kv_heads=config.get("num_key_value_heads") or heads,
                    head_dim=config.get("head_dim") or hidden // heads,
                    intermediate=config["intermediate_size"], vocab=config["vocab_size"],
                    tied=bool(config.get("tie_word_embeddings", True)),
                    qkv_bias=bool(config.get("attention_bias", model_type == "qwen2")),
                    qk_norm=model_type.startswith("qwen3"), name=os.path.basename(os.path.normpath(path)))
        return replace(shape, params=safetensors_params(path) or shape.formula_params())


def safetensors_params(folder: str) -> int:
    """Parameters in a folder's ``*.safetensors`` files, from their headers alone (0 when there are none)."""
    total = 0
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with open(path, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
        total += sum(math.prod(t["shape"]) for key, t in header.items() if key != "__metadata__")
    return total


def _preset(name, params, layers, hidden, heads, kv_heads, intermediate, vocab, tied, head_dim=128, bias=True,
            qk_norm=False) -> ModelShape:
    return ModelShape(params, layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, tied, bias, qk_norm,
                      name)


# The public config.json values (Hugging Face model cards); params are the exact counts,
# which ModelShape.formula_params reproduces.
PRESETS = {p.name.lower(): p for p in (
    _preset("Qwen2.5-0.5B", 494_032_768, 24, 896, 14, 2, 4864, 151936, True, head_dim=64),
    _preset("Qwen2.5-1.5B", 1_543_714_304, 28, 1536, 12, 2, 8960, 151936, True),
    _preset("Qwen2.5-3B", 3_085_938_688, 36, 2048, 16, 2, 11008, 151936, True),
    _preset("Qwen2.5-7B", 7_615_616_512, 28, 3584, 28, 4, 18944, 152064, False),
    _preset("Qwen2.5-14B", 14_770_033_664, 48, 5120, 40, 8, 13824, 152064, False),
    _preset("Qwen3-8B", 8_190_735_360, 36, 4096, 32, 8, 12288, 151936, False, bias=False, qk_norm=True),
    _preset("SmolLM2-135M", 134_515_008, 30, 576, 9, 3, 1536, 49152, True, head_dim=64, bias=False),
)}


def tiny_shape(mcfg) -> ModelShape:
    """The ``tiny`` policy of ``fastcredit.models.tiny`` (model.tiny_*; MLP 2H and MHA unless set; tied)."""
    hidden, heads = mcfg.tiny_hidden, mcfg.tiny_heads
    shape = ModelShape(0, mcfg.tiny_layers, hidden, heads, mcfg.tiny_kv_heads or heads, hidden // heads,
                       mcfg.tiny_intermediate or 2 * hidden, max(mcfg.tiny_vocab, mcfg.tiny_vocab_rows), True,
                       name="tiny")
    return replace(shape, params=shape.formula_params())


def lookup_shape(value: str, key: str, mcfg=None) -> ModelShape:
    """A config value (``key`` names it for errors): 'tiny', 'smollm2', a folder with config.json, or a
    name whose basename is a preset (case-insensitive; an ``-Instruct`` suffix has its base's shape)."""
    if value == "tiny" and mcfg is not None:
        return tiny_shape(mcfg)
    if value == "smollm2":
        return PRESETS["smollm2-135m"]
    if os.path.isfile(os.path.join(value, "config.json")):
        return ModelShape.from_folder(value)
    base = os.path.basename(os.path.normpath(value)).lower()
    for name in (base, base.removesuffix("-instruct")):
        if name in PRESETS:
            return replace(PRESETS[name], name=os.path.basename(os.path.normpath(value)))
    raise ShapeError(f"{key}={value!r}: not a folder with config.json here, and its name is none of the presets "
                     f"({', '.join(p.name for p in PRESETS.values())}); run the report where the folder exists")


def kv_bytes_per_token(shape: ModelShape, tensor_parallel: int = 1) -> int:
    """K and V of every layer in bf16: 2 x L x kv_heads x head_dim x 2 bytes (per TP rank)."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * 2 // max(1, tensor_parallel)
