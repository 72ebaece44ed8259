"""Small, fast, offline stand-ins for tests and benchmarks: a random-weight BERT encoder built
in code, a corpus in Search-R1's format, a byte-level BPE policy tokenizer.

Anything that needs a retriever without MiniLM's cost (about 240 passages/s on two cores)
uses these; the tokenizer's vocabulary comes from MiniLM's packaged files, nothing is fetched.
"""
from __future__ import annotations

import json
import random
from typing import Optional

import torch

from fastcredit.retrieval.encoders import Encoder, encoder_path

_WORDS = ("river", "castle", "engine", "violet", "harbor", "meadow", "signal", "copper", "lantern", "orbit",
          "falcon", "marble", "thunder", "willow", "quartz", "saddle", "ember", "glacier", "pepper", "cobalt",
          "nectar", "timber", "velvet", "canyon", "beacon", "walnut", "prism", "summit", "tundra", "harvest")


def tiny_encoder(dim: int = 32, layers: int = 1, seed: int = 0, pooling: str = "mean", query_prefix: str = "",
                 passage_prefix: str = "", max_length: int = 64, batch_size: int = 64) -> Encoder:
    """A random BERT (``dim`` hidden units) with MiniLM's tokenizer: deterministic for a seed, ~1000x cheaper."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(encoder_path("minilm"), local_files_only=True, use_fast=True)
    cfg = BertConfig(vocab_size=len(tokenizer), hidden_size=dim, num_hidden_layers=layers, num_attention_heads=2,
                     intermediate_size=2 * dim, max_position_embeddings=max_length + 2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BertModel(cfg, add_pooling_layer=False)
    return Encoder(model, tokenizer, pooling, query_prefix, passage_prefix, max_length, True, batch_size,
                   "cpu", torch.float32, name=f"tiny-bert-{dim}-{seed}")


def tiny_passages(n: int, seed: int = 0, min_words: int = 6, max_words: int = 30) -> list[tuple[str, str, str]]:
    """``n`` distinct ``(id, title, text)`` passages of random words; ids are ``p<row>``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        title = f"{rng.choice(_WORDS).title()} {rng.choice(_WORDS).title()} {i}"
        text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))) + f" item {i}."
        out.append((f"p{i}", title, text))
    return out


def write_corpus(path: str, passages: list[tuple[str, str, str]], ids_are_rows: bool = False) -> str:
    """Write Search-R1's corpus jsonl: ``{"id", "contents": "\\"Title\\"\\ntext"}`` per line."""
    with open(path, "w", encoding="utf-8") as fh:
        for row, (pid, title, text) in enumerate(passages):
            fh.write(json.dumps({"id": str(row) if ids_are_rows else pid, "contents": f'"{title}"\n{text}'}) + "\n")
    return path


def tiny_policy_tokenizer(passages: Optional[list[tuple[str, str, str]]] = None, vocab_size: int = 600):
    """The toy world's byte-level BPE (agent tags are single tokens), trained on ``passages``."""
    from fastcredit.data.tokenizer import build_tiny_tokenizer

    texts = [f"Doc 1(Title: \"{t}\") {x}" for _, t, x in (passages or tiny_passages(200))]
    return build_tiny_tokenizer(texts, vocab_size=vocab_size)
