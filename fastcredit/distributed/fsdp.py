"""FSDP2: ``fully_shard`` wrapping, full-tensor streaming for the weight sync, and the FSDP2 training engine.

:func:`wrap_fsdp2` applies ``fully_shard`` to every decoder layer and then to the root,
with bf16 compute / fp32 reduction (``mixed_precision``), optional parameter and
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
from fastcredit.distributed.process_group import DistInfo


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


class FSDP2Engine(TrainEngine):
    """A ``wrap_fsdp2`` model (plain on one process) and a ``torch.optim`` optimizer."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device = torch.device("cpu")):
        self.model, self.module, self.optimizer, self.device = model, model, optimizer, device

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
        self.model.to("cpu")
        move_optimizer_state(self.optimizer, "cpu")

    def reload(self) -> None:
        self.model.to(self.device)
        move_optimizer_state(self.optimizer, self.device)

    def dcp_state(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        return self.model, self.optimizer
