"""What a run's config puts where, shared by the GPU plan and the host plan.

    shard = shard_group(cfg.distributed, gpus)      # S: the FSDP shard group
    state = training_state_bytes(cfg, shape, shard)  # {"policy": 16P/S, "value": ...}: params, grads, AdamW
    judge = judge_setup(cfg, shape)                  # the critic and how this process serves it
    OffloadChoice(moves=True, reason="as set")       # whether the training state leaves the GPU (memory.offload)

The rules mirror the code that builds the run (``fastcredit.trainer.roles.build_training_side``,
``fastcredit.judges.phase.make_backend``) without importing it: the report loads no model code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fastcredit.trainer.memory.shapes import ModelShape, lookup_shape

STATE_BYTES_PER_PARAM = 16  # fp32 master 4, fp32 gradient 4, AdamW's two fp32 moments 8


def shard_group(dcfg, gpus: int) -> int:
    """S: distributed.shard_size when it divides the world (HSDP), else every GPU."""
    if 0 < dcfg.shard_size <= gpus and gpus % dcfg.shard_size == 0:
        return dcfg.shard_size
    return gpus


def trained_params(cfg, shape: ModelShape) -> dict:
    """Parameters of each trained model: the policy, and the value model when the estimator needs one."""
    from fastcredit.credit.registry import estimator_needs

    params = {"policy": shape.params}
    if estimator_needs(cfg.credit.estimator).value_model:
        params["value"] = shape.value_params()
    return params


def training_state_bytes(cfg, shape: ModelShape, shard: int) -> dict:
    """Bytes per rank of each trained model's state, 16 bytes a parameter over S, wherever it lives."""
    return {name: STATE_BYTES_PER_PARAM * params // shard for name, params in trained_params(cfg, shape).items()}


def zero2_bytes(dcfg, shape: ModelShape) -> int:
    """DeepSpeed ZeRO-2's bf16 parameters, whole on every rank (0 for other engines and stages)."""
    return 2 * shape.params if dcfg.engine == "deepspeed" and dcfg.zero_stage == 2 else 0


@dataclass(frozen=True)
class OffloadChoice:
    """What ``distributed.offload_state`` comes to for a run. ``moves``: the training state and the reference go
    to the host while the engines work; ``reason`` says why; ``setting``: the config's value; ``utilization``:
    vLLM's share beside the kept state, from the plan (auto keeping with vLLM's automatic share; else None);
    ``reserve_bytes``: the margin the plan keeps free beside that share; ``applies``: false where nothing could
    move (no GPU, no colocation)."""
    moves: bool
    reason: str
    setting: object = "auto"
    utilization: Optional[float] = None
    reserve_bytes: int = 0
    applies: bool = True

    def line(self) -> str:
        """``distributed.offload_state=auto: the training state stays on the GPU (the plan ...)``, for the console."""
        if not self.applies:
            what = "nothing moves"
        else:
            what = "the training state " + ("moves to the host while the engines work" if self.moves
                                            else "stays on the GPU")
        return f"distributed.offload_state={setting_text(self.setting)}: {what} ({self.reason})"


def setting_text(setting) -> str:
    """The config value as written: ``auto``, ``true``, ``false``."""
    return str(setting).lower() if isinstance(setting, bool) else str(setting)


def uses_reference(cfg) -> bool:
    """A reference model for a KL term (loss.kl_coef or credit.kl_in_reward)."""
    return cfg.loss.kl_coef > 0 or cfg.credit.kl_in_reward > 0


def reference_bytes(cfg, shape: ModelShape, shard: int) -> int:
    """The reference model's bf16 shard, 2P/S (0 without one)."""
    return 2 * shape.params // shard if uses_reference(cfg) else 0


@dataclass
class JudgeSetup:
    """How a colocated judge runs. ``mode``: 'policy' (a self-critic: the policy's own engine), 'switch' (a
    critic of the policy's architecture, switched into its engine from pinned host memory), 'own' (an HF
    engine of its own), 'refused' (it needs an engine of its own, which vLLM cannot give in this process),
    or '' (no colocated judge)."""
    mode: str
    critic: Optional[ModelShape] = None
    why: str = ""


def judge_setup(cfg, shape: ModelShape) -> JudgeSetup:
    """The colocated judge's critic and mode (``fastcredit.judges.phase.make_backend``'s rules)."""
    judges, rollout = cfg.judges, cfg.rollout
    if judges.backend != "colocated":
        return JudgeSetup("")
    if not judges.model:
        return JudgeSetup("policy", shape)
    critic = lookup_shape(judges.model, "judges.model")
    if shape.same_architecture(critic) and not rollout.proceed.enabled:
        return JudgeSetup("switch", critic)
    if rollout.proceed.enabled:
        why = "ProCeed asks it during the rollout"
    else:
        why = f"its architecture ({critic.name}) differs from the policy's ({shape.name})"
    return JudgeSetup("refused" if rollout.engine == "vllm" else "own", critic, why)
