"""The training-engine boundary: what the PPO update, weight sync, checkpoints and colocation need from a model.

    policy = build_train_engine(PolicyModel(lm), info, cfg.distributed, adamw(lr=1e-6), grad_clip=1.0)
    logp, ent = policy(x, temperature)         # forward through the wrapped model
    policy.zero_grad(); policy.backward(loss)  # once per micro-batch; the caller owns accumulation
    grad_norm = policy.clip_and_step(1.0)      # pre-clip global gradient norm
    policy.set_lr(3e-7)
    for name, tensor in policy.full_state():   # HF names, one full tensor at a time (collective)
        ...

Implementations: :class:`fastcredit.distributed.fsdp.FSDP2Engine` (``fully_shard`` per
decoder layer and a ``torch.optim`` optimizer; checkpoints through DCP) and
:class:`fastcredit.distributed.deepspeed_engine.DeepSpeedEngine` (DeepSpeed ZeRO stage 2
or 3; checkpoints through the engine's own ``save_checkpoint``);
:func:`fastcredit.distributed.build.build_train_engine` picks one by ``distributed.engine``.
The update's loss normalisation stays ours: each rank's loss is pre-scaled (``dp_size``,
global counts) so that the ranks' *averaged* gradient equals the global batch's, which
both engines' gradient reductions (means over ranks) preserve. This file also holds what
both engines do to an HF model: find its decoder layers, checkpoint their activations,
and strip the wrappers' prefixes from parameter names.
"""
from __future__ import annotations

import abc
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


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


def adamw(**kwargs) -> OptimizerFactory:
    """A factory of ``torch.optim.AdamW(params, **kwargs)`` (the engine decides which parameters it gets)."""
    return lambda params: torch.optim.AdamW(params, **kwargs)


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


def hf_name(name: str) -> str:
    """A state-dict key with the wrappers' prefixes (activation checkpointing, FSDP1) removed."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_fsdp_wrapped_module.", "")
