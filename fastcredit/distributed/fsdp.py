"""Process group, device mesh and FSDP2 wrapping; with the other files of this package, the only place that talks
to torch.distributed.

    torchrun --nproc_per_node=8 -m fastcredit.train ...   # NCCL on GPUs
    torchrun --nproc_per_node=2 -m fastcredit.train ...   # gloo on a CPU

:func:`init_distributed` reads torchrun's environment (one process without it), picks
the backend (``nccl`` with CUDA, else ``gloo``) and builds a 1-D data-parallel mesh, or a
2-D ``(replicate, shard)`` mesh for HSDP when ``distributed.shard_size`` divides the world.
:func:`wrap_fsdp2` applies ``fully_shard`` to every decoder layer and then to the root,
with bf16 compute / fp32 reduction (``mixed_precision``), optional parameter and
optimizer-state offload to the CPU (``cpu_offload``) and activation checkpointing of the
decoder layers (``activation_checkpointing``). :func:`stream_full_state` yields full
tensors one at a time (each FSDP2 DTensor gathered with ``full_tensor()``), the weight
sync into the rollout engine. The PPO update reaches these through
:class:`fastcredit.distributed.engine.FSDP2Engine`.
"""
from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn


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


def shutdown(info: DistInfo, code: int = 0) -> None:
    """Destroy the process group and leave at once.

    NOTE: gloo's worker threads race the interpreter's shutdown and abort 10-20% of CPU
    runs after all work is done; ``os._exit`` right after the destroy avoids it (ENV-NOTES.md).
    """
    if dist.is_initialized():  # torchrun's group, or the one-process group DeepSpeed needs
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF causal LM, however deep it sits (``model.layers``,
    ``lm.model.layers``, ``transformer.h``): the first ``ModuleList`` named ``layers`` or ``h``."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h") and len(mod):
            return list(mod)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (a ModuleList named layers or h)")


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in the backward pass (non-reentrant checkpoint wrappers)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing as apply_ac
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = set(map(id, decoder_layers(model)))
    apply_ac(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: id(m) in layers)


def wrap_fsdp2(model: nn.Module, info: DistInfo, mixed_precision: bool = True, cpu_offload: bool = False,
               activation_checkpointing: bool = False) -> nn.Module:
    """``fully_shard`` per decoder layer, then the root; on one process only checkpointing applies."""
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if not info.distributed:
        return model
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kw = {"mesh": info.mesh}
    if mixed_precision and info.device.type == "cuda":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):  # the checkpoint wrappers, when checkpointing applied
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def stream_full_state(model: nn.Module, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` one parameter / buffer at a time, HF names (wrappers' prefixes removed).

    Collective under FSDP2: every rank must iterate (each ``full_tensor()`` all-gathers one
    tensor), so peak extra memory is one unsharded tensor, not the model.
    """
    for name, t in model.state_dict().items():
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        yield hf_name(name), (t.to(dtype) if dtype is not None and t.is_floating_point() else t).detach()


def hf_name(name: str) -> str:
    """A state-dict key with the wrappers' prefixes (activation checkpointing, FSDP1) removed."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_fsdp_wrapped_module.", "")


def all_reduce_sum(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum over ranks in place (identity on one process)."""
    if info.distributed:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def broadcast_object(obj, info: DistInfo, src: int = 0):
    """Rank ``src``'s Python object on every rank."""
    if not info.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
