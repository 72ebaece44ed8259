"""``python -m fastcredit.train --memory-report``: the plan of :mod:`fastcredit.trainer.memory` for a config on the
stated hardware, printed before anything loads (no process group, model, data or index; the GPU's size is the one
CUDA query, the host's RAM ``/proc/meminfo``).

    python -m fastcredit.train --config configs/criticsearch.yaml --memory-report --gpu-gib 80 --gpus 8

Exit status: 0 when it can run, 2 when it cannot (or a flag's value cannot be).
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from fastcredit.config import CommandLine, ConfigError

# --memory-report's host RAM a node when no --host-gib is given and this machine is not a node of the plan: an
# 8 x H100 DGX node's 2 TiB (DGX H100's system memory), the node this project's paper configs plan for
DEFAULT_NODE_HOST_GIB = 2048.0
# --memory-report's options and how each value is read
REPORT_OPTIONS = {"--gpu-gib": float, "--gpus": int, "--index-rows": int, "--index-dim": int, "--host-gib": float,
                  "--gpus-per-node": int}
# the flags of the training command's line that are --memory-report's (fastcredit.config.parse_command reads them)
REPORT_FLAGS = {"--memory-report": None, **REPORT_OPTIONS}


def report_request(args: CommandLine) -> Optional[dict]:
    """--memory-report's options as the command line gave them, or None when no report was asked for; a
    ConfigError when its options came without it."""
    opts = {name: value for name, value in args.flags.items() if name in REPORT_OPTIONS}
    if not args.has("--memory-report"):
        if opts:
            raise ConfigError(f"{', '.join(opts)} only apply with --memory-report")
        return None
    return {**opts, "report": True}


def memory_report(cfg, opts: dict) -> int:
    """Print :func:`fastcredit.trainer.memory.format_plan` for ``cfg``; 0 when it can run, 2 otherwise. No process
    group, model, data or index is touched (the GPU's size is the one CUDA query, the host's RAM /proc/meminfo)."""
    from fastcredit.trainer import memory

    gpu_gib = opts.get("--gpu-gib")
    if gpu_gib is None:
        gpu_gib = local_gpus()[1] or 80.0
    try:
        gpus, per_node, where, node_where = report_gpus(cfg, opts, os.environ)
    except ConfigError as exc:
        print(f"memory report: {exc}", file=sys.stderr)
        return 2
    host_gib, source = report_host(opts, per_node if per_node is not None else min(gpus, 8))
    try:
        plan = memory.plan(cfg, gpu_gib, gpus, index_rows=opts.get("--index-rows"),
                           index_dim=opts.get("--index-dim"), host_gib=host_gib, gpus_per_node=per_node,
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


def report_host(opts: dict, ranks_per_node: int) -> tuple[float, str]:
    """``(host RAM of a node in GiB, where it came from)`` for --memory-report: --host-gib; else this machine's
    MemTotal when this machine is a node of the plan (it has a GPU for each of the node's ranks); else the target
    node's default, ``DEFAULT_NODE_HOST_GIB``: a laptop or a login node planning a cluster job is not judged by its
    own RAM."""
    from fastcredit.trainer import memory

    if opts.get("--host-gib") is not None:
        return opts["--host-gib"], "--host-gib"
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


def report_gpus(cfg, opts: dict, env) -> tuple[int, Optional[int], str, str]:
    """``(GPUs, GPUs per node or None for the plan's default, where each came from)`` for --memory-report: --gpus,
    else torchrun's WORLD_SIZE (with LOCAL_WORLD_SIZE per node), else the config's distributed.gpus, else 1;
    --gpus-per-node always wins. ConfigError names a value that cannot be."""
    per_node, node_where = opts.get("--gpus-per-node"), "--gpus-per-node"
    if opts.get("--gpus") is not None:
        gpus, name, where = opts["--gpus"], "--gpus", "--gpus"
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
