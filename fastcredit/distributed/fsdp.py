"""FSDP2: ``fully_shard`` wrapping, full-tensor streaming for the weight sync, and the FSDP2 training engine.

:func:`wrap_fsdp2` applies ``fully_shard`` to every decoder layer and then to the root
(on one process too: the sharded parameters are the fp32 master weights), with bf16
compute / fp32 reduction (``mixed_precision``), optional parameter and
optimizer-state offload to the CPU (``cpu_offload``) and activation checkpointing of the
decoder layers (``activation_checkpointing``). :func:`stream_full_state` yields full
tensors one at a time (each FSDP2 DTensor gathered with ``full_tensor()``), the weight
sync into the rollout engine. :class:`FSDP2Engine` is the
:class:`~fastcredit.distributed.engine.TrainEngine` the PPO update reaches them through.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import nn

from fastcredit.distributed.engine import (TrainEngine, apply_activation_checkpointing, decoder_layers, hf_name,
                                           move_optimizer_state)
from fastcredit.distributed.from_rank0 import load_from_rank0, rank0_state
from fastcredit.distributed.process_group import DistInfo, one_process_group


def wrap_fsdp2(model: nn.Module, info: DistInfo, param_dtype: Optional[torch.dtype] = None, cpu_offload: bool = False,
               activation_checkpointing: bool = False) -> nn.Module:
    """``fully_shard`` per decoder layer, then the root, on every world size (one process too).

    The module's own parameters are the master weights and stay as loaded (fp32 for a
    trained model); ``param_dtype`` (bf16 on CUDA) is the dtype FSDP2 gathers them into for
    forward and backward, gradients are reduced and kept in fp32 (``reduce_dtype``), and the
    optimizer, built over the sharded fp32 parameters, keeps fp32 state. Sharding moves the
    shards onto the mesh's device.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if activation_checkpointing:
        apply_activation_checkpointing(model)
    info = one_process_group(info)
    kw: dict = {"mesh": info.mesh}
    if param_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=info.device.type == "cuda")
    for layer in decoder_layers(model):  # the checkpoint wrappers, when checkpointing applied
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def stream_full_state(model: nn.Module, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` one parameter / buffer at a time, HF names (wrappers' prefixes removed).

    Collective under FSDP2: every rank must iterate (each ``full_tensor()`` all-gathers one
    tensor), so peak extra memory is one unsharded tensor, not the model. The shards must be
    on the training device (NCCL cannot gather CPU shards): the phase manager syncs before
    it offloads the training state.
    """
    for name, t in model.state_dict().items():
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)  # the local shard first: the all-gather then moves bf16, not fp32
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        yield hf_name(name), t.detach()


class FSDP2Engine(TrainEngine):
    """A ``wrap_fsdp2`` model and a ``torch.optim`` optimizer over its sharded fp32 parameters.

    ``cpu_offload``: FSDP2's CPUOffloadPolicy already keeps the shards and the optimizer
    state in CPU memory, so :meth:`offload` / :meth:`reload` have nothing to move.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device = torch.device("cpu"),
                 cpu_offload: bool = False):
        self.model, self.module, self.optimizer, self.device = model, model, optimizer, device
        self.cpu_offload = cpu_offload

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_and_step(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP2
        self.optimizer.step()
        return norm

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def full_state(self, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        return stream_full_state(self.model.lm, dtype)

    def offload(self) -> None:
        if not self.cpu_offload:
            self.model.to("cpu")  # FSDP2 moves the sharded parameters (and their gradients, freed here)
            move_optimizer_state(self.optimizer, "cpu")

    def reload(self) -> None:
        if not self.cpu_offload:
            self.model.to(self.device)
            move_optimizer_state(self.optimizer, self.device)

    def dcp_state(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        return self.model, self.optimizer


class FrozenModel:
    """A frozen model (the reference policy) sharded like the trained one, on the device only while it is used.

    Its parameters are already in the compute dtype (no master copy: it never changes), so
    it costs ``2 P / W`` bytes per GPU in bf16, and none outside :meth:`reload` ..
    :meth:`offload` (the phase manager's ``using``).
    """

    def __init__(self, module: nn.Module, info: DistInfo):
        module.requires_grad_(False).eval()
        full = rank0_state(module, info)
        self.module = wrap_fsdp2(module, info)
        if full is not None:
            load_from_rank0(self.module, full, info, info.device)
        self.device = info.device

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def offload(self) -> None:
        self.module.to("cpu")

    def reload(self) -> None:
        self.module.to(self.device)
