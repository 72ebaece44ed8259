"""A small byte-level BPE tokenizer trained in code, for the 'tiny' policy on the toy world, and
:func:`load_tokenizer`, which loads a saved folder's tokenizer by the class it names.

The agent's tags are single tokens, so turn boundaries and stop strings are exact in
token space. Training is deterministic for a given text list and takes well under a second.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Optional

AGENT_TAGS = (
    "<think>", "</think>", "<search>", "</search>",
    "<information>", "</information>", "<answer>", "</answer>",
)
EOS = "<|endoftext|>"


def build_tiny_tokenizer(texts: Iterable[str], vocab_size: int = 2000, out_dir: Optional[str] = None):
    """Train a byte-level BPE on ``texts``; return a ``PreTrainedTokenizerFast`` (saved to ``out_dir`` if given)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ValueError(f"vocab_size must be at least 300 (256 bytes + tags), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, *AGENT_TAGS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        fast.save_pretrained(out_dir)
    return fast


def load_tokenizer(folder: str):
    """The tokenizer of an exported ``folder`` as the run used it: the class its tokenizer_config.json names
    (NOTE: transformers 5 makes ``AutoTokenizer`` build the model type's own tokenizer class for some types,
    qwen2 among them, whatever tokenizer_config.json names; it would re-split text with another pattern)."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    path, name = os.path.join(folder, "tokenizer_config.json"), None
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    cls = tokenizer_class_from_name(name) if name else None
    return (cls or AutoTokenizer).from_pretrained(folder)
