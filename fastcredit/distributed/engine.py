"""The training-engine boundary: what the PPO update, weight sync, checkpoints and colocation need from a model.

    policy = build_train_engine(PolicyModel(lm), info, cfg.distributed, adamw(lr=1e-6), grad_clip=1.0)
    logp, ent = policy(x, temperature)         # forward through the wrapped model
    policy.zero_grad(); policy.backward(loss)  # once per micro-batch; the caller owns accumulation
    grad_norm = policy.clip_and_step(1.0)      # pre-clip global gradient norm
    policy.set_lr(3e-7)
    for name, tensor in policy.full_state():   # HF names, one full tensor at a time (collective)
        ...

``distributed.engine`` picks the implementation: :class:`FSDP2Engine` (``fully_shard`` per
decoder layer and a ``torch.optim`` optimizer; checkpoints through DCP) or
:class:`fastcredit.distributed.deepspeed_engine.DeepSpeedEngine` (DeepSpeed ZeRO stage 2 or
3, ``distributed.zero_stage``; checkpoints through the engine's own ``save_checkpoint``).
The update's loss normalisation stays ours: each rank's loss is pre-scaled (``dp_size``,
global counts) so that the ranks' *averaged* gradient equals the global batch's, which
both engines' gradient reductions (means over ranks) preserve.
"""
from __future__ import annotations

import abc
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from fastcredit.distributed.fsdp import DistInfo, stream_full_state, wrap_fsdp2

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
ENGINES = ("fsdp2", "deepspeed")


class TrainEngine(abc.ABC):
    """One trained model (policy or value) with its optimizer; see the module docstring."""

    module: nn.Module  # the model as built (PolicyModel / ValueModel), whatever wraps it

    @abc.abstractmethod
    def __call__(self, *args, **kwargs):
        """The model's forward, through the engine's wrapper."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Drop the gradients before a mini-batch's first micro-batch."""

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate this micro-batch's gradient (no rescaling: the loss is already normalised)."""

    @abc.abstractmethod
    def clip_and_step(self, max_norm: float) -> float:
        """Clip the global gradient norm to ``max_norm``, step the optimizer; returns the norm before clipping."""

    @abc.abstractmethod
    def set_lr(self, lr: float) -> None:
        """The learning rate of every parameter group."""

    @abc.abstractmethod
    def full_state(self, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, full tensor)`` of ``module.lm``, one at a time; collective: every rank iterates."""

    @abc.abstractmethod
    def offload(self) -> None:
        """Training state off the accelerator (colocation: the rollout phase needs the memory)."""

    @abc.abstractmethod
    def reload(self) -> None:
        """Training state back on the accelerator."""

    def dcp_state(self) -> Optional[tuple[nn.Module, torch.optim.Optimizer]]:
        """``(model, optimizer)`` for a DCP checkpoint, or None when the engine saves itself (:meth:`save_state`)."""
        return None

    def save_state(self, folder: str) -> None:
        """Write model and optimizer state under ``folder`` (collective); engines with a :meth:`dcp_state` need not."""
        raise NotImplementedError(f"{type(self).__name__} checkpoints through DCP (dcp_state)")

    def load_state(self, folder: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} checkpoints through DCP (dcp_state)")


def move_optimizer_state(opt: torch.optim.Optimizer, device) -> None:
    """Every state tensor of ``opt`` but the step counters to ``device``."""
    for state in opt.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and k != "step":
                state[k] = v.to(device, non_blocking=True)


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


def adamw(**kwargs) -> OptimizerFactory:
    """A factory of ``torch.optim.AdamW(params, **kwargs)`` (the engine decides which parameters it gets)."""
    return lambda params: torch.optim.AdamW(params, **kwargs)


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
