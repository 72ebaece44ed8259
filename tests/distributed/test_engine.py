"""The training-engine boundary on one process: engine choice, FSDP2's calls, DeepSpeed's config mapping."""
from types import SimpleNamespace

import pytest
import torch

from fastcredit.distributed.build import build_train_engine
from fastcredit.distributed.engine import adamw
from fastcredit.distributed.fsdp import FSDP2Engine
from fastcredit.distributed.process_group import DistInfo
from tiny_logits import tiny_logits_policy


def _dcfg(**kw):
    base = dict(engine="fsdp2", zero_stage=3, mixed_precision=False, cpu_offload=False, activation_checkpointing=False)
    return SimpleNamespace(**{**base, **kw})


def _policy():
    return tiny_logits_policy(vocab=50, hidden=16)


def _grad_norm(model) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()])))


def test_unknown_engine_names_the_key():
    with pytest.raises(ValueError, match="distributed.engine must be one of \\['fsdp2', 'deepspeed'\\], got 'zero'"):
        build_train_engine(_policy(), DistInfo(), _dcfg(engine="zero"), adamw(lr=1e-3), 1.0)


def test_fsdp2_engine_clips_reports_the_pre_clip_norm_and_streams_hf_names():
    hf_names = list(_policy().lm.state_dict())
    engine = build_train_engine(_policy(), DistInfo(), _dcfg(activation_checkpointing=True), adamw(lr=0.5), 1e-3)
    assert isinstance(engine, FSDP2Engine)
    assert [name for name, _ in engine.full_state()] == hf_names  # checkpoint wrappers' prefixes removed
    engine.set_lr(0.25)
    assert [g["lr"] for g in engine.optimizer.param_groups] == [0.25]
    engine.zero_grad()
    ids = torch.randint(0, 50, (2, 7))
    engine.backward(engine(ids).logsumexp(-1).mean())
    expected = _grad_norm(engine.module)
    before = [p.detach().clone() for p in engine.module.parameters()]
    norm = engine.clip_and_step(1e-3)
    assert norm == pytest.approx(expected, rel=1e-6) and norm > 1e-3
    assert _grad_norm(engine.module) == pytest.approx(1e-3, rel=1e-4)
    assert any(not torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))


def test_deepspeed_config_maps_our_settings():
    from fastcredit.distributed.deepspeed_engine import deepspeed_config

    cfg = deepspeed_config(4, 3, bf16=True, cpu_offload=True, grad_clip=0.5)
    # our loop owns accumulation: DeepSpeed must neither divide the loss nor pick the boundary
    assert cfg["gradient_accumulation_steps"] == 1 and cfg["managed_gradient_accumulation"] is False
    assert cfg["gradient_clipping"] == 0.5 and cfg["bf16"] == {"enabled": True}
    assert cfg["communication_data_type"] == "fp32"
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    zero2 = deepspeed_config(4, 2, bf16=False, cpu_offload=True, grad_clip=1.0)
    assert "offload_param" not in zero2["zero_optimization"] and "communication_data_type" not in zero2
    assert "offload_optimizer" not in deepspeed_config(1, 3, False, False, 1.0)["zero_optimization"]
    with pytest.raises(ValueError, match="distributed.zero_stage must be 2 or 3, got 1"):
        deepspeed_config(1, 1, False, False, 1.0)


SHM_CHECK = """
import os
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import fastcredit.distributed.deepspeed_engine
import deepspeed
import deepspeed.comm.comm as cc
deepspeed.init_distributed(dist_backend="gloo")
print("shm op:", cc.cdb.shm_comm_op)
"""


def test_deepspeed_on_a_cpu_builds_no_shared_memory_op():
    """DeepSpeed's CPU comm backend would JIT-compile its inference all-reduce op (about 45 s in every new
    environment); fastcredit's deepspeed engine marks it unused before DeepSpeed starts."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    proc = subprocess.run([sys.executable, "-c", SHM_CHECK], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PORT": port, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "shm op: None" in proc.stdout
