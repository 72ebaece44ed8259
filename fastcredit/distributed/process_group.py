"""The process group: torchrun's environment, the device mesh, shutdown, and reductions over ranks.

    torchrun --nproc_per_node=8 -m fastcredit.train ...   # NCCL on GPUs
    torchrun --nproc_per_node=2 -m fastcredit.train ...   # gloo on a CPU

:func:`init_distributed` reads torchrun's environment (one process without it), picks
the backend (``nccl`` with CUDA, else ``gloo``) and builds a 1-D data-parallel mesh, or a
2-D ``(replicate, shard)`` mesh for HSDP when ``distributed.shard_size`` divides the world.
The reductions are identities on one process, so callers never branch on the world size.
"""
from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: Optional[str] = None
    mesh: object = None  # DeviceMesh, or None on one process

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(backend: str = "auto", shard_size: int = -1) -> DistInfo:
    """Initialise the process group from torchrun's environment (a no-op for one process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world == 1:
        return DistInfo(device=device)
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    from torch.distributed.device_mesh import init_device_mesh

    dev_type = "cuda" if cuda else "cpu"
    if 0 < shard_size < world:
        if world % shard_size:
            raise ValueError(f"distributed.shard_size={shard_size} must divide the world size {world}")
        mesh = init_device_mesh(dev_type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(dev_type, (world,), mesh_dim_names=("dp",))
    return DistInfo(rank, world, local, device, backend, mesh)


def one_process_group(info: DistInfo) -> DistInfo:
    """``info`` with a process group and a 1-rank mesh also on one process (torchrun's world is left alone).

    FSDP2's ``fully_shard`` (master weights held in fp32, compute in bf16) and DeepSpeed both
    need a group even when there is nothing to shard across; a private in-memory store means
    no rendezvous address or port. :func:`shutdown` destroys it like torchrun's.
    """
    if info.distributed:
        return info
    if not dist.is_initialized():
        dist.init_process_group("nccl" if info.device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    os.environ.setdefault("LOCAL_RANK", str(info.local_rank))
    if info.mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        info.mesh = init_device_mesh(info.device.type, (1,), mesh_dim_names=("dp",))
    return info


def shutdown(info: DistInfo, code: int = 0) -> None:
    """Destroy the process group and leave at once.

    NOTE: gloo's worker threads race the interpreter's shutdown and abort 10-20% of CPU
    runs after all work is done; ``os._exit`` right after the destroy avoids it.
    """
    if dist.is_initialized():  # torchrun's group, or the one-process group FSDP2 and DeepSpeed need
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def all_reduce_sum(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum over ranks in place (identity on one process)."""
    if info.distributed:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def max_over_ranks(n: int, info: DistInfo) -> int:
    """The largest ``n`` over ranks (e.g. micro-batch counts every rank must run)."""
    if not info.distributed:
        return n
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def mean_over_ranks(values: dict, info: DistInfo) -> dict:
    """Rank means of a ``{name: float}`` dict, in one all-reduce (the dict itself on one process)."""
    if not info.distributed or not values:
        return dict(values)
    keys = sorted(values)
    t = all_reduce_sum(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64), info) / info.world_size
    return dict(zip(keys, t.tolist()))
