"""A tiny Qwen2 causal LM sized for a tokenizer: deterministic from a seed, loadable by transformers and vLLM.

    lm = build_tiny_policy(tokenizer, hidden=128, layers=2, heads=4, seed=0)
    save_tiny_policy(lm, tokenizer, "runs/x/tiny")   # config.json + model.safetensors + tokenizer files
"""
from __future__ import annotations

import torch


def build_tiny_policy(tokenizer, hidden: int = 128, layers: int = 2, heads: int = 4, seed: int = 0,
                      max_positions: int = 4096, intermediate: int = 0, kv_heads: int = 0, vocab_rows: int = 0):
    """A random Qwen2 with tied embeddings over ``len(tokenizer)`` tokens (float32).

    ``intermediate`` (0: ``2·hidden``), ``kv_heads`` (0: ``heads``) and ``vocab_rows`` (0: the tokenizer's
    size; more: a real model's vocabulary, so its LM head costs what it costs) give a published model's
    shapes with random weights, for timing."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if hidden % heads:
        raise ValueError(f"model.tiny_hidden={hidden} must be a multiple of model.tiny_heads={heads}")
    kv_heads = kv_heads or heads
    if heads % kv_heads:
        raise ValueError(f"model.tiny_heads={heads} must be a multiple of model.tiny_kv_heads={kv_heads}")
    eos = tokenizer.eos_token_id
    cfg = Qwen2Config(vocab_size=max(len(tokenizer), vocab_rows), hidden_size=hidden,
                      intermediate_size=intermediate or 2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, tie_word_embeddings=True, bos_token_id=eos,
                      eos_token_id=eos,
                      pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    model.generation_config.pad_token_id = cfg.pad_token_id
    return model.float().eval()


def save_tiny_policy(model, tokenizer, folder: str) -> str:
    """Write a folder that ``AutoModelForCausalLM.from_pretrained`` (and vLLM) can load."""
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
