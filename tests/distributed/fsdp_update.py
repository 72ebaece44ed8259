"""One PPO update of a tiny policy, on one process or under torchrun, with FSDP2 or DeepSpeed ZeRO (gloo on a CPU).

    python tests/distributed/fsdp_update.py OUT.pt                          # the whole batch, one process
    torchrun --standalone --nproc_per_node=2 tests/distributed/fsdp_update.py OUT.pt   # each rank its half
    ENGINE=deepspeed ZERO=3 torchrun --standalone --nproc_per_node=2 tests/distributed/fsdp_update.py OUT.pt

Writes the updated parameters (full tensors, rank 0) and the update's metrics to OUT.pt.
The batch is 8 trajectories in 4 groups of 2, ranks take whole groups; the loss uses the
global counts, so every run must produce the same parameters. ``EPOCHS`` (default 1) PPO
epochs over the batch are as many optimizer steps. ``AGG`` (default turn-mean): the loss's
aggregation; a comma-separated list runs one update from the same start for each, and OUT.pt then
maps each to its parameters and metrics.

``ENGINE=deepspeed`` trains through DeepSpeed ZeRO stage ``ZERO`` (default 3; a comma-separated list runs each
stage in turn, each from a fresh engine, and OUT.pt then maps ``zero<stage>`` to the run) with every
parameter partitioned (persistence threshold 0, so the LM head really is gathered as an
external parameter), activation checkpointing on, and the state offloaded and reloaded
through the colocation path before the update.
"""
import os
import sys

import torch

from fastcredit.models.packed import PolicyModel, forward_logprobs
from fastcredit.trainer.update import UpdateData, ppo_update
from fastcredit.config import OptimConfig
from fastcredit.credit import CreditInputs, compute_advantages
from fastcredit.config.credit import CreditConfig
from fastcredit.distributed.fsdp import FSDP2Engine, wrap_fsdp2
from fastcredit.distributed.process_group import all_reduce_sum, exit_process, init_distributed, shutdown
from fastcredit.config.loss import LossConfig
from fastcredit.rollout.trajectory import Turn, from_turns, select


def tiny_lm():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg)


def whole_batch():
    g = torch.Generator().manual_seed(1)
    trajs, prompts = [], []
    for b in range(8):
        turns = []
        for t in range(int(torch.randint(1, 4, (1,), generator=g))):
            act = torch.randint(3, 64, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
            obs = torch.randint(3, 64, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
            turns.append(Turn(act, "search", obs))
        turns.append(Turn(torch.randint(3, 64, (3,), generator=g).tolist(), "answer"))
        trajs.append(turns)
        prompts.append(torch.randint(3, 64, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist())
    batch = from_turns(trajs, group_id=[b // 2 for b in range(8)])
    reward = torch.tensor([1.0, 0.0, 0.2, 1.0, 0.0, 0.0, 1.0, 0.8])
    return batch, prompts, reward


def main(argv: list) -> int:
    out = argv[0]
    info = init_distributed("gloo")
    aggs = os.environ.get("AGG", "turn-mean").split(",")
    engine = os.environ.get("ENGINE", "fsdp2")
    stages = [int(z) for z in os.environ.get("ZERO", "3").split(",")] if engine == "deepspeed" else [None]
    if len(aggs) > 1 and len(stages) > 1:
        raise SystemExit("fsdp_update: a list in AGG or in ZERO, not in both")
    runs = {(agg if stage is None or len(stages) == 1 else f"zero{stage}"): update(info, agg, engine, stage)
            for agg in aggs for stage in stages}
    if info.is_main:
        torch.save(next(iter(runs.values())) if len(runs) == 1 else runs, out)
    shutdown(info)
    return 0


def update(info, agg: str, engine: str, stage) -> dict:
    """One update of the tiny policy from its seeded start: the full parameters and the update's metrics."""
    lm = tiny_lm()
    batch, prompts, reward = whole_batch()
    if info.distributed:  # rank r takes groups 2r, 2r+1 (trajectories 4r..4r+3)
        idx = torch.arange(4 * info.rank, 4 * info.rank + 4)
        batch, prompts, reward = select(batch, idx), [prompts[i] for i in idx], reward[idx]
    policy = _engine(PolicyModel(lm), info, engine, stage)
    cfg_loss = LossConfig(agg_mode=agg, kl_coef=0.0)
    max_over = (lambda n: n) if not info.distributed else _max_over
    old, _ = forward_logprobs(policy, prompts, batch, "cpu", 24, max_over_ranks=max_over)
    credit = compute_advantages("grpo", CreditInputs.from_batch(batch, reward), CreditConfig())
    optim = OptimConfig(micro_batch_tokens=24, ppo_epochs=int(os.environ.get("EPOCHS", "1")), grad_clip=100.0)
    m = ppo_update(policy, UpdateData(prompts, batch, credit, old), cfg_loss, optim, "cpu",
                   dp_size=info.world_size, reduce=lambda t: all_reduce_sum(t, info), max_over_ranks=max_over,
                   groups_per_mini=4 // info.world_size)  # the whole batch is one mini-batch
    return {"params": {k: v.clone() for k, v in policy.full_state()}, "metrics": m}


def _sgd(params):
    # SGD with lr 1: the parameter change is the gradient itself, compared to 1e-6.
    return torch.optim.SGD(params, lr=1.0)


def _engine(module, info, kind: str, stage):
    if kind == "fsdp2":
        model = wrap_fsdp2(module, info)
        return FSDP2Engine(model, _sgd(model.parameters()))
    from fastcredit.distributed.deepspeed_engine import wrap_deepspeed

    engine = wrap_deepspeed(module, info, _sgd, zero_stage=stage, mixed_precision=False,
                            activation_checkpointing=True, grad_clip=100.0,
                            overrides={"zero_allow_untested_optimizer": True,  # SGD is not on ZeRO's list
                                       "zero_optimization": {"stage3_param_persistence_threshold": 0}})
    engine.offload()  # the colocation path (CPU to CPU here): the state must come back intact
    engine.reload()
    return engine


def _max_over(n: int) -> int:
    import torch.distributed as dist

    t = torch.tensor([n])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
