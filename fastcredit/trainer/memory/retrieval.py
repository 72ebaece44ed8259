"""Sizes of the retrieval side before anything loads: the index, its query encoder, a rank's share of the index.

    idx = index_size(cfg.retrieval)                    # rows / dim from the file's header, or a default
    each = index_bytes_per_rank(idx, gpus, split=True, shards=1)

The index: flat (and torch) on a GPU N x dim x 2 bytes (fp16), on the CPU N x dim x 4; IVF-PQ
N x (code + 8-byte id) + centroids + codebooks; HNSW N x dim x 4 and its graph; IVF-PQ and HNSW
stay in CPU memory. Under torchrun, retrieval.across_ranks=shard: a rank holds ceil(N / W) rows
(IVF-PQ: and the whole centroids and codebooks); replicate: each rank holds a copy, on a GPU
over retrieval.num_shards GPUs from its own, so each GPU carries index x min(shards, W) / shards.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional

from fastcredit.trainer.memory.shapes import safetensors_params

TOKEN_STORE_GPU_CAP = 4 << 30    # open_retriever's max_gpu_token_bytes
TOKENS_PER_PASSAGE = 140         # a 100-word wiki-18 passage, for a token store not yet built
WIKI18_E5 = (21_015_324, 768)    # Search-R1's e5_Flat.index over wiki-18

# (params, dim) of known query encoders: all-MiniLM-L6-v2 and E5 base / large (BERT).
ENCODERS = {"minilm": (22_713_216, 384), "e5-base": (109_482_240, 768), "e5-large": (335_141_888, 1024)}


def index_header(path: str) -> Optional[tuple[int, int]]:
    """(rows, dim) from a FAISS index file's header, or from a fastcredit build folder's index; None if absent."""
    from fastcredit.retrieval.files import FAISS_HEADER_BYTES, faiss_header, read_build_info

    try:
        path = read_build_info(path)[1] if path and os.path.exists(path) else ""
    except FileNotFoundError:  # a folder that is not a fastcredit build
        return None
    if not os.path.isfile(path) or os.path.getsize(path) < FAISS_HEADER_BYTES:
        return None
    with open(path, "rb") as fh:
        _, dim, rows = faiss_header(fh.read(FAISS_HEADER_BYTES))
    return rows, dim


def _bert_params(config: dict) -> int:
    """A BERT encoder's parameters from its config.json: embeddings, L layers, the pooler."""
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    positions, types = config.get("max_position_embeddings", 512), config.get("type_vocab_size", 2)
    embeddings = (config["vocab_size"] + positions + types) * hidden + 2 * hidden
    layer = 4 * hidden * hidden + 4 * hidden + 2 * hidden * inter + inter + hidden + 4 * hidden
    return embeddings + layers * layer + hidden * hidden + hidden


def encoder_size(name: str) -> tuple[int, int, str]:
    """(params, dim, source) of a query encoder: a folder's headers / config.json, else a known name."""
    cfg_path = os.path.join(name, "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as fh:
            config = json.load(fh)
        return safetensors_params(name) or _bert_params(config), config["hidden_size"], "folder"
    base = os.path.basename(os.path.normpath(name)).lower()
    for key, (params, dim) in ENCODERS.items():
        if key in base:
            return params, dim, "known"
    return ENCODERS["e5-base"][0], ENCODERS["e5-base"][1], "assumed BERT-base"


@dataclass
class IndexSize:
    rows: int
    dim: int
    total_bytes: int     # the whole index (HNSW: its vectors; the graph is graph_bytes)
    on_gpu: bool
    source: str          # where rows / dim came from
    shared_bytes: int = 0  # what every shard holds whole: IVF centroids and PQ codebooks
    graph_bytes: int = 0   # HNSW's links, levels and offsets, in CPU memory beside the vectors


def hnsw_graph_bytes(rows: int, dim: int) -> int:
    """FAISS HNSW's graph: 2M int32 links a row at level 0, M a level above (on average 1 / (M - 1) levels
    a row, taken as one link), an 8-byte offset and a 4-byte level: rows x ((2M + 1) x 4 + 12) bytes."""
    from fastcredit.retrieval.indexes import factory_string

    links = int(factory_string("hnsw", rows, dim).removeprefix("HNSW"))
    return rows * ((2 * links + 1) * 4 + 12)


def _rows_and_dim(rcfg, rows: Optional[int], dim: Optional[int]) -> tuple[int, int, str]:
    source = "--index-rows/--index-dim"
    if rows is None or dim is None:
        found = index_header(rcfg.index)
        names = f"{rcfg.corpus or ''} {rcfg.index or ''}".lower()
        if found:
            source = f"header of {rcfg.index}"
        elif "wiki-18" in names or "e5_flat" in names:
            found, source = WIKI18_E5, "wiki-18 e5 default: the file is not here"
        else:
            found = (0, encoder_size(rcfg.encoder)[1])
            source = "size unknown (a toy or unbuilt corpus; pass --index-rows and --index-dim)"
        rows, dim = rows if rows is not None else found[0], dim if dim is not None else found[1]
    return rows, dim, source


def index_size(rcfg, rows: Optional[int] = None, dim: Optional[int] = None) -> IndexSize:
    """The retrieval index: rows / dim from the overrides, the file's header, or the wiki-18 e5 default."""
    rows, dim, source = _rows_and_dim(rcfg, rows, dim)
    gpu = rcfg.backend == "local" and rcfg.device != "cpu"
    if rcfg.index_type in ("flat", "torch"):
        return IndexSize(rows, dim, rows * dim * (2 if gpu else 4), gpu, source)
    if rcfg.index_type == "ivfpq" and rows:
        from fastcredit.retrieval.indexes import factory_string

        ivf, pq = factory_string("ivfpq", rows, dim).split(",")
        nlist = int(ivf.removeprefix("IVF"))
        sub_quantizers, bits = map(int, pq.removeprefix("PQ").split("x"))
        shared = nlist * dim * 4 + (2 ** bits) * dim * 4
        code_bytes = math.ceil(sub_quantizers * bits / 8)
        return IndexSize(rows, dim, rows * (code_bytes + 8) + shared, False, source, shared)
    graph = hnsw_graph_bytes(rows, dim) if rcfg.index_type == "hnsw" and rows else 0
    return IndexSize(rows, dim, rows * dim * 4, False, source, graph_bytes=graph)


def index_bytes_per_rank(idx: IndexSize, gpus: int, split: bool, shards: int) -> int:
    """What one rank's process holds of the index (its vectors / codes; HNSW's graph apart).

    ``split`` (retrieval.across_ranks=shard over W > 1 ranks): the largest share, ceil(N / W)
    rows and the centroids and codebooks whole. Else a GPU index spread over ``shards`` GPUs
    from each rank's own puts index x min(shards, W) / shards on every GPU; a CPU index is whole.
    """
    if split:
        per_row = (idx.total_bytes - idx.shared_bytes) // idx.rows
        return idx.shared_bytes + -(-idx.rows // gpus) * per_row
    if idx.on_gpu:
        return idx.total_bytes * min(shards, gpus) // shards
    return idx.total_bytes


def token_store_bytes(rows: int) -> int:
    """The passage token store of a corpus of ``rows`` passages: int32 tokens and int64 offsets."""
    return rows * TOKENS_PER_PASSAGE * 4 + 8 * (rows + 1)


def token_store_fits_gpu(rows: int) -> bool:
    """Whether open_retriever moves the token store to the GPU: its tokens (int32) within the cap; past the cap
    it stays memory-mapped on the CPU."""
    return 0 < rows * TOKENS_PER_PASSAGE * 4 <= TOKEN_STORE_GPU_CAP
