"""Policy weights streamed from one rank to others over a process group, bucketed, with their policy version.

    # the sending rank (a trainer rank: the policy's full tensors, in the engine's dtype)
    send_weights(policy.full_state(engine.weight_dtype), version, src=0, group=group, device=device)
    # every other rank of ``group`` (a rollout rank)
    version, named = recv_weights(src=0, group=group, device=device)
    engine.update_weights(named)              # buckets arrive as the engine reads them
    engine.weights_version = version

The building block for weights sent to rollout ranks that do not train (a split placement); colocated
training syncs inside each rank instead (``fastcredit.distributed.colocate``). Tensors travel in
buckets of about ``bucket_bytes``: each bucket is a header (names, dtypes, shapes and byte offsets,
sent as an object) and one flat byte buffer on ``device`` (a CUDA device under NCCL; the CPU under
gloo), so a bucket may mix dtypes, and a tensor larger than a bucket travels alone. The receiver
never holds more than one bucket beyond what the engine has loaded. The stream ends with a header
that counts the tensors sent; if the sender's iterator fails part-way, the receivers get its error
(:class:`WeightStreamError`) instead of waiting for buckets that never come.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 256 << 20
ALIGN = 16  # every tensor starts at a multiple of this in its bucket, so any dtype can view its bytes


class WeightStreamError(RuntimeError):
    """The sending rank failed part-way through a weight stream (its message is the sender's error)."""


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightStreamError(f"weight stream: unknown dtype {name!r} in a bucket header")
    return dtype


def _bcast_header(header: Optional[dict], src: int, group, device) -> dict:
    box = [header]
    dist.broadcast_object_list(box, src=src, group=group, device=device if device.type == "cuda" else None)
    return box[0]


def _flush(entries: list, chunks: list, version: int, src: int, group, device) -> None:
    nbytes = sum(c.numel() for c in chunks)
    _bcast_header({"version": version, "tensors": entries, "nbytes": nbytes}, src, group, device)
    dist.broadcast(torch.cat(chunks), src=src, group=group)


def send_weights(named: Iterable[tuple[str, torch.Tensor]], version: int, src: int, group=None,
                 device: torch.device = torch.device("cpu"), bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Stream ``named`` (as given: cast to the engine's dtype first) to every rank of ``group``; run on rank
    ``src`` while the others run :func:`recv_weights`. Returns the number of tensors sent."""
    entries, chunks, size, count = [], [], 0, 0
    try:
        for name, t in named:
            raw = t.detach().reshape(-1).contiguous().view(torch.uint8).to(device)
            if chunks and size + raw.numel() > bucket_bytes:
                _flush(entries, chunks, version, src, group, device)
                entries, chunks, size = [], [], 0
            if size % ALIGN:
                chunks.append(torch.zeros(ALIGN - size % ALIGN, dtype=torch.uint8, device=device))
                size += ALIGN - size % ALIGN
            entries.append((name, str(t.dtype), tuple(t.shape), size, raw.numel()))
            chunks.append(raw)
            size += raw.numel()
            count += 1
    except Exception as exc:
        _bcast_header({"error": f"{type(exc).__name__}: {exc}"}, src, group, device)
        raise
    if chunks:
        _flush(entries, chunks, version, src, group, device)
    _bcast_header({"end": True, "version": version, "count": count}, src, group, device)
    return count


def recv_weights(src: int, group=None, device: torch.device = torch.device("cpu")
                 ) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """``(version, named tensors)`` sent by rank ``src`` (:func:`send_weights`); the tensors arrive bucket by
    bucket as the iterator is read, which must be read to its end (the stream's collectives are in step)."""
    first = _bcast_header(None, src, group, device)
    if "error" in first:
        raise WeightStreamError(f"rank {src} failed while sending weights: {first['error']}")
    return int(first["version"]), _tensors(first, src, group, device)


def _tensors(header: dict, src: int, group, device) -> Iterator[tuple[str, torch.Tensor]]:
    got = 0
    while "end" not in header:
        if "error" in header:
            raise WeightStreamError(f"rank {src} failed while sending weights: {header['error']}")
        buf = torch.empty(int(header["nbytes"]), dtype=torch.uint8, device=device)
        dist.broadcast(buf, src=src, group=group)
        for name, dtype, shape, offset, nbytes in header["tensors"]:
            yield name, buf[offset:offset + nbytes].view(_dtype(dtype)).view(shape)
            got += 1
        header = _bcast_header(None, src, group, device)
    if header["count"] != got:
        raise WeightStreamError(f"weight stream from rank {src} ended after {got} tensors; it sent {header['count']}")
