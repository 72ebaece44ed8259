"""The GPU memory plan: what each phase of a step holds on one GPU, before anything loads.

    plan = memory.plan(load_config("configs/criticsearch.yaml"), gpu_gib=80, gpus=8, host_gib=1024)
    plan = plan_for(cfg, 80, 8, offload)   # with the training state's placement given (memory.offload decides it)

Units: bytes inside, GiB (2**30 bytes) in the report. P: policy parameters; L layers, H hidden,
I intermediate, V vocabulary, KV = kv_heads x head_dim; W: GPUs (one rank each); S: the FSDP
shard group (distributed.shard_size, else W); TP: rollout.tensor_parallel; T: optim.micro_batch_tokens.

Each GPU takes turns (``fastcredit.distributed.colocate``); a phase holds what is resident
(CUDA context and workspaces, the retrieval index, its query encoder and search workspace)
plus:

* rollout: the vLLM engine's share, gpu_memory_utilization x GPU, of which the policy's
  bf16 weights are 2P/TP bytes, vLLM's activations and CUDA graphs about 2 GiB, and the rest
  KV cache at 2 x L x KV x 2 bytes a token (K and V, bf16). The training state is on the CPU.
  A step asks for (batch_prompts / W) x n_samples sequences x (data.max_prompt_tokens +
  rollout.max_response_tokens) tokens; vLLM queues what does not fit (slower, fine), but a
  cache below one such max-context sequence cannot run at all (the one hard KV error).
* judge: the same engine and KV cache with a frozen critic's bf16 weights switched in (only
  a critic of the policy's architecture; any other is served over HTTP, elsewhere).
* train: engines asleep (level 2: no weights, no KV; a residue of about 0.5 GiB); per model
  trained 16 bytes a parameter sharded over S (fp32 master 4, fp32 grads 4, AdamW moments
  8), none with distributed.cpu_offload; bf16 all-gather buffers of two decoder layers plus
  the root's unsharded parameters (embeddings, LM head, final norm); activations with
  checkpointing: L x T x H x 2 (each layer's input) + 2 x T x (8H + 2KV + 4I) x 2 (one layer
  recomputed, with its gradients) + T x H x 8 (the final hidden state and its gradient in
  fp32; the fused LM-head log-prob never builds [T, V] logits); a reference model (loss.kl_coef
  or credit.kl_in_reward) 2P/S for its log-prob pass; a value model (ppo, pica) the policy's
  backbone with a scalar head, 16 bytes a parameter over S.
* weight sync: the engine's weights woken (2P/TP) while the training state is still on the
  GPU, plus the largest tensor gathered in fp32 and cast to bf16 (V x H x 6).

The index and the vLLM share: ``fastcredit.trainer.memory.retrieval`` and ``fastcredit.trainer.memory.vllm_share``.
distributed.colocate=false: nothing sleeps or moves, so the training state sits beside the
engine in every phase. A training state that stays on the GPU (``fastcredit.trainer.memory.offload`` decides:
distributed.offload_state false, or auto when this plan with it kept fits): the engines sleep, but the training
state and the reference sit beside the engine the same way, and the HF engine keeps its weights on the GPU
through training; with auto and vLLM's automatic share the share leaves the decision's margin free. Host RAM per
node: ``fastcredit.trainer.memory.host``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from fastcredit.trainer.memory import host
from fastcredit.trainer.memory.parts import (JudgeSetup, OffloadChoice, judge_setup, reference_bytes, shard_group,
                                             training_state_bytes, uses_reference, zero2_bytes)
from fastcredit.trainer.memory.retrieval import (IndexSize, encoder_size, index_bytes_per_rank, index_size,
                                                 token_store_bytes, token_store_fits_gpu)
from fastcredit.trainer.memory.shapes import ModelShape, kv_bytes_per_token, lookup_shape
from fastcredit.trainer.memory.units import GIB, gib_text, tokens_text
from fastcredit.trainer.memory.vllm_share import (MemoryBudgetError, auto_share, check_fixed_utilization,
                                          engine_memory_utilization)

CONTEXT_BYTES = GIB              # CUDA context, cuBLAS / NCCL workspaces (estimate)
VLLM_OVERHEAD_BYTES = 2 * GIB    # vLLM's profiled activation peak and CUDA graphs (estimate)
ASLEEP_BYTES = GIB // 2          # what a sleeping vLLM engine keeps (graph pools, buffers; estimate)
SEARCH_BYTES = 2 * (1 << 27) * 2  # TorchFlatIndex: 2**27 fp16 scores at once and their top-k

LABELS = {
    "context": "CUDA context, workspaces (est.)", "index": "retrieval index", "encoder": "query encoder (bf16)",
    "search": "index search workspace", "tokens": "passage token store", "weights": "engine weights (bf16)",
    "vllm": "vLLM activations, graphs (est.)", "kv": "KV cache", "asleep": "asleep engine residue (est.)",
    "policy_engine": "policy's HF engine, kept (bf16)",
    "policy": "policy fp32 params+grads+Adam", "value": "value fp32 params+grads+Adam",
    "reference": "reference bf16 shard", "zero2": "ZeRO-2 bf16 params (replicated)",
    "gather": "FSDP all-gather buffers", "activations": "activations", "stream": "weight-sync streaming buffer",
}
PHASES = ("rollout", "judge", "train", "sync")
ADVICE = {
    "rollout": "lower rollout.gpu_memory_utilization, split the index over the ranks (retrieval.across_ranks="
               "shard) or take it off the GPU (retrieval.device=cpu, index_type=hnsw/ivfpq or backend=http)",
    "judge": "use a smaller critic or serve it over HTTP (judges.backend=http)",
    "train": "shard over more GPUs, enable distributed.cpu_offload or lower optim.micro_batch_tokens",
    "sync": "shard over more GPUs or enable distributed.cpu_offload",
}


@dataclass
class MemoryPlan:
    """Bytes per GPU for each phase's components; ``problems`` in plain words, ``hard`` those that stop a run;
    ``host``: host RAM per node (:class:`fastcredit.trainer.memory.host.HostPlan`)."""
    gpu_gib: float
    gpus: int
    shape: ModelShape
    phases: dict = field(default_factory=dict)      # phase -> {component: bytes}
    utilization: Optional[float] = None             # vLLM's share (auto or fixed); None for the HF engine
    kv_tokens: int = 0                              # tokens the rollout's KV cache holds
    kv_tokens_step: int = 0                         # concurrent sequences x max context
    max_context: int = 0
    notes: list = field(default_factory=list)
    problems: list = field(default_factory=list)
    hard: list = field(default_factory=list)
    title: str = ""
    host: Optional[host.HostPlan] = None
    offload: Optional[OffloadChoice] = None         # what distributed.offload_state comes to on this GPU

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def ok(self) -> bool:
        return not self.hard

    def add_problem(self, text: str, hard: bool = True) -> None:
        self.problems.append(text)
        if hard:
            self.hard.append(text)


def local_index(rcfg, rows: Optional[int], dim: Optional[int]) -> Optional[IndexSize]:
    """The in-process index's size; None when retrieval is a server elsewhere."""
    return index_size(rcfg, rows, dim) if rcfg.backend == "local" else None


def _index_note(rcfg, gpus: int, idx: IndexSize, split: bool, each: int) -> str:
    shards = gpus if rcfg.num_shards <= 0 else rcfg.num_shards
    where = "on its own GPU" if shards == 1 else f"over {shards} GPUs from its own"
    who = "the process holds it" if gpus == 1 else f"each of the {gpus} ranks holds its own copy"
    if split:
        how = f"split over the {gpus} ranks (retrieval.across_ranks=shard)"
    else:
        how = f"{who} {where} (retrieval.num_shards={rcfg.num_shards})"
    return f"{how}: {gib_text(each)} GiB per {'GPU' if idx.on_gpu else 'rank, in CPU memory'}"


def resident_bytes(cfg, gpus: int, plan: MemoryPlan, idx: Optional[IndexSize]) -> dict:
    """What every phase holds on a GPU: the CUDA context, and a local index, its search workspace, the query
    encoder and the token store when they live on the GPU. Notes and problems go to ``plan``."""
    rcfg = cfg.retrieval
    resident = {"context": CONTEXT_BYTES}
    if idx is None:
        plan.notes.append(f"retrieval: a /retrieve server at {rcfg.url} (nothing on these GPUs)")
        return resident
    shards = gpus if rcfg.num_shards <= 0 else rcfg.num_shards
    split = rcfg.across_ranks == "shard" and gpus > 1
    if split and rcfg.index_type == "hnsw":
        plan.add_problem("retrieval.index_type=hnsw cannot be split across ranks: set "
                         "retrieval.across_ranks=replicate")
    desc = f"{rcfg.index_type}, {idx.rows:,} x {idx.dim} ({idx.source}), {gib_text(idx.total_bytes)} GiB whole"
    if not idx.rows:
        plan.notes.append(f"index: {idx.source}: not counted")
    elif split or idx.on_gpu:
        each = index_bytes_per_rank(idx, gpus, split, shards)
        if idx.on_gpu:
            resident.update({"index": each, "search": SEARCH_BYTES})
        plan.notes.append(f"index: {desc}; {_index_note(rcfg, gpus, idx, split, each)}")
    else:
        plan.notes.append(f"index: {desc}; held in CPU memory")
    if rcfg.device != "cpu":
        resident["encoder"] = encoder_size(rcfg.encoder)[0] * 2
        if token_store_fits_gpu(idx.rows):
            resident["tokens"] = token_store_bytes(idx.rows)
    return resident


def activation_bytes(shape: ModelShape, dcfg, tokens: int) -> int:
    """Activations of one micro-batch of ``tokens`` in the compute dtype (see the module docstring)."""
    width = 2 if dcfg.mixed_precision else 4
    hidden, kv_width = shape.hidden, shape.kv_heads * shape.head_dim
    layer_work = tokens * (8 * hidden + 2 * kv_width + 4 * shape.intermediate) * width
    if dcfg.activation_checkpointing:
        return shape.layers * tokens * hidden * width + 2 * layer_work + tokens * hidden * 8
    return (shape.layers + 1) * layer_work + tokens * hidden * 8


def gather_bytes(shape: ModelShape, dcfg) -> int:
    """FSDP's all-gather buffers in the compute dtype: two decoder layers and the root's own parameters
    (embeddings, LM head, final norm); none under ZeRO-2, whose bf16 parameters are whole already."""
    if zero2_bytes(dcfg, shape):
        return 0
    root = shape.params - shape.layers * shape.layer_params()
    return (2 * shape.layer_params() + root) * (2 if dcfg.mixed_precision else 4)


def gpu_training_state(cfg, shape: ModelShape, shard: int) -> dict:
    """The trained models' state on a GPU in the train phase: 16P/S each, none under distributed.cpu_offload;
    ZeRO-2's replicated bf16 parameters stay there either way."""
    dcfg = cfg.distributed
    full = training_state_bytes(cfg, shape, shard)
    state = {"policy": 0 if dcfg.cpu_offload else full["policy"]}
    if zero2_bytes(dcfg, shape):
        state["zero2"] = zero2_bytes(dcfg, shape)
    if "value" in full:
        state["value"] = 0 if dcfg.cpu_offload else full["value"]
    return state


def rollout_engine(plan: MemoryPlan, cfg, shape: ModelShape, free: int, total: int) -> dict:
    """The rollout engine's bytes on a GPU: vLLM's share (auto of ``free``, or fixed) or the HF engine's whole KV
    cache. Sets the plan's utilization and KV token counts; a share that cannot start is a problem."""
    rollout = cfg.rollout
    tensor_parallel = max(1, rollout.tensor_parallel)
    weights, kv_token = shape.params * 2 // tensor_parallel, kv_bytes_per_token(shape, tensor_parallel)
    plan.max_context = cfg.data.max_prompt_tokens + rollout.max_response_tokens
    plan.kv_tokens_step = math.ceil(cfg.optim.batch_prompts / plan.gpus) * rollout.n_samples * plan.max_context
    if rollout.engine != "vllm":
        kv = plan.kv_tokens_step * kv_token  # the HF engine holds every sequence's cache at once
        plan.kv_tokens = kv // kv_token
        return {"weights": weights, "kv": kv}
    margin = int(rollout.memory_margin_gib * GIB)
    try:
        if rollout.gpu_memory_utilization > 0:
            plan.utilization = rollout.gpu_memory_utilization
            check_fixed_utilization(plan.utilization, free, total)
        else:
            plan.utilization = max(0.0, auto_share(free, total, margin))
            engine_memory_utilization(free, total, margin, weights + VLLM_OVERHEAD_BYTES,
                                      plan.max_context * kv_token)
    except MemoryBudgetError as exc:
        plan.add_problem(f"rollout: {exc}")
    kv = max(0, int(plan.utilization * total) - weights - VLLM_OVERHEAD_BYTES)
    plan.kv_tokens = kv // kv_token
    return {"weights": weights, "vllm": VLLM_OVERHEAD_BYTES, "kv": kv}


def check_kv_cache(plan: MemoryPlan, sequences: int) -> None:
    """A KV cache below one max-context sequence cannot run; below a step's sequences vLLM queues."""
    if plan.kv_tokens < plan.max_context and not plan.hard:
        plan.add_problem(f"rollout: the KV cache left holds {tokens_text(plan.kv_tokens)} tokens, below the max "
                         f"context {tokens_text(plan.max_context)} (data.max_prompt_tokens + "
                         "rollout.max_response_tokens): vLLM cannot run one sequence; free GPU memory or shorten "
                         "the context")
    elif plan.kv_tokens < plan.kv_tokens_step:
        plan.add_problem(f"rollout: the KV cache holds {tokens_text(plan.kv_tokens)} tokens, a step asks for "
                         f"{tokens_text(plan.kv_tokens_step)} ({sequences} sequences x "
                         f"{tokens_text(plan.max_context)}): vLLM will queue (fine, slower)", hard=False)


def add_judge_phase(plan: MemoryPlan, cfg, judge: JudgeSetup, beside: dict, engine: dict) -> None:
    """The judge phase: the critic's weights in the rollout engine (``beside``: what else is on the GPU)."""
    judges = cfg.judges
    if judge.mode == "refused":
        plan.add_problem(f"judge: judges.model={judges.model}: {judge.why}, so it cannot share the policy's vLLM "
                         "engine; serve it in its own process and set judges.backend=http")
    elif judge.mode:
        tensor_parallel = max(1, cfg.rollout.tensor_parallel)
        plan.phases["judge"] = {**beside, **engine, "weights": judge.critic.params * 2 // tensor_parallel}
        where = "an HF engine of its own" if judge.mode == "own" else "the policy's engine and KV cache"
        plan.notes.append(f"judge: {judge.critic.name if judges.model else 'the policy itself'} in {where}")
    elif judges.backend == "http":
        plan.notes.append(f"judge: served over HTTP at {judges.url} (nothing on these GPUs)")


def _title(cfg, shape: ModelShape, gpu_gib: float, gpus: int, shard: int) -> str:
    count = f"{shape.params / 1e9:.2f}B" if shape.params >= 1e9 else f"{shape.params / 1e6:.1f}M"
    return (f"{cfg.run_name}: policy {shape.name} ({count} params), {gpus} GPU(s) x {gpu_gib:g} GiB, "
            f"{cfg.distributed.engine} sharded over {shard}, micro-batch {cfg.optim.micro_batch_tokens} tokens")


def asleep_engine(cfg, engine: dict, moves: bool) -> dict:
    """What the rollout engine leaves on the GPU while the update trains: a sleeping vLLM's residue; the HF
    engine's weights when the training state stays (nothing when it moves, its model goes to the host too);
    everything without colocation."""
    if not cfg.distributed.colocate:
        return engine  # nothing sleeps
    if cfg.rollout.engine == "vllm":
        return {"asleep": ASLEEP_BYTES}
    return {} if moves else {"weights": engine["weights"]}


def plan_for(cfg, gpu_gib: float, gpus: int, offload: OffloadChoice, shape: Optional[ModelShape] = None,
             index_rows: Optional[int] = None, index_dim: Optional[int] = None, host_gib: Optional[float] = None,
             gpus_per_node: Optional[int] = None, host_source: str = "--host-gib") -> MemoryPlan:
    """:func:`fastcredit.trainer.memory.plan` with the training state's placement given: ``offload`` (whether it
    moves, and the margin kept beside vLLM's share when it stays); in the plan's ``offload`` and notes."""
    dcfg = cfg.distributed
    shape = shape or lookup_shape(cfg.model.policy, "model.policy", cfg.model)
    shard = shard_group(dcfg, gpus)
    result = MemoryPlan(gpu_gib, gpus, shape, title=_title(cfg, shape, gpu_gib, gpus, shard), offload=offload)
    total = int(gpu_gib * GIB)
    idx = local_index(cfg.retrieval, index_rows, index_dim)
    resident = resident_bytes(cfg, gpus, result, idx)
    state = gpu_training_state(cfg, shape, shard)
    reference = {"reference": reference_bytes(cfg, shape, shard)} if uses_reference(cfg) else {}
    moves = offload.moves
    stays = {} if moves else {**state, **reference}
    free = total - sum(resident.values()) - sum(stays.values()) - offload.reserve_bytes
    engine = rollout_engine(result, cfg, shape, free, total)
    result.phases["rollout"] = {**resident, **stays, **engine}
    check_kv_cache(result, math.ceil(cfg.optim.batch_prompts / gpus) * cfg.rollout.n_samples)
    judge = judge_setup(cfg, shape)
    beside = {**resident, **stays}
    if judge.mode == "own" and not moves and cfg.rollout.engine == "hf":  # the policy's engine stays awake beside it
        beside["policy_engine"] = engine["weights"]
    add_judge_phase(result, cfg, judge, beside, engine)
    asleep = asleep_engine(cfg, engine, moves)
    result.phases["train"] = {**resident, **asleep, **state, **reference, "gather": gather_bytes(shape, dcfg),
                              "activations": activation_bytes(shape, dcfg, cfg.optim.micro_batch_tokens)}
    # weight sync: engine weights woken while the training state is still on the GPU
    result.phases["sync"] = {**resident, **asleep, **state, **({} if moves else reference),
                             "weights": engine["weights"], "stream": shape.vocab * shape.hidden * 6}
    if not dcfg.colocate:
        result.notes.append("distributed.colocate=false: nothing sleeps, the training state stays beside the engine")
    else:
        result.notes.append(offload.line())
    for phase in PHASES:
        if phase in result.phases and result.total(phase) > total:
            result.add_problem(f"{phase} phase needs {gib_text(result.total(phase))} GiB of a {gpu_gib:g} GiB GPU: "
                               f"{ADVICE[phase]}")
    result.host = host.host_plan(cfg, shape, gpus, [p for p in PHASES if p in result.phases], idx, judge, moves,
                                 host_gib, gpus_per_node, host_source)
    for text in host.host_problems(result.host):
        result.add_problem(text)
    return result
