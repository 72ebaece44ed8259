"""What a retrieval index's files say without loading them (no FAISS, no torch): the FAISS
header's dimension and row count, and the ``build.json`` a fastcredit build writes beside
its index. The retriever opens indexes with them; ``fastcredit.trainer.memory`` sizes one before
anything loads.
"""
from __future__ import annotations

import json
import os
from typing import Optional

BUILD_INFO = "build.json"
FAISS_HEADER_BYTES = 16  # fourcc, int32 d, int64 ntotal: how every FAISS index file starts


def faiss_header(head: bytes) -> tuple[bytes, int, int]:
    """``(fourcc, d, ntotal)`` from the first :data:`FAISS_HEADER_BYTES` of a FAISS index file."""
    if len(head) < FAISS_HEADER_BYTES:
        raise ValueError(f"{len(head)} bytes: a FAISS header needs {FAISS_HEADER_BYTES}")
    return head[:4], int.from_bytes(head[4:8], "little"), int.from_bytes(head[8:16], "little")


def read_build_info(index: str) -> tuple[Optional[dict], str]:
    """``build.json`` of a fastcredit build (given its folder or its index file), and the index path."""
    folder = index if os.path.isdir(index) else os.path.dirname(os.path.abspath(index))
    info_path = os.path.join(folder, BUILD_INFO)
    if not os.path.exists(info_path):
        if os.path.isdir(index):
            raise FileNotFoundError(f"{index}: a folder without {BUILD_INFO}; pass the index file itself")
        return None, index
    with open(info_path, encoding="utf-8") as fh:
        info = json.load(fh)
    info["folder"] = folder
    return info, (os.path.join(folder, info["index"]) if os.path.isdir(index) else index)
