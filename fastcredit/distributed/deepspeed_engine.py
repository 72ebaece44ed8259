"""DeepSpeed ZeRO as the training engine (``distributed.engine=deepspeed``), behind :class:`TrainEngine`.

    python -m fastcredit.train --config configs/debug.yaml distributed.engine=deepspeed
    torchrun --nproc_per_node=2 -m fastcredit.train --config configs/debug.yaml distributed.engine=deepspeed
    torchrun --nproc_per_node=8 -m fastcredit.train --config configs/cwgrpo.yaml distributed.engine=deepspeed \\
        distributed.zero_stage=2

:func:`wrap_deepspeed` hands ``deepspeed.initialize`` the model and a ready ``torch.optim``
optimizer (an optimizer *named* in the DeepSpeed config would JIT-compile DeepSpeed's CPU
Adam first), with:

* ZeRO stage 3 (parameters, gradients and optimizer state sharded) or 2 (gradients and
  optimizer state), ``distributed.zero_stage``;
* our own micro-batch loop: ``gradient_accumulation_steps`` is 1, so DeepSpeed never divides
  the loss (the update normalises by global counts itself), and
  ``managed_gradient_accumulation`` is off, so ``engine.step()`` is the accumulation
  boundary: every ``backward`` adds into the partitioned gradients, ``step`` reduces what
  is left, clips (``gradient_clipping``) and steps; the pre-clip norm comes back from
  ``get_global_grad_norm()`` (``actor/grad_norm``). Ranks' gradients are averaged, as FSDP2 does;
* bf16 compute on CUDA with fp32 master weights and fp32 gradient reduction
  (``distributed.mixed_precision``); fp32 on the CPU;
* ``distributed.cpu_offload``: ZeRO-Offload of the optimizer (and, at stage 3, the
  parameters) to CPU memory; the torch optimizer then runs there on the CPU;
* activation checkpointing of the HF decoder layers, the same wrappers FSDP2 uses.

Weight sync gathers one ZeRO-3 parameter at a time (``GatheredParameters``) and yields HF
names, like :func:`fastcredit.distributed.fsdp.stream_full_state`. Checkpoints use the
engine's ``save_checkpoint`` / ``load_checkpoint`` inside fastcredit's atomic step folder.
Colocation moves the state off the GPU with DeepSpeed's ``offload_states`` /
``reload_states``, in the phase manager's order (the weight sync gathers from the GPU, then
the state leaves). Against FSDP2 it keeps the same fp32 master weights and moments but adds
a bf16 copy of its parameter partitions (2 bytes per parameter, over the ranks at stage 3,
whole at stage 2); its compute dtype is always bf16 (``model.dtype=float16`` is not honoured).

On a CPU (gloo) DeepSpeed's CPU accelerator works without IPEX / oneCCL, but its first
process group JIT-compiles a shared-memory comm op (~27 s once per machine, cached in
``TORCH_EXTENSIONS_DIR``); training never uses it.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

# NOTE: DeepSpeed picks its accelerator once, at first use. Without CUDA it probes for
# xpu / npu / hpu / ... packages and falls back to "cpu" with a warning; naming the one we
# want is DeepSpeed's supported override (an explicit DS_ACCELERATOR from the user wins).
os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")

# DeepSpeed 0.19.8 calls the collectives torch 2.13 renamed, and torch warns at every call.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is "
                        "deprecated", category=FutureWarning)

import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum  # noqa: E402

# NOTE: on its CPU accelerator DeepSpeed's comm backend JIT-compiles a shared-memory all-reduce op
# (deepspeed_shm_comm) when it starts: about 45 s of C++ in every new environment (the build is keyed on the
# environment's path). Only DeepSpeed inference's inference_all_reduce uses it; training's collectives go through
# torch.distributed. An op marked incompatible is one build_shm_op skips.
if os.environ["DS_ACCELERATOR"] == "cpu":
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

from fastcredit.distributed.engine import (  # noqa: E402
    OptimizerFactory, TrainEngine, apply_activation_checkpointing, hf_name, move_optimizer_state)
from fastcredit.distributed.process_group import DistInfo, one_process_group  # noqa: E402


def deepspeed_config(world_size: int, zero_stage: int, bf16: bool, cpu_offload: bool, grad_clip: float) -> dict:
    """The DeepSpeed config dict for our update loop (see the module docstring)."""
    if zero_stage not in (2, 3):
        raise ValueError(f"distributed.zero_stage must be 2 or 3, got {zero_stage!r}")
    zero: dict = {"stage": zero_stage, "contiguous_gradients": True}
    if cpu_offload:
        pin = torch.cuda.is_available()
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
        if zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    cfg = {
        "train_micro_batch_size_per_gpu": 1,  # DeepSpeed's bookkeeping only: our loop owns the batches
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": float(grad_clip),
        "bf16": {"enabled": bool(bf16)},
        "zero_optimization": zero,
        # ZeRO-Offload refuses a client torch optimizer unless told that the slower CPU step is intended.
        "zero_force_ds_cpu_optimizer": False,
    }
    if bf16:
        cfg["communication_data_type"] = "fp32"  # reduce gradients in fp32, as FSDP2's reduce_dtype does
    return cfg


def wrap_deepspeed(module: nn.Module, info: DistInfo, make_optimizer: OptimizerFactory, zero_stage: int = 3,
                   mixed_precision: bool = True, cpu_offload: bool = False, activation_checkpointing: bool = False,
                   grad_clip: float = 1.0, overrides: Optional[dict] = None) -> "DeepSpeedEngine":
    """``module`` (a PolicyModel / ValueModel) and its optimizer as a DeepSpeed ZeRO engine.

    ``overrides`` are merged into the config's sections (tests use it for
    ``zero_optimization.stage3_param_persistence_threshold`` and untested optimizers).
    """
    if activation_checkpointing:
        apply_activation_checkpointing(module)
    one_process_group(info)
    deepspeed.utils.logger.setLevel(logging.WARNING)  # its per-init INFO lines drown the step table
    bf16 = bool(mixed_precision) and info.device.type == "cuda"
    cfg = deepspeed_config(dist.get_world_size(), zero_stage, bf16, cpu_offload, grad_clip)
    for key, value in (overrides or {}).items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    optimizer = make_optimizer(module.parameters())
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=cfg)
    if zero_stage == 3:
        # e.g. the LM head that PolicyModel applies itself: gather it for the whole forward / backward
        for p in getattr(module, "external_params", lambda: [])():
            deepspeed.zero.register_external_parameter(module, p)
    return DeepSpeedEngine(engine, zero_stage, grad_clip, cpu_offload)


def stream_zero_state(module: nn.Module, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, full tensor)`` of ``module``'s state dict, one at a time (collective under ZeRO-3).

    Each ZeRO-3 parameter is gathered alone and copied out before it is partitioned again,
    so peak extra memory is one unsharded tensor; under ZeRO-2 parameters are already whole.
    """
    for name, t in module.state_dict(keep_vars=True).items():
        if hasattr(t, "ds_id"):
            with deepspeed.zero.GatheredParameters([t]):
                out = t.detach().to(dtype if dtype is not None and t.is_floating_point() else t.dtype, copy=True)
        else:
            out = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).detach()
        yield hf_name(name), out


class DeepSpeedEngine(TrainEngine):
    """A ``deepspeed.DeepSpeedEngine`` behind the :class:`TrainEngine` calls (see the module docstring)."""

    def __init__(self, engine, zero_stage: int, grad_clip: float, cpu_offload: bool):
        self.engine, self.module = engine, engine.module
        self.zero_stage, self.grad_clip, self.cpu_offload = zero_stage, float(grad_clip), cpu_offload
        self._moved_master = False

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def zero_grad(self) -> None:
        self.engine.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def clip_and_step(self, max_norm: float) -> float:
        if float(max_norm) != self.grad_clip:  # DeepSpeed fixes the clip value when the engine is built
            raise ValueError(f"optim.grad_clip={max_norm} differs from the {self.grad_clip} this engine was built with")
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float("nan") if norm is None else float(norm)

    def set_lr(self, lr: float) -> None:
        for g in self.engine.optimizer.param_groups:
            g["lr"] = lr

    def full_state(self, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        return stream_zero_state(self.module.lm, dtype)

    def save_state(self, folder: str) -> None:
        self.engine.save_checkpoint(os.path.dirname(folder), tag=os.path.basename(folder), save_latest=False)

    def load_state(self, folder: str) -> None:
        path, _ = self.engine.load_checkpoint(os.path.dirname(folder), tag=os.path.basename(folder),
                                              load_optimizer_states=True, load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint in {folder}")

    def _offload_kinds(self) -> list:
        """The states DeepSpeed's ``offload_states`` moves for a torch optimizer here."""
        kinds = list(OffloadStateTypeEnum)
        if self.zero_stage == 3:
            # NOTE: ZeRO-3's offload_states asserts DeepSpeed's FusedAdam before it moves the
            # fp32 master partitions or the Adam moments (a check of the optimizer's class, not of
            # its state layout); for a torch optimizer those two move in _move_master instead.
            kinds = [k for k in kinds if k not in (OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states)]
        return kinds

    def _move_master(self, device) -> None:
        """ZeRO-3's fp32 master partitions and the optimizer's moments to ``device`` (their gradients are freed
        at every step)."""
        opt = self.engine.optimizer
        for flat in opt.fp32_partitioned_groups_flat:
            flat.data = flat.data.to(device)  # in place: the torch optimizer holds these very tensors
        move_optimizer_state(opt.optimizer, device)

    def offload(self) -> None:
        if self.cpu_offload and self.zero_stage == 3:  # ZeRO-Offload already keeps parameters and optimizer
            return  # state in CPU memory (and DeepSpeed refuses to move offloaded parameters)
        # with ZeRO-2 + offload DeepSpeed itself leaves out the states its CPU optimizer holds
        self.engine.offload_states(include=self._offload_kinds(), pin_memory=True)
        if self.zero_stage == 3 and not self._moved_master:
            self._move_master("cpu")
            self._moved_master = True

    def reload(self) -> None:
        if self.cpu_offload and self.zero_stage == 3:
            return
        self.engine.reload_states()
        if self._moved_master:
            from deepspeed.accelerator import get_accelerator

            self._move_master(get_accelerator().current_device_name())
            self._moved_master = False
