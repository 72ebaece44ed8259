"""``python -m fastcredit.train --memory-report``: the plan of :mod:`fastcredit.trainer.memory` for a config on the
stated hardware, printed before anything loads (no process group, model, data or index; the GPU's size is the one
CUDA query, the host's RAM ``/proc/meminfo``).

    python -m fastcredit.train --config configs/criticsearch.yaml --memory-report --gpu-gib 80 --gpus 8
    memory_report(cfg, ReportRequest(gpu_gib=80, gpus=8))      # what that command runs

The flags are declared with the trainer's builders (``fastcredit.trainer.build``), which turn the command line into
a :class:`ReportRequest`. Exit status: 0 when it can run, 2 when it cannot (or a stated count cannot be).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional

from fastcredit.config import ConfigError

# --memory-report's host RAM a node when no --host-gib is given and this machine is not a node of the plan: an
# 8 x H100 DGX node's 2 TiB (DGX H100's system memory), the node this project's paper configs plan for
DEFAULT_NODE_HOST_GIB = 2048.0


@dataclass(frozen=True)
class ReportRequest:
    """What a memory report plans for; None: not stated (each field's default is in the training command's help)."""

    gpu_gib: Optional[float] = None  # --gpu-gib: GPU size in GiB
    gpus: Optional[int] = None  # --gpus: GPUs, one rank each
    index_rows: Optional[int] = None  # --index-rows: retrieval index rows when its file is not here
    index_dim: Optional[int] = None  # --index-dim: and its dimension
    host_gib: Optional[float] = None  # --host-gib: host RAM of a node in GiB
    gpus_per_node: Optional[int] = None  # --gpus-per-node: ranks on a node


def memory_report(cfg, request: ReportRequest) -> int:
    """Print :func:`fastcredit.trainer.memory.format_plan` for ``cfg``; 0 when it can run, 2 otherwise. No process
    group, model, data or index is touched (the GPU's size is the one CUDA query, the host's RAM /proc/meminfo)."""
    from fastcredit.trainer import memory

    gpu_gib = request.gpu_gib
    if gpu_gib is None:
        gpu_gib = local_gpus()[1] or 80.0
    try:
        gpus, per_node, where, node_where = report_gpus(cfg, request, os.environ)
    except ConfigError as exc:
        print(f"memory report: {exc}", file=sys.stderr)
        return 2
    host_gib, source = report_host(request, per_node if per_node is not None else min(gpus, 8))
    try:
        plan = memory.plan(cfg, gpu_gib, gpus, index_rows=request.index_rows,
                           index_dim=request.index_dim, host_gib=host_gib, gpus_per_node=per_node,
                           host_source=source)
    except memory.ShapeError as exc:
        print(f"memory report: {exc}", file=sys.stderr)
        return 2
    plan.notes.insert(0, f"GPUs: {gpus} ({where}), {plan.host.ranks_per_node} per node ({node_where})")
    if cfg.distributed.placement == "split":
        plan.notes.insert(1, "distributed.placement=split is planned as colocated ranks: an upper bound, since a "
                             "split job's training ranks hold no engine and its rollout ranks no training state")
    print(memory.format_plan(plan))
    return 0 if plan.ok else 2


def local_gpus() -> tuple[int, Optional[float]]:
    """``(CUDA devices on this machine, the first one's GiB or None)``."""
    import torch

    if not torch.cuda.is_available():
        return 0, None
    return torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory / 2**30


def report_host(request: ReportRequest, ranks_per_node: int) -> tuple[float, str]:
    """``(host RAM of a node in GiB, where it came from)`` for --memory-report: --host-gib; else this machine's
    MemTotal when this machine is a node of the plan (it has a GPU for each of the node's ranks); else the target
    node's default, ``DEFAULT_NODE_HOST_GIB``: a laptop or a login node planning a cluster job is not judged by its
    own RAM."""
    from fastcredit.trainer import memory

    if request.host_gib is not None:
        return request.host_gib, "--host-gib"
    count, _ = local_gpus()
    local = memory.machine_memory_gib() if count else None
    if count >= ranks_per_node and local is not None:
        return local, "MemTotal of this machine, /proc/meminfo"
    why = ("no GPU here" if not count else
           f"this machine has {count} GPU(s), the plan {ranks_per_node} a node")
    return DEFAULT_NODE_HOST_GIB, (f"default: an 8 x H100 DGX node's 2 TiB ({why}, so this machine's RAM is not the "
                                   "target's; --host-gib states the target's)")


def _env_count(env, name: str) -> int:
    try:
        value = int(env[name])
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{name}={env[name]!r} in the environment is not a number of GPUs (torchrun sets it to "
                          "one, two, ...); unset it or pass --gpus")
    return value


def report_gpus(cfg, request: ReportRequest, env) -> tuple[int, Optional[int], str, str]:
    """``(GPUs, GPUs per node or None for the plan's default, where each came from)`` for --memory-report: --gpus,
    else torchrun's WORLD_SIZE (with LOCAL_WORLD_SIZE per node), else the config's distributed.gpus, else 1;
    --gpus-per-node always wins. ConfigError names a value that cannot be."""
    per_node, node_where = request.gpus_per_node, "--gpus-per-node"
    if request.gpus is not None:
        gpus, name, where = request.gpus, "--gpus", "--gpus"
        if gpus < 1:
            raise ConfigError(f"--gpus {gpus} must be at least 1")
    elif env.get("WORLD_SIZE"):
        gpus, name, where = _env_count(env, "WORLD_SIZE"), "WORLD_SIZE", "torchrun's WORLD_SIZE"
        if per_node is None and env.get("LOCAL_WORLD_SIZE"):
            per_node, node_where = _env_count(env, "LOCAL_WORLD_SIZE"), "torchrun's LOCAL_WORLD_SIZE"
    elif cfg.distributed.gpus > 0:
        gpus, name = cfg.distributed.gpus, "distributed.gpus"
        where = "the config's distributed.gpus; --gpus or torchrun's WORLD_SIZE would come first"
    else:
        gpus, name, where = 1, "the GPU count", "none stated by --gpus, WORLD_SIZE or distributed.gpus: one"
    if per_node is not None and not 0 < per_node <= gpus:
        raise ConfigError(f"{node_where.split()[-1]} {per_node} must be between 1 and {name} ({gpus})")
    return gpus, per_node, where, node_where if per_node is not None else "the smaller of the GPUs and 8"
