"""Command-line flags shared by ``python -m fastcredit.retrieval.build`` and ``.serve``: encoder, index type, device."""
from __future__ import annotations

import argparse

from fastcredit.retrieval.encoders import DTYPES
from fastcredit.retrieval.indexes import INDEX_TYPES


def add_encoder_args(p: argparse.ArgumentParser, query_prefix_help: str, passage_prefix_help: str) -> None:
    """``--encoder --pooling --query-prefix --passage-prefix --index-type --device --dtype``."""
    p.add_argument("--encoder", default="minilm", help="'minilm' (packaged) or a local HF encoder folder")
    p.add_argument("--pooling", default="mean", choices=("mean", "cls"), help="how token vectors become one (E5: mean)")
    p.add_argument("--query-prefix", default="", help=query_prefix_help)
    p.add_argument("--passage-prefix", default="", help=passage_prefix_help)
    p.add_argument("--index-type", default="flat", choices=INDEX_TYPES,
                   help="FAISS index (exact flat, HNSW, IVF-PQ) or torch")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                   help="encoder dtype (auto: bfloat16 on a GPU, float32 on the CPU)")
