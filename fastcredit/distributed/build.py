"""The training engine ``distributed.engine`` names, built around a model with its optimizer.

    policy = build_train_engine(PolicyModel(lm), info, cfg.distributed, adamw(lr=1e-6), grad_clip=1.0)

DeepSpeed is imported only when it is chosen.
"""
from __future__ import annotations

from torch import nn

from fastcredit.distributed.engine import OptimizerFactory, TrainEngine
from fastcredit.distributed.fsdp import FSDP2Engine, wrap_fsdp2
from fastcredit.distributed.process_group import DistInfo

ENGINES = ("fsdp2", "deepspeed")


def build_train_engine(module: nn.Module, info: DistInfo, dcfg, make_optimizer: OptimizerFactory,
                       grad_clip: float) -> TrainEngine:
    """``module`` wrapped by the engine ``dcfg.engine`` names (a ``DistributedConfig``), with its optimizer."""
    if dcfg.engine == "fsdp2":
        model = wrap_fsdp2(module, info, dcfg.mixed_precision, dcfg.cpu_offload, dcfg.activation_checkpointing)
        return FSDP2Engine(model, make_optimizer(model.parameters()), info.device)
    if dcfg.engine == "deepspeed":
        from fastcredit.distributed.deepspeed_engine import wrap_deepspeed

        return wrap_deepspeed(module, info, make_optimizer, zero_stage=dcfg.zero_stage,
                              mixed_precision=dcfg.mixed_precision, cpu_offload=dcfg.cpu_offload,
                              activation_checkpointing=dcfg.activation_checkpointing, grad_clip=grad_clip)
    raise ValueError(f"distributed.engine must be one of {list(ENGINES)}, got {dcfg.engine!r}")
