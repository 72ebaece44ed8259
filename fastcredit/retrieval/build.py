"""Corpus → embeddings → index (+ token store), resumable.

    python -m fastcredit.retrieval.build --corpus runs/toyworld/corpus.jsonl --out runs/toyworld/index
    python -m fastcredit.retrieval.build --corpus wiki-18.jsonl --out wiki18-e5 \\
        --encoder /models/e5-base-v2 --query-prefix "query: " --passage-prefix "passage: " \\
        --tokenizer /models/Qwen2.5-3B --chunk-size 262144

Writes into ``--out``: ``corpus/`` (the memory-mapped corpus store, and ``corpus/tokens/``
for ``--tokenizer``), ``embeddings/chunk_*.npy`` with ``manifest.json``, the FAISS index
``<encoder>_<Flat|HNSW32|IVFPQ>.index`` and ``build.json``, which ``open_retriever`` and
``serve`` read. Each embedding chunk is written to a temporary name and renamed, then
recorded in the manifest; a killed build resumes from the recorded chunks, and a build
with different encoder settings refuses to mix its chunks with the old ones.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Optional

import numpy as np

from fastcredit.config import command_parser
from fastcredit.retrieval.cli import add_encoder_args
from fastcredit.retrieval.corpus import CorpusStore, open_corpus_store
from fastcredit.retrieval.encoders import Encoder

MANIFEST = "manifest.json"
EXIT_INCOMPLETE = 3


class BuildError(RuntimeError):
    """The build cannot continue; the message names the file and the mismatch."""


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _fingerprint(store: CorpusStore, encoder: Encoder, chunk_size: int) -> dict:
    return {**encoder.fingerprint(), "dtype": str(encoder.dtype), "chunk_size": chunk_size,
            "num_passages": len(store), "corpus_size": store.meta["source_size"],
            "corpus_mtime_ns": store.meta["source_mtime_ns"]}


def _load_manifest(emb_dir: str, fingerprint: dict, overwrite: bool) -> dict:
    path = os.path.join(emb_dir, MANIFEST)
    if os.path.exists(path) and not overwrite:
        with open(path, encoding="utf-8") as fh:
            manifest = json.load(fh)
        old = manifest.get("fingerprint", {})
        diff = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
        if diff:
            raise BuildError(f"{path}: finished chunks were built with different settings "
                             f"({', '.join(f'{k}: {old.get(k)!r} -> {fingerprint.get(k)!r}' for k in diff)}); "
                             "pass --overwrite to start again")
        return manifest
    for name in os.listdir(emb_dir):
        if name.startswith("chunk_") or name == MANIFEST:
            os.remove(os.path.join(emb_dir, name))
    return {"fingerprint": fingerprint, "done": {}}


def embed_corpus(store: CorpusStore, encoder: Encoder, emb_dir: str, chunk_size: int = 65536,
                 max_chunks: Optional[int] = None, overwrite: bool = False, progress: bool = True) -> Optional[list]:
    """Encode every passage in chunks of ``chunk_size`` rows; returns the chunks memory-mapped,
    or None when ``max_chunks`` new chunks were written and some remain (resume later)."""
    from fastcredit.runtime.progress import progress_bar

    os.makedirs(emb_dir, exist_ok=True)
    manifest = _load_manifest(emb_dir, _fingerprint(store, encoder, chunk_size), overwrite)
    n = len(store)
    num_chunks = -(-n // chunk_size)
    done_rows = sum(v["rows"] for v in manifest["done"].values())
    written = 0
    with progress_bar(total=n, initial=done_rows, unit="passage", desc="embeddings", disable=not progress) as bar:
        for c in range(num_chunks):
            if str(c) in manifest["done"]:
                continue
            if max_chunks is not None and written >= max_chunks:
                return None
            start, stop = c * chunk_size, min(n, (c + 1) * chunk_size)
            emb = encoder.encode_passages(list(store.iter_contents(start, stop))).cpu().numpy()
            name = f"chunk_{c:06d}.npy"
            tmp = os.path.join(emb_dir, f"{name}.tmp-{os.getpid()}.npy")
            np.save(tmp, emb.astype(np.float32, copy=False))
            os.replace(tmp, os.path.join(emb_dir, name))
            manifest["done"][str(c)] = {"file": name, "rows": stop - start}
            _write_json(os.path.join(emb_dir, MANIFEST), manifest)
            written += 1
            bar.update(stop - start)
    return [np.load(os.path.join(emb_dir, manifest["done"][str(c)]["file"]), mmap_mode="r") for c in range(num_chunks)]


def index_file_name(encoder_name: str, index_type: str, hnsw_m: int = 32) -> str:
    short = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(encoder_name.rstrip("/"))) or "encoder"
    kind = {"flat": "Flat", "torch": "Flat", "hnsw": f"HNSW{hnsw_m}", "ivfpq": "IVFPQ"}[index_type]
    return f"{short}_{kind}.index"


def _load_tokenizer(tokenizer):
    if tokenizer is None or not isinstance(tokenizer, str):
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer, local_files_only=True, use_fast=True)


def build_all(corpus: str, out_dir: str, encoder: str = "minilm", pooling: str = "mean", query_prefix: str = "",
              passage_prefix: str = "", max_length: int = 256, index_type: str = "flat", batch_size: int = 256,
              chunk_size: int = 65536, device: str = "auto", dtype: str = "auto", tokenizer=None, hnsw_m: int = 32,
              nlist: Optional[int] = None, pq_m: Optional[int] = None, index_name: Optional[str] = None,
              max_chunks: Optional[int] = None, overwrite: bool = False, progress: bool = True,
              encoder_obj: Optional[Encoder] = None) -> Optional[str]:
    """Run the whole build into ``out_dir``; returns ``out_dir``, or None when stopped early by ``max_chunks``.

    ``encoder_obj`` replaces loading ``encoder`` by name (tests pass a tiny in-code model).
    """
    from fastcredit.retrieval.indexes import build_faiss_index, write_index

    os.makedirs(out_dir, exist_ok=True)
    store = open_corpus_store(corpus, os.path.join(out_dir, "corpus"), progress=progress)
    enc = encoder_obj or Encoder.from_pretrained(encoder, pooling, query_prefix, passage_prefix, max_length,
                                                 batch_size, device, dtype)
    chunks = embed_corpus(store, enc, os.path.join(out_dir, "embeddings"), chunk_size, max_chunks, overwrite, progress)
    if chunks is None:
        return None
    index_name = index_name or index_file_name(enc.name, index_type, hnsw_m)
    write_index(build_faiss_index(chunks, index_type, hnsw_m, nlist, pq_m, progress=progress),
                os.path.join(out_dir, index_name))
    tok = _load_tokenizer(tokenizer)
    token_dir = None
    if tok is not None:
        from fastcredit.retrieval.tokstore import build_token_store, token_store_dir

        token_dir = os.path.relpath(
            build_token_store(store, tok, token_store_dir(store.root, tok), progress=progress).root, out_dir)
    _write_json(os.path.join(out_dir, "build.json"), {
        "corpus": os.path.abspath(corpus), "corpus_store": "corpus", "index": index_name, "index_type": index_type,
        "encoder": {**enc.fingerprint(), "query_prefix": enc.query_prefix}, "num_passages": len(store),
        "token_store": token_dir,
    })
    return out_dir


def parser() -> argparse.ArgumentParser:
    p = command_parser("python -m fastcredit.retrieval.build", __doc__)
    p.add_argument("--corpus", required=True, help="corpus jsonl (Search-R1 format: id, contents)")
    p.add_argument("--out", required=True, help="output folder (created; resumed when it holds a partial build)")
    add_encoder_args(p, query_prefix_help="recorded for search time (E5: 'query: ')",
                     passage_prefix_help="prepended to passages (E5: 'passage: ')")
    p.add_argument("--max-length", type=int, default=256, help="encoder tokens per passage")
    p.add_argument("--hnsw-m", type=int, default=32, help="HNSW neighbours per node")
    p.add_argument("--nlist", type=int, default=None, help="IVF lists (default ~4 sqrt(N))")
    p.add_argument("--pq-m", type=int, default=None, help="PQ sub-quantizers (default dim/8)")
    p.add_argument("--batch-size", type=int, default=256, help="passages per encoder forward")
    p.add_argument("--chunk-size", type=int, default=65536, help="passages per resumable embedding chunk")
    p.add_argument("--tokenizer", default=None, help="policy tokenizer folder: also pre-tokenize every passage")
    p.add_argument("--max-chunks", type=int, default=None, help="stop after this many new chunks (resume later)")
    p.add_argument("--overwrite", action="store_true", help="discard finished chunks instead of resuming")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: Optional[list] = None) -> int:
    a = parser().parse_args(argv)
    out = build_all(a.corpus, a.out, a.encoder, a.pooling, a.query_prefix, a.passage_prefix, a.max_length,
                    a.index_type, a.batch_size, a.chunk_size, a.device, a.dtype, a.tokenizer, a.hnsw_m, a.nlist,
                    a.pq_m, max_chunks=a.max_chunks, overwrite=a.overwrite, progress=not a.quiet)
    if out is None:
        print(f"stopped after --max-chunks={a.max_chunks} new chunks; run the same command again to resume",
              file=sys.stderr)
        return EXIT_INCOMPLETE
    print(f"built {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
