"""fp32 master weights: the trained model is sharded by FSDP2 on one process too, computes in bf16, keeps fp32
parameters and fp32 Adam moments, and so keeps updates that a bf16 copy would round away."""
from types import SimpleNamespace

import pytest
import torch

from fastcredit.distributed.build import build_train_engine
from fastcredit.distributed.engine import adamw
from fastcredit.distributed.process_group import DistInfo
from tiny_logits import tiny_logits_policy


def _policy():
    return tiny_logits_policy(vocab=64, hidden=32)


_DCFG = SimpleNamespace(engine="fsdp2", zero_stage=3, mixed_precision=True, cpu_offload=False,
                        activation_checkpointing=True)


def _loss(engine):
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    return engine(ids).float().logsumexp(-1).mean()


def test_fp32_master_weights_and_moments_bf16_compute_and_tiny_updates_kept():
    from torch.distributed.tensor import DTensor

    engine = build_train_engine(_policy(), DistInfo(), _DCFG, adamw(lr=1e-6, weight_decay=0.0), 1.0,
                                param_dtype=torch.bfloat16)
    params = list(engine.module.parameters())
    assert params and all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in params)
    seen = []
    engine.module.lm.lm_head.register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, m.weight.dtype)))
    before = [p.full_tensor().clone() for p in params]
    engine.zero_grad()
    engine.backward(_loss(engine))
    assert seen == [(torch.bfloat16, torch.bfloat16)]  # gathered into bf16 for compute
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)
    engine.clip_and_step(1.0)
    moments = [s[k] for s in engine.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and all(m.dtype == torch.float32 for m in moments)
    after = [p.full_tensor() for p in params]
    changed = sum(int((a != b).sum()) for a, b in zip(after, before))
    # the same update applied to bf16 weights: w + Δ rounded to bf16
    kept_in_bf16 = sum(int((b.bfloat16() + (a - b).bfloat16() != b.bfloat16()).sum()) for a, b in zip(after, before))
    total = sum(b.numel() for b in before)
    # Adam's first step moves every weight by ~lr = 1e-6: fp32 holds it, bf16 (8 bits of mantissa) rounds it away.
    assert changed > 0.9 * total
    assert kept_in_bf16 < 0.05 * total  # 2.3% here: the weights closest to 0


def test_a_bf16_model_is_refused_as_master_weights():
    with pytest.raises(ValueError, match="float32 master weights, found torch.bfloat16"):
        build_train_engine(_policy().to(torch.bfloat16), DistInfo(), _DCFG, adamw(lr=1e-6), 1.0)


def test_load_policy_gives_float32_for_every_source(tmp_path):
    from fastcredit.models.build import load_policy
    from fastcredit.config import TrainConfig
    from fastcredit.data.tokenizer import build_tiny_tokenizer
    from fastcredit.models.tiny import build_tiny_policy, save_tiny_policy

    tok = build_tiny_tokenizer(["hello world where is the river"] * 20, vocab_size=300)
    save_tiny_policy(build_tiny_policy(tok, hidden=32, layers=1, heads=2).to(torch.bfloat16), tok, str(tmp_path))
    cfg = TrainConfig()
    cfg.model.policy, cfg.model.dtype = str(tmp_path), "bfloat16"
    assert {p.dtype for p in load_policy(cfg, tok).parameters()} == {torch.float32}
    cfg.model.policy = "tiny"
    assert {p.dtype for p in load_policy(cfg, tok).parameters()} == {torch.float32}
