"""The process group: torchrun's environment, the device mesh, shutdown, and reductions over ranks.

    torchrun --nproc_per_node=8 -m fastcredit.train ...   # NCCL for CUDA tensors, gloo for CPU ones
    torchrun --nproc_per_node=2 -m fastcredit.train ...   # gloo on a CPU

:func:`init_distributed` reads torchrun's environment (one process without it), picks
the backend (:func:`backend_for`) and builds a 1-D data-parallel mesh, or a 2-D
``(replicate, shard)`` mesh for HSDP when ``distributed.shard_size`` divides the world.
The reductions are identities on one process, so callers never branch on the world size.

A process group dispatches a collective by the device type of its tensors. NCCL serves
only ``cuda``, so on GPUs the group is ``cpu:gloo,cuda:nccl``: the scalar reductions
(:func:`max_over_ranks`, :func:`mean_over_ranks`), FSDP2's gradient norm of CPU-offloaded
shards and checkpoint bookkeeping run on CPU tensors over gloo, the model's tensors over
NCCL. ``FASTCREDIT_EMULATE_NCCL=1`` builds every group on a CPU machine as it would be built
on GPUs, gloo standing in for NCCL on the ``cuda`` device type only: a group that lacks a CPU
backend (a bare ``nccl`` one becomes ``cuda:gloo``) refuses CPU tensors here as it would on
GPUs, and the mixed group's dispatch runs under FSDP2, DeepSpeed and checkpointing (the tests
run the distributed suite this way).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


EMULATE_NCCL_ENV = "FASTCREDIT_EMULATE_NCCL"
# made: the process group now up is one this module made (torchrun's, or the one-process one), so shutdown ends it;
# held: this process has had a group (ours, or one a library made, as vLLM does on one process): see exit_process
_GROUP = {"made": False, "held": False}


def emulating_nccl() -> bool:
    """Whether process groups follow NCCL's device rules on this CPU machine (``FASTCREDIT_EMULATE_NCCL=1``)."""
    return os.environ.get(EMULATE_NCCL_ENV, "0") == "1"


def backend_for(device_type: str, requested: str = "auto") -> str:
    """The backend string of the process group (``distributed.backend``: auto, nccl or gloo).

    CUDA: ``cpu:gloo,cuda:nccl`` (auto or nccl; a bare ``nccl`` group has no backend for CPU
    tensors) or ``gloo``. CPU: ``gloo``; under :func:`emulating_nccl`, what CUDA would get with
    gloo serving the ``cuda`` type in NCCL's place (``cuda:gloo`` where CUDA would get bare
    ``nccl``), so the same device-type dispatch applies.
    """
    if requested not in ("auto", "nccl", "gloo"):
        raise ValueError(f"distributed.backend must be auto, nccl or gloo, got {requested!r}")
    gpu_rules = device_type == "cuda" or emulating_nccl()
    if not gpu_rules or requested == "gloo":
        return "gloo"
    backend = "cpu:gloo,cuda:nccl"
    return backend.replace("cuda:nccl", "cuda:gloo") if device_type != "cuda" else backend


def serves(device_type: str, group=None) -> bool:
    """Whether ``group`` (default: the world) has a backend for tensors of ``device_type``."""
    config = dist.get_backend_config(group)
    if ":" not in config:  # a bare backend name: gloo serves cpu and cuda, nccl cuda only
        return device_type == "cuda" if config == "nccl" else config == "gloo"
    return any(part.split(":")[0].strip() == device_type for part in config.split(","))


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: Optional[str] = None
    mesh: object = None  # DeviceMesh, or None on one process
    # The group the reductions below run over (None: the whole job). A split placement's roles each get a DistInfo
    # of their own ranks: ``rank`` / ``world_size`` count inside it (fastcredit.distributed.split).
    group: object = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def world_size_here() -> int:
    """The job's number of ranks, from torchrun's environment (1 without torchrun); readable before the process
    group starts, so a config can be checked against it first."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(backend: str = "auto", shard_size: int = -1) -> DistInfo:
    """Initialise the process group from torchrun's environment (a no-op for one process)."""
    world = world_size_here()
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world == 1:
        return DistInfo(device=device)
    backend = backend_for(device.type, backend)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
        _GROUP.update(made=True, held=True)
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
        dist.init_process_group(backend_for(info.device.type), store=dist.HashStore(), rank=0, world_size=1)
        _GROUP.update(made=True, held=True)
    os.environ.setdefault("LOCAL_RANK", str(info.local_rank))
    if info.mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        info.mesh = init_device_mesh(info.device.type, (1,), mesh_dim_names=("dp",))
    return info


def shutdown(info: DistInfo, code: int = 0) -> int:
    """End the process group this module made (torchrun's, or the one-process group FSDP2 and DeepSpeed need), after
    a barrier; returns ``code``. A group made by someone else (vLLM's, on one process; a caller's) is theirs to end:
    left up. The command's ``__main__`` then leaves by :func:`exit_process`."""
    if dist.is_initialized():
        dist.barrier()
        _GROUP["held"] = True
        if _GROUP["made"]:
            dist.destroy_process_group()
            _GROUP["made"] = False
    return code


def exit_process(code: Optional[int]) -> None:
    """Leave the process with exit status ``code`` (a command's ``__main__``: ``exit_process(main())``).

    NOTE: gloo's worker threads race the interpreter's shutdown and abort 10-20% of CPU runs after all work is
    done, even once the group is destroyed; a process that has had a group leaves by ``os._exit`` (its streams
    flushed), skipping that shutdown. Any other process exits as ``sys.exit`` does.
    """
    if _GROUP["held"] or dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if code is None else code)
    sys.exit(code)


@contextlib.contextmanager
def rank_failure_ends_job(info: DistInfo, expected: tuple = ()):
    """Under torchrun, an exception on this rank ends its process at once (its traceback printed, exit status 1).

    The other ranks may be waiting for this one in a collective (retrieval rounds, a gather of evaluation results,
    a gradient reduce), and an interpreter that unwinds normally can wait on them too, or abort in gloo's threads:
    a process that is gone is what torchrun sees and stops the job for. ``expected``: exception types every rank
    raises together (bad input found on rank 0 and sent to all): they go on, as on one process."""
    try:
        yield
    except Exception as exc:  # SystemExit and KeyboardInterrupt go on as they are
        if not info.distributed or isinstance(exc, expected):
            raise
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def all_reduce_sum(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum over ranks in place (identity on one process)."""
    if info.distributed:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=info.group)
    return x


def max_over_ranks(n: int, info: DistInfo) -> int:
    """The largest ``n`` over ranks (e.g. micro-batch counts every rank must run)."""
    if not info.distributed:
        return n
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=info.group)
    return int(t)


def mean_over_ranks(values: dict, info: DistInfo) -> dict:
    """Rank means of a ``{name: float}`` dict (the dict itself on one process).

    Ranks may hold different names (a metric only some ranks' trajectories produce): each
    name's mean is over the ranks that hold it. One exchange of the names, one all-reduce of
    ``[sum, count]`` per name.
    """
    if not info.distributed:
        return dict(values)
    names: list = [None] * info.world_size
    dist.all_gather_object(names, sorted(values), group=info.group)
    keys = sorted(set().union(*names))
    if not keys:
        return {}
    t = torch.tensor([[float(values[k]), 1.0] if k in values else [0.0, 0.0] for k in keys], dtype=torch.float64)
    t = all_reduce_sum(t, info)
    return {k: float(total / count) for k, (total, count) in zip(keys, t.tolist())}
