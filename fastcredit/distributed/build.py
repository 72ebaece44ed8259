"""The training engine ``distributed.engine`` names, built around a model with its optimizer.

    policy = build_train_engine(PolicyModel(lm), info, cfg.distributed, adamw(lr=1e-6), grad_clip=1.0,
                                param_dtype=compute_dtype(cfg.distributed, info, cfg.model.dtype))

DeepSpeed is imported only when it is chosen.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from fastcredit.distributed.engine import OptimizerFactory, TrainEngine
from fastcredit.distributed.from_rank0 import load_from_rank0, rank0_state
from fastcredit.distributed.fsdp import FSDP2Engine, wrap_fsdp2
from fastcredit.distributed.process_group import DistInfo

ENGINES = ("fsdp2", "deepspeed")


def compute_dtype(dcfg, info: DistInfo, dtype: str = "bfloat16") -> Optional[torch.dtype]:
    """The dtype forward and backward run in: ``model.dtype`` under ``distributed.mixed_precision`` on CUDA;
    None (the fp32 master weights themselves) otherwise."""
    return getattr(torch, dtype) if dcfg.mixed_precision and info.device.type == "cuda" else None


def build_train_engine(module: nn.Module, info: DistInfo, dcfg, make_optimizer: OptimizerFactory,
                       grad_clip: float, param_dtype: Optional[torch.dtype] = None) -> TrainEngine:
    """``module`` (fp32: its parameters become the master weights) wrapped by the engine ``dcfg.engine`` names
    (a ``DistributedConfig``), with its optimizer; ``param_dtype``: the compute dtype (:func:`compute_dtype`).

    Ranks other than 0 may hold ``module`` on the meta device (``fastcredit.models.build.load_policy``): FSDP2
    then fills their shards from rank 0's weights (``fastcredit.distributed.from_rank0``)."""
    bad = sorted({str(p.dtype) for p in module.parameters() if p.dtype != torch.float32})
    if bad:
        raise ValueError(f"the trained model's parameters must be float32 master weights, found {', '.join(bad)} "
                         "(load it in float32; model.dtype sets the compute dtype)")
    if dcfg.engine == "fsdp2":
        full = rank0_state(module, info)
        model = wrap_fsdp2(module, info, param_dtype, dcfg.cpu_offload, dcfg.activation_checkpointing)
        if full is not None:
            load_from_rank0(model, full, info, torch.device("cpu") if dcfg.cpu_offload else info.device)
        return FSDP2Engine(model, make_optimizer(model.parameters()), info.device, dcfg.cpu_offload)
    if dcfg.engine == "deepspeed":
        if any(p.is_meta for p in module.parameters()):
            raise ValueError("distributed.engine=deepspeed loads the weights on every rank; a meta-device model "
                             "(loaded on rank 0 only) is for fsdp2")
        from fastcredit.distributed.deepspeed_engine import wrap_deepspeed

        return wrap_deepspeed(module, info, make_optimizer, zero_stage=dcfg.zero_stage,
                              mixed_precision=param_dtype is not None, cpu_offload=dcfg.cpu_offload,
                              activation_checkpointing=dcfg.activation_checkpointing, grad_clip=grad_clip)
    raise ValueError(f"distributed.engine must be one of {list(ENGINES)}, got {dcfg.engine!r}")
