"""Every passage pre-tokenized once with the policy's tokenizer: observations are then
assembled from token spans (``fastcredit.retrieval.ops.assemble_observations``) instead of
re-tokenizing text on every search.

Row ``i`` holds the tokens of ``(Title: <first line>) <text>`` — Search-R1's
``Doc i(Title: …) text`` without the ``Doc i`` header, which depends on the rank and is
added at assembly time. Layout, beside the corpus store:

    tokens/<tag>/tokens.bin    int32 token ids of all passages, back to back
    tokens/<tag>/offsets.npy   int64 [N+1]
    tokens/<tag>/meta.json     tokenizer name, fingerprint, vocab size, template, N

``<tag>`` names the tokenizer and a hash of its full definition, so stores for several
tokenizers live side by side and a changed tokenizer never reads a stale store.
"""
from __future__ import annotations

import array
import hashlib
import json
import os
import re
import shutil
import warnings
from typing import Optional

import numpy as np
import torch

TEMPLATE = "(Title: {title}) {text}"


class TokenStoreError(ValueError):
    """A token store is missing, incomplete or belongs to another tokenizer."""


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's full definition (vocabulary, merges, normaliser, specials)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TokenStoreError(f"{type(tokenizer).__name__} is not a fast tokenizer; the token store needs one")
    return hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()


def tokenizer_tag(tokenizer) -> str:
    name = os.path.basename(str(getattr(tokenizer, "name_or_path", "") or "tokenizer").rstrip("/")) or "tokenizer"
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}-{tokenizer_fingerprint(tokenizer)[:12]}"


def token_store_dir(corpus_root: str, tokenizer) -> str:
    return os.path.join(corpus_root, "tokens", tokenizer_tag(tokenizer))


def build_token_store(corpus, tokenizer, out_dir: Optional[str] = None, batch_size: int = 2048,
                      progress: bool = True) -> "TokenStore":
    """Tokenize every passage of ``corpus`` (a CorpusStore) into a store; returns it opened.

    Written to a side folder and renamed into place, so a killed build leaves no half store.
    """
    from fastcredit.runtime.progress import progress_bar

    out_dir = out_dir or token_store_dir(corpus.root, tokenizer)
    partial = out_dir.rstrip("/") + f".partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    offsets = array.array("q", [0])
    n = len(corpus)
    with open(os.path.join(partial, "tokens.bin"), "wb") as fh, \
            progress_bar(total=n, unit="passage", desc="token store", disable=not progress) as bar:
        for start in range(0, n, batch_size):
            stop = min(n, start + batch_size)
            texts = list(corpus.iter_observation_pieces(start, stop))
            ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
            lens = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
            flat = np.fromiter((t for x in ids for t in x), dtype=np.int32, count=int(lens.sum()))
            fh.write(flat.tobytes())
            offsets.extend((offsets[-1] + np.cumsum(lens)).tolist())
            bar.update(stop - start)
    np.save(os.path.join(partial, "offsets.npy"), np.frombuffer(offsets, dtype=np.int64))
    meta = {"tokenizer": str(getattr(tokenizer, "name_or_path", "")), "fingerprint": tokenizer_fingerprint(tokenizer),
            "vocab_size": len(tokenizer), "template": TEMPLATE, "num_passages": n,
            "corpus_source": corpus.meta.get("source"), "num_tokens": int(offsets[-1])}
    with open(os.path.join(partial, "meta.json"), "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=1)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    os.replace(partial, out_dir)
    return TokenStore(out_dir, tokenizer)


def open_token_store(corpus, tokenizer, progress: bool = True) -> "TokenStore":
    """The store for ``tokenizer`` beside ``corpus``, built on first use."""
    path = token_store_dir(corpus.root, tokenizer)
    if os.path.exists(os.path.join(path, "meta.json")):
        store = TokenStore(path, tokenizer)
        if len(store) == len(corpus):
            return store
    return build_token_store(corpus, tokenizer, path, progress=progress)


class TokenStore:
    """Token ids of every passage: ``tokens`` int32 [T] and ``offsets`` int64 [N+1], memory-mapped."""

    def __init__(self, root: str, tokenizer=None):
        meta_path = os.path.join(root, "meta.json")
        if not os.path.exists(meta_path):
            raise TokenStoreError(f"{root}: no token store here (missing meta.json)")
        with open(meta_path, encoding="utf-8") as fh:
            self.meta = json.load(fh)
        if tokenizer is not None and tokenizer_fingerprint(tokenizer) != self.meta["fingerprint"]:
            raise TokenStoreError(f"{meta_path}: built for tokenizer {self.meta['tokenizer']!r}, "
                                  f"not for {getattr(tokenizer, 'name_or_path', '?')!r} (fingerprints differ)")
        self.root = root
        tok_path = os.path.join(root, "tokens.bin")
        self.tokens = np.memmap(tok_path, dtype=np.int32, mode="r") if os.path.getsize(tok_path) \
            else np.zeros(0, np.int32)
        self.offsets = np.load(os.path.join(root, "offsets.npy"), mmap_mode="r")
        if len(self.offsets) != self.meta["num_passages"] + 1 or int(self.offsets[-1]) != len(self.tokens):
            raise TokenStoreError(f"{root}: offsets.npy and tokens.bin disagree; rebuild the store")
        self._device_cache: dict = {}

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def span(self, row: int) -> tuple[int, int]:
        return int(self.offsets[row]), int(self.offsets[row + 1])

    def ids(self, row: int) -> np.ndarray:
        s, e = self.span(row)
        return np.asarray(self.tokens[s:e])

    def tensors(self, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens int32 [T], offsets int64 [N+1])`` on ``device``; copied once per device and kept.

        On the CPU these are zero-copy views of the memory maps: only the pages a gather
        touches are ever read from disk.
        """
        device = torch.device(device)
        key = str(device)
        if key not in self._device_cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # the memory maps are read-only; they are only read
                tokens = torch.from_numpy(np.asarray(self.tokens)) if len(self.tokens) \
                    else torch.zeros(0, dtype=torch.int32)
                offsets = torch.from_numpy(np.asarray(self.offsets))
            if device.type != "cpu":
                tokens, offsets = tokens.to(device), offsets.to(device)
            self._device_cache[key] = (tokens, offsets)
        return self._device_cache[key]
