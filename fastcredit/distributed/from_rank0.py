"""Weights read on rank 0 only: the other ranks build the model on the meta device and receive their part.

    lm = load_policy(cfg, tok, info)                  # rank 0: the checkpoint's fp32 weights; others: meta
    full = rank0_state(module, info)                  # collective: rank 0's full state dict, {} elsewhere,
    model = wrap_fsdp2(module, info, ...)             #   None when every rank holds real weights
    load_from_rank0(model, full, info, device)        # shards allocated, filled from rank 0's tensors

Every rank holding its own fp32 copy of a 7B policy before sharding is 28 GB of host memory
per rank, 224 GB on an 8-GPU node; loading on rank 0 and broadcasting into the shards (as
torchtitan and veRL do) keeps it to one copy per job. Non-persistent buffers (rotary
frequencies) are not in a state dict and are undefined after ``to_empty``: every buffer is
broadcast from rank 0 too. Each function here is collective: every rank calls it at the
same point.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from fastcredit.distributed.process_group import DistInfo, max_over_ranks


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def rank0_state(module: nn.Module, info: DistInfo) -> Optional[dict]:
    """Rank 0's full state dict (references, no copy) when another rank holds meta weights, ``{}`` on those
    ranks, None when no rank does (collective)."""
    meta = has_meta(module)
    if not max_over_ranks(int(meta), info):
        return None
    if info.rank == 0 and meta:
        raise RuntimeError("rank 0 must hold the real weights the other ranks receive; it holds meta tensors")
    return dict(module.state_dict()) if info.rank == 0 else {}


def broadcast_buffers(module: nn.Module, info: DistInfo) -> None:
    """Every buffer of ``module`` from rank 0, in its order (the same module structure on every rank)."""
    for _, buf in sorted(module.named_buffers(), key=lambda kv: kv[0]):
        dist.broadcast(buf.data, src=0)


def load_from_rank0(model: nn.Module, full: dict, info: DistInfo, device: torch.device) -> None:
    """Fill a ``fully_shard``-ed model from rank 0's full state dict (``full``; ``{}`` on other ranks).

    Ranks with meta parameters allocate their shards on ``device`` first (uninitialised; the CPU
    with parameter offload) and their buffers on ``info.device``, where ``fully_shard`` moved rank 0's whatever
    the offload policy (``_move_states_to_device``: with offload on a GPU, rank 0's buffers are on the GPU while
    ``device`` is the CPU, and a buffer's broadcast would be NCCL on rank 0 and gloo on the others);
    ``set_model_state_dict`` then broadcasts each tensor from rank 0 and keeps each rank's shard.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if has_meta(model):
        model.to_empty(device=device)
        for buf in model.buffers():
            buf.data = buf.data.to(info.device)
    # NOTE: set_model_state_dict consumes the dict it is given: pass a copy, the caller's stays whole
    set_model_state_dict(model, dict(full), options=StateDictOptions(full_state_dict=True,
                                                                     broadcast_from_rank0=True))
    broadcast_buffers(model, info)
