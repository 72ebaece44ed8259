"""Two gloo ranks under the GPU path's rules (FASTCREDIT_EMULATE_NCCL=1), checked in one torchrun launch.

    FASTCREDIT_EMULATE_NCCL=1 torchrun --standalone --nproc_per_node=2 tests/distributed/gpu_rules.py OUT.json

1. The world group is built as on GPUs (``cpu:gloo,cuda:nccl`` with gloo standing in for NCCL):
   the reductions over CPU tensors work; a group built as a bare NCCL one (``cuda:gloo``
   here) has no backend for CPU tensors, the failure a GPU run of a bare ``nccl`` group meets.
2. ``credit.whiten_advantages`` over ranks: each rank's share of the batch, whitened with
   ``sum_over_ranks``, equals the same trajectories' advantages whitened in one process.
3. A policy read from files is read on rank 0 only: rank 1 builds it on the meta device and
   FSDP2 (policy, reference, value model) and the HF engine's copy receive rank 0's weights
   and buffers.
Rank 0 writes what it found to OUT.json; the test reads it.
"""
import json
import sys

import torch
import torch.distributed as dist


def check_groups(info) -> dict:
    from fastcredit.distributed.process_group import all_reduce_sum, max_over_ranks, mean_over_ranks, serves

    out = {"backend": dist.get_backend_config(), "serves_cpu": serves("cpu"), "serves_cuda": serves("cuda")}
    out["max"] = max_over_ranks(info.rank + 5, info)
    out["mean"] = mean_over_ranks({"x": float(info.rank)}, info)["x"]
    # names only some ranks hold (a metric only some trajectories produce), and a rank with none
    out["uneven"] = mean_over_ranks({"x": float(info.rank), **({"a": 3.0} if info.rank == 0 else {})}, info)
    out["empty"] = mean_over_ranks({"y": 2.0} if info.rank == 1 else {}, info)
    out["sum"] = float(all_reduce_sum(torch.ones(1, dtype=torch.float64), info))
    bare_nccl = dist.new_group(backend="cuda:gloo")
    try:
        dist.all_reduce(torch.ones(1), group=bare_nccl)
        out["bare_nccl_cpu"] = "ok"
    except RuntimeError as exc:
        out["bare_nccl_cpu"] = str(exc)
    return out


def whole_batch():
    from fastcredit.rollout.trajectory import Turn, from_turns

    g = torch.Generator().manual_seed(3)
    trajs = []
    for _ in range(8):
        turns = [Turn(torch.randint(3, 64, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist(),
                      "search", [5, 6, 7]) for _ in range(int(torch.randint(1, 4, (1,), generator=g)))]
        trajs.append(turns + [Turn([9, 10, 11], "answer")])
    batch = from_turns(trajs, group_id=[b // 2 for b in range(8)])
    reward = torch.tensor([1.0, 0.0, 0.2, 1.0, 0.0, 0.0, 1.0, 0.8])
    values = torch.randn(batch.num_tokens, generator=g)
    f_S = torch.rand(batch.seg_traj_S.numel(), generator=g)
    return batch, reward, values, f_S


def check_whitening(info) -> dict:
    from fastcredit.credit import CreditInputs, compute_advantages
    from fastcredit.config.credit import CreditConfig
    from fastcredit.distributed.process_group import all_reduce_sum
    from fastcredit.rollout.trajectory import select

    batch, reward, values, f_S = whole_batch()
    mine = torch.arange(4 * info.rank, 4 * info.rank + 4)
    part = select(batch, mine)
    tok_mine = torch.cat([torch.arange(int(batch.cu_seqlens[b]), int(batch.cu_seqlens[b + 1])) for b in mine])
    seg_mine = torch.isin(batch.seg_traj_S, mine)
    out = {}
    cases = {"ppo_closed": ("ppo", {}), "ppo_scan": ("ppo", {"gamma": 0.99, "lam": 0.95}),
             "pica_turn": ("pica", {"pica": {"gae_level": "turn"}})}
    for name, (est, over) in cases.items():
        cfg = CreditConfig(whiten_advantages=True)
        for key, value in over.items():
            target = getattr(cfg, key)
            if isinstance(value, dict):
                for k, v in value.items():
                    setattr(target, k, v)
            else:
                setattr(cfg, key, value)
        extra = {"prm_f0_B": torch.full((8,), 0.5), "prm_f_S": f_S} if est == "pica" else {}
        whole = compute_advantages(est, CreditInputs.from_batch(batch, reward, values_N=values, **extra), cfg)
        extra_mine = {"prm_f0_B": torch.full((4,), 0.5), "prm_f_S": f_S[seg_mine]} if est == "pica" else {}
        share = compute_advantages(est, CreditInputs.from_batch(
            part, reward[mine], values_N=values[tok_mine], sum_over_ranks=lambda t: all_reduce_sum(t, info),
            **extra_mine), cfg)
        want = whole.token_advantages(batch.seg_id_N)[tok_mine]
        got = share.token_advantages(part.seg_id_N)
        local = compute_advantages(est, CreditInputs.from_batch(part, reward[mine], values_N=values[tok_mine],
                                                                **extra_mine), cfg).token_advantages(part.seg_id_N)
        out[name] = {"max_err": float((got - want).abs().max()), "local_err": float((local - want).abs().max())}
    return {k: max_over_ranks_dict(v, info) for k, v in out.items()}


def max_over_ranks_dict(d: dict, info) -> dict:
    t = torch.tensor([d[k] for k in sorted(d)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(sorted(d), t.tolist()))


def check_rank0_loading(info, folder: str) -> dict:
    from fastcredit.models.build import frozen_copy, load_policy, policy_config
    from fastcredit.models.packed import PolicyModel, ValueModel
    from fastcredit.rollout.engines.hf import HFEngine
    from fastcredit.trainer.roles import engine_start
    from fastcredit.config import TrainConfig
    from fastcredit.distributed.build import build_train_engine
    from fastcredit.distributed.engine import adamw
    from fastcredit.distributed.from_rank0 import has_meta
    from fastcredit.distributed.fsdp import FrozenModel, stream_full_state
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = TrainConfig()
    cfg.model.policy, cfg.distributed.engine, cfg.model.attn_impl = folder, "fsdp2", "sdpa"
    tok = AutoTokenizer.from_pretrained(folder)
    lm = load_policy(cfg, tok, info)
    out = {"meta_on_this_rank": has_meta(lm)}
    ref = FrozenModel(PolicyModel(frozen_copy(lm)), info)
    value = build_train_engine(ValueModel(frozen_copy(lm).requires_grad_(True)), info, cfg.distributed,
                               adamw(lr=1e-3), 1.0)
    config = policy_config(lm)
    policy = build_train_engine(PolicyModel(lm), info, cfg.distributed, adamw(lr=1e-3), 1.0)
    # the HF engine as the rollout side starts it (the policy's architecture, no weights of its own), filled by the
    # weight sync every rank joins: the full tensors gathered from the shards FSDP2 filled from rank 0
    engine = HFEngine(engine_start(cfg, info, config, tok, folder, info.rank).lm, tok, info.device)
    engine.update_weights(policy.full_state(engine.weight_dtype))
    engine_copy = engine.model
    truth = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).state_dict()
    errs = {"policy": 0.0, "reference": 0.0, "value": 0.0, "hf_engine": 0.0}
    for key, model in (("policy", policy.model.lm), ("reference", ref.module.lm), ("value", value.model.lm)):
        for name, t in stream_full_state(model):
            if name in truth:
                errs[key] = max(errs[key], float((t.float() - truth[name]).abs().max()))
    for name, t in engine_copy.state_dict().items():
        errs["hf_engine"] = max(errs["hf_engine"], float((t.float() - truth[name]).abs().max()))
    out["params"] = {key: len(list(m.parameters()))
                     for key, m in (("policy", policy.model), ("value", value.model),
                                    ("reference", ref.module), ("hf_engine", engine_copy))}
    out["tied"] = engine_copy.get_output_embeddings().weight is engine_copy.get_input_embeddings().weight
    buffers = {n: b for n, b in policy.model.named_buffers()}
    inv = [b for n, b in buffers.items() if n.endswith("inv_freq")]
    out["inv_freq"] = inv[0].tolist() if inv else None
    out["errors"] = errs
    metas = [None] * info.world_size
    dist.all_gather_object(metas, out)
    return {"ranks": metas}


def main(path: str, folder: str) -> None:
    from fastcredit.distributed.process_group import init_distributed, shutdown

    info = init_distributed("auto")
    result = {"groups": check_groups(info), "whitening": check_whitening(info),
              "rank0_loading": check_rank0_loading(info, folder)}
    if info.is_main:
        with open(path, "w") as f:
            json.dump(result, f)
    shutdown(info)


if __name__ == "__main__":
    from fastcredit.distributed.process_group import exit_process

    main(sys.argv[1], sys.argv[2])
    exit_process(0)
