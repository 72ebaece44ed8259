"""The GPU memory budget of a run: what each phase of a step holds on one GPU, before anything loads.

    plan = memory.plan(load_config("configs/criticsearch.yaml"), gpu_gib=80, gpus=8)
    print(memory.format_plan(plan))                  # python -m fastcredit.train ... --memory-report
    util = memory.engine_memory_utilization(free, total, margin, weight_bytes, min_kv_bytes)

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

The index: flat (and torch) on a GPU N x dim x 2 bytes (fp16); IVF-PQ N x (code + 8-byte id) + centroids
+ codebooks and HNSW stay in CPU memory. Under torchrun, retrieval.across_ranks=shard: a rank holds
ceil(N / W) rows (IVF-PQ: and the whole centroids and codebooks); replicate: each rank holds a copy
over retrieval.num_shards GPUs from its own, so each GPU carries index x min(shards, W) / shards.

vLLM's share with gpu_memory_utilization=0 (auto) is (free - margin) / total rounded down to
0.01, free being measured with the training state offloaded (here: GPU - resident); a fixed
share above what is free makes vLLM refuse to start. distributed.colocate=false: nothing
sleeps or moves, so the training state sits beside the engine in every phase.
"""
from __future__ import annotations

import glob
import json
import math
import os
import struct
from dataclasses import dataclass, field, replace
from typing import Optional

GIB = 2 ** 30
CONTEXT_BYTES = GIB              # CUDA context, cuBLAS / NCCL workspaces (estimate)
VLLM_OVERHEAD_BYTES = 2 * GIB    # vLLM's profiled activation peak and CUDA graphs (estimate)
ASLEEP_BYTES = GIB // 2          # what a sleeping vLLM engine keeps (graph pools, buffers; estimate)
SEARCH_BYTES = 2 * (1 << 27) * 2  # TorchFlatIndex: 2**27 fp16 scores at once and their top-k
TOKEN_STORE_GPU_CAP = 4 << 30    # open_retriever's max_gpu_token_bytes
TOKENS_PER_PASSAGE = 140         # a 100-word wiki-18 passage, for a token store not yet built
WIKI18_E5 = (21_015_324, 768)    # Search-R1's e5_Flat.index over wiki-18


class MemoryBudgetError(ValueError):
    """The GPU cannot hold what vLLM needs; the message gives the numbers in GiB."""


class ShapeError(ValueError):
    """A config's model key names neither a folder with config.json nor a preset."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder's size. ``params`` is exact (from safetensors headers or the public count)."""
    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = True   # Qwen2 has q/k/v biases, Llama and Qwen3 do not
    qk_norm: bool = False   # Qwen3's per-head q/k RMSNorm
    name: str = ""

    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention, SwiGLU MLP, two RMSNorms)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 3 * h * self.intermediate + 2 * h + (2 * self.head_dim if self.qk_norm else 0)

    def formula_params(self) -> int:
        """L x layer + embeddings (+ an untied LM head) + final norm."""
        return self.layers * self.layer_params() + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @classmethod
    def from_folder(cls, path: str) -> "ModelShape":
        """From a HF folder's ``config.json``; ``params`` summed from ``*.safetensors`` headers
        (8-byte little-endian length, then the JSON header; the tensors are never read), else the formula."""
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            c = json.load(fh)
        c = c.get("text_config", c)
        hidden, heads = c["hidden_size"], c["num_attention_heads"]
        mt = c.get("model_type", "")
        shape = cls(params=0, layers=c["num_hidden_layers"], hidden=hidden, heads=heads,
                    kv_heads=c.get("num_key_value_heads") or heads, head_dim=c.get("head_dim") or hidden // heads,
                    intermediate=c["intermediate_size"], vocab=c["vocab_size"],
                    tied=bool(c.get("tie_word_embeddings", True)), qkv_bias=bool(c.get("attention_bias", mt == "qwen2")),
                    qk_norm=mt.startswith("qwen3"), name=os.path.basename(os.path.normpath(path)))
        return replace(shape, params=safetensors_params(path) or shape.formula_params())


def safetensors_params(folder: str) -> int:
    """Parameters in a folder's ``*.safetensors`` files, from their headers alone (0 when there are none)."""
    total = 0
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


def _preset(name, params, layers, hidden, heads, kv, inter, vocab, tied, head_dim=128, bias=True, qk_norm=False):
    return ModelShape(params, layers, hidden, heads, kv, head_dim, inter, vocab, tied, bias, qk_norm, name)


# The public config.json values (Hugging Face model cards); params are the exact counts,
# which ModelShape.formula_params reproduces.
PRESETS = {p.name.lower(): p for p in (
    _preset("Qwen2.5-0.5B", 494_032_768, 24, 896, 14, 2, 4864, 151936, True, head_dim=64),
    _preset("Qwen2.5-1.5B", 1_543_714_304, 28, 1536, 12, 2, 8960, 151936, True),
    _preset("Qwen2.5-3B", 3_085_938_688, 36, 2048, 16, 2, 11008, 151936, True),
    _preset("Qwen2.5-7B", 7_615_616_512, 28, 3584, 28, 4, 18944, 152064, False),
    _preset("Qwen2.5-14B", 14_770_033_664, 48, 5120, 40, 8, 13824, 152064, False),
    _preset("Qwen3-8B", 8_190_735_360, 36, 4096, 32, 8, 12288, 151936, False, bias=False, qk_norm=True),
    _preset("SmolLM2-135M", 134_515_008, 30, 576, 9, 3, 1536, 49152, True, head_dim=64, bias=False),
)}


def tiny_shape(mcfg) -> ModelShape:
    """The ``tiny`` policy of ``fastcredit.models.tiny`` (model.tiny_*; MLP 2H and MHA unless set; tied)."""
    h, n = mcfg.tiny_hidden, mcfg.tiny_heads
    s = ModelShape(0, mcfg.tiny_layers, h, n, mcfg.tiny_kv_heads or n, h // n, mcfg.tiny_intermediate or 2 * h,
                   max(mcfg.tiny_vocab, mcfg.tiny_vocab_rows), True, name="tiny")
    return replace(s, params=s.formula_params())


def lookup_shape(value: str, key: str, mcfg=None) -> ModelShape:
    """A config value (``key`` names it for errors): 'tiny', 'smollm2', a folder with config.json, or a
    name whose basename is a preset (case-insensitive; an ``-Instruct`` suffix has its base's shape)."""
    if value == "tiny" and mcfg is not None:
        return tiny_shape(mcfg)
    if value == "smollm2":
        return PRESETS["smollm2-135m"]
    if os.path.isfile(os.path.join(value, "config.json")):
        return ModelShape.from_folder(value)
    base = os.path.basename(os.path.normpath(value)).lower()
    for name in (base, base.removesuffix("-instruct")):
        if name in PRESETS:
            return replace(PRESETS[name], name=os.path.basename(os.path.normpath(value)))
    raise ShapeError(f"{key}={value!r}: not a folder with config.json here, and its name is none of the presets "
                     f"({', '.join(p.name for p in PRESETS.values())}); run the report where the folder exists")


def kv_bytes_per_token(shape: ModelShape, tensor_parallel: int = 1) -> int:
    """K and V of every layer in bf16: 2 x L x kv_heads x head_dim x 2 bytes (per TP rank)."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * 2 // max(1, tensor_parallel)


# ---------------------------------------------------------------- retrieval


def index_header(path: str) -> Optional[tuple[int, int]]:
    """(rows, dim) from a FAISS index file's header, or from a fastcredit build folder's index; None if absent."""
    from fastcredit.retrieval.files import FAISS_HEADER_BYTES, faiss_header, read_build_info

    try:
        path = read_build_info(path)[1] if path and os.path.exists(path) else ""
    except FileNotFoundError:  # a folder that is not a fastcredit build
        return None
    if not os.path.isfile(path) or os.path.getsize(path) < FAISS_HEADER_BYTES:
        return None
    with open(path, "rb") as fh:
        _, dim, rows = faiss_header(fh.read(FAISS_HEADER_BYTES))
    return rows, dim


# (params, dim) of known query encoders: all-MiniLM-L6-v2 and E5 base / large (BERT).
ENCODERS = {"minilm": (22_713_216, 384), "e5-base": (109_482_240, 768), "e5-large": (335_141_888, 1024)}


def encoder_size(name: str) -> tuple[int, int, str]:
    """(params, dim, source) of a query encoder: a folder's headers / config.json, else a known name."""
    cfg_path = os.path.join(name, "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as fh:
            c = json.load(fh)
        h, i, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
        emb = (c["vocab_size"] + c.get("max_position_embeddings", 512) + c.get("type_vocab_size", 2)) * h + 2 * h
        bert = emb + n * (4 * h * h + 4 * h + 2 * h * i + i + h + 4 * h) + h * h + h
        return safetensors_params(name) or bert, h, "folder"
    base = os.path.basename(os.path.normpath(name)).lower()
    for key, (params, dim) in ENCODERS.items():
        if key in base:
            return params, dim, "known"
    return ENCODERS["e5-base"][0], ENCODERS["e5-base"][1], "assumed BERT-base"


@dataclass
class IndexSize:
    rows: int
    dim: int
    total_bytes: int     # the whole index
    on_gpu: bool
    source: str          # where rows / dim came from
    shared_bytes: int = 0  # what every shard holds whole: IVF centroids and PQ codebooks


def index_size(rcfg, rows: Optional[int] = None, dim: Optional[int] = None) -> IndexSize:
    """The retrieval index: rows / dim from the overrides, the file's header, or the wiki-18 e5 default."""
    source = "--index-rows/--index-dim"
    if rows is None or dim is None:
        found = index_header(rcfg.index)
        names = f"{rcfg.corpus or ''} {rcfg.index or ''}".lower()
        if found:
            source = f"header of {rcfg.index}"
        elif "wiki-18" in names or "e5_flat" in names:
            found, source = WIKI18_E5, "wiki-18 e5 default: the file is not here"
        else:
            found = (0, encoder_size(rcfg.encoder)[1])
            source = "size unknown (a toy or unbuilt corpus; pass --index-rows and --index-dim)"
        rows, dim = rows if rows is not None else found[0], dim if dim is not None else found[1]
    gpu = rcfg.backend == "local" and rcfg.device != "cpu"
    if rcfg.index_type in ("flat", "torch"):
        return IndexSize(rows, dim, rows * dim * (2 if gpu else 4), gpu, source)
    if rcfg.index_type == "ivfpq" and rows:
        from fastcredit.retrieval.indexes import factory_string

        ivf, pq = factory_string("ivfpq", rows, dim).split(",")
        nlist, (m, bits) = int(ivf[3:]), map(int, pq[2:].split("x"))
        shared = nlist * dim * 4 + (2 ** bits) * dim * 4
        return IndexSize(rows, dim, rows * (math.ceil(m * bits / 8) + 8) + shared, False, source, shared)
    return IndexSize(rows, dim, rows * dim * 4, False, source)  # hnsw: vectors; the graph is extra, on the CPU


# ---------------------------------------------------------------- vLLM's share


def _auto_share(free_bytes: float, total_bytes: float, margin_bytes: float) -> float:
    return math.floor((free_bytes - margin_bytes) / total_bytes * 100 + 1e-9) / 100


def engine_memory_utilization(free_bytes: float, total_bytes: float, margin_bytes: float, weight_bytes: float,
                              min_kv_bytes: float) -> float:
    """rollout.gpu_memory_utilization=0: ``(free - margin) / total`` rounded down to 0.01.

    Raises MemoryBudgetError when that share cannot hold the weights and ``min_kv_bytes``
    (the KV cache of one sequence at the longest context)."""
    util = _auto_share(free_bytes, total_bytes, margin_bytes)
    need = weight_bytes + min_kv_bytes
    if util <= 0 or util * total_bytes < need:
        raise MemoryBudgetError(
            f"vLLM would get {max(util, 0):.2f} x {total_bytes / GIB:.1f} GiB = {max(util, 0) * total_bytes / GIB:.1f} GiB "
            f"({free_bytes / GIB:.1f} GiB free minus a {margin_bytes / GIB:.1f} GiB margin), but its weights "
            f"({weight_bytes / GIB:.1f} GiB) and the KV cache of one longest sequence ({min_kv_bytes / GIB:.2f} GiB) "
            f"need {need / GIB:.1f} GiB: free GPU memory (retrieval index off the GPU, more GPUs) or lower "
            "rollout.memory_margin_gib")
    return util


def check_fixed_utilization(util: float, free_bytes: float, total_bytes: float) -> None:
    """A fixed rollout.gpu_memory_utilization asks for ``util x total``; vLLM v1 refuses to start when that is
    more than is free. Raises MemoryBudgetError saying so in GiB."""
    if util * total_bytes > free_bytes:
        raise MemoryBudgetError(
            f"rollout.gpu_memory_utilization={util:g} asks vLLM for {util * total_bytes / GIB:.1f} GiB of the "
            f"{total_bytes / GIB:.1f} GiB GPU, but only {free_bytes / GIB:.1f} GiB are free: lower it, or set it to 0 "
            f"(auto: {max(0.0, _auto_share(free_bytes, total_bytes, 0)):.2f} minus rollout.memory_margin_gib)")


# ---------------------------------------------------------------- the plan


LABELS = {
    "context": "CUDA context, workspaces (est.)", "index": "retrieval index", "encoder": "query encoder (bf16)",
    "search": "index search workspace", "tokens": "passage token store", "weights": "engine weights (bf16)",
    "vllm": "vLLM activations, graphs (est.)", "kv": "KV cache", "asleep": "asleep engine residue (est.)",
    "policy": "policy fp32 params+grads+Adam", "value": "value fp32 params+grads+Adam", "reference": "reference bf16 shard",
    "zero2": "ZeRO-2 bf16 params (replicated)", "gather": "FSDP all-gather buffers", "activations": "activations",
    "stream": "weight-sync streaming buffer",
}
PHASES = ("rollout", "judge", "train", "sync")


@dataclass
class MemoryPlan:
    """Bytes per GPU for each phase's components; ``problems`` in plain words, ``hard`` those that stop a run."""
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

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def ok(self) -> bool:
        return not self.hard

    def _problem(self, text: str, hard: bool = True) -> None:
        self.problems.append(text)
        if hard:
            self.hard.append(text)


def _gib(b: float) -> str:
    return f"{b / GIB:.1f}"


def _tokens(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else f"{int(n)}"


def _resident(cfg, gpus: int, plan: MemoryPlan, index_rows, index_dim) -> dict:
    r = cfg.retrieval
    out = {"context": CONTEXT_BYTES}
    if r.backend != "local":
        plan.notes.append(f"retrieval: a /retrieve server at {r.url} (nothing on these GPUs)")
        return out
    idx = index_size(r, index_rows, index_dim)
    shards = gpus if r.num_shards <= 0 else r.num_shards
    split = r.across_ranks == "shard" and gpus > 1
    if split and r.index_type == "hnsw":
        plan._problem("retrieval.index_type=hnsw cannot be split across ranks: set retrieval.across_ranks=replicate")
    desc = f"{r.index_type}, {idx.rows:,} x {idx.dim} ({idx.source}), {_gib(idx.total_bytes)} GiB whole"
    if not idx.rows:
        plan.notes.append(f"index: {idx.source}: not counted")
    elif split or idx.on_gpu:
        per_row = (idx.total_bytes - idx.shared_bytes) // idx.rows  # split: the largest share, ceil(N / W) rows
        each = idx.shared_bytes + -(-idx.rows // gpus) * per_row if split else idx.total_bytes * min(shards, gpus) // shards
        out.update({"index": each, "search": SEARCH_BYTES} if idx.on_gpu else {})
        where = "on its own GPU" if shards == 1 else f"over {shards} GPUs from its own"
        who = "the process holds it" if gpus == 1 else f"each of the {gpus} ranks holds its own copy"
        how = f"split over the {gpus} ranks (retrieval.across_ranks=shard)" if split else \
            f"{who} {where} (retrieval.num_shards={r.num_shards})"
        plan.notes.append(f"index: {desc}; {how}: {_gib(each)} GiB per {'GPU' if idx.on_gpu else 'rank, in CPU memory'}")
    else:
        plan.notes.append(f"index: {desc}; held in CPU memory")
    if r.device != "cpu":
        out["encoder"] = encoder_size(r.encoder)[0] * 2
        store = idx.rows * TOKENS_PER_PASSAGE * 4
        if 0 < store <= TOKEN_STORE_GPU_CAP:
            out["tokens"] = store + 8 * (idx.rows + 1)
    return out


def _same_arch(a: ModelShape, b: ModelShape) -> bool:
    keys = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "tied", "qkv_bias")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def plan(cfg, gpu_gib: float, gpus: int, shape: Optional[ModelShape] = None, index_rows: Optional[int] = None,
         index_dim: Optional[int] = None) -> MemoryPlan:
    """GiB per GPU of every phase of a step for ``cfg`` on ``gpus`` GPUs of ``gpu_gib`` each (nothing is loaded)."""
    from fastcredit.credit.registry import estimator_needs

    m, r, d, o = cfg.model, cfg.rollout, cfg.distributed, cfg.optim
    shape = shape or lookup_shape(m.policy, "model.policy", m)
    p = MemoryPlan(gpu_gib, gpus, shape)
    total = int(gpu_gib * GIB)
    s = d.shard_size if 0 < d.shard_size <= gpus and gpus % d.shard_size == 0 else gpus
    tp = max(1, r.tensor_parallel)
    count = f"{shape.params / 1e9:.2f}B" if shape.params >= 1e9 else f"{shape.params / 1e6:.1f}M"
    p.title = (f"{cfg.run_name}: policy {shape.name} ({count} params), {gpus} GPU(s) x "
               f"{gpu_gib:g} GiB, {d.engine} sharded over {s}, micro-batch {o.micro_batch_tokens} tokens")
    res = _resident(cfg, gpus, p, index_rows, index_dim)
    vllm = r.engine == "vllm"

    # train: the engines asleep, the training state back on the GPU
    b = 2 if d.mixed_precision else 4
    h, kvd, ii, t = shape.hidden, shape.kv_heads * shape.head_dim, shape.intermediate, o.micro_batch_tokens
    layer_work = t * (8 * h + 2 * kvd + 4 * ii) * b
    if d.activation_checkpointing:
        acts = shape.layers * t * h * b + 2 * layer_work + t * h * 8
    else:
        acts = (shape.layers + 1) * layer_work + t * h * 8
    root = shape.params - shape.layers * shape.layer_params()
    zero2 = d.engine == "deepspeed" and d.zero_stage == 2
    state = {"policy": 0 if d.cpu_offload else 16 * shape.params // s, **({"zero2": 2 * shape.params} if zero2 else {})}
    if estimator_needs(cfg.credit.estimator).value_model:
        value_params = shape.params - (0 if shape.tied else shape.vocab * h) + h + 1
        state["value"] = 0 if d.cpu_offload else 16 * value_params // s
    ref = {"reference": 2 * shape.params // s} if cfg.loss.kl_coef > 0 or cfg.credit.kl_in_reward > 0 else {}
    stays = {} if d.colocate else {**state, **ref}  # colocate=false: nothing moves off the GPU
    free = total - sum(res.values()) - sum(stays.values())

    # rollout: the engine's share of the GPU
    weights, kv_tok = shape.params * 2 // tp, kv_bytes_per_token(shape, tp)
    p.max_context = cfg.data.max_prompt_tokens + r.max_response_tokens
    seqs = math.ceil(o.batch_prompts / gpus) * r.n_samples
    p.kv_tokens_step = seqs * p.max_context
    margin = int(r.memory_margin_gib * GIB)
    if vllm:
        try:
            if r.gpu_memory_utilization > 0:
                p.utilization = r.gpu_memory_utilization
                check_fixed_utilization(p.utilization, free, total)
            else:
                p.utilization = max(0.0, _auto_share(free, total, margin))
                engine_memory_utilization(free, total, margin, weights + VLLM_OVERHEAD_BYTES, p.max_context * kv_tok)
        except MemoryBudgetError as exc:
            p._problem(f"rollout: {exc}")
        kv = max(0, int(p.utilization * total) - weights - VLLM_OVERHEAD_BYTES)
        engine = {"weights": weights, "vllm": VLLM_OVERHEAD_BYTES, "kv": kv}
    else:
        kv = p.kv_tokens_step * kv_tok  # the HF engine holds every sequence's cache at once
        engine = {"weights": weights, "kv": kv}
    p.kv_tokens = kv // kv_tok
    p.phases["rollout"] = {**res, **stays, **engine}
    if p.kv_tokens < p.max_context and not p.hard:
        p._problem(f"rollout: the KV cache left holds {_tokens(p.kv_tokens)} tokens, below the max context "
                   f"{_tokens(p.max_context)} (data.max_prompt_tokens + rollout.max_response_tokens): vLLM cannot "
                   "run one sequence; free GPU memory or shorten the context")
    elif p.kv_tokens < p.kv_tokens_step:
        p._problem(f"rollout: the KV cache holds {_tokens(p.kv_tokens)} tokens, a step asks for "
                   f"{_tokens(p.kv_tokens_step)} ({seqs} sequences x {_tokens(p.max_context)}): vLLM will queue "
                   "(fine, slower)", hard=False)

    # judge: the critic switched into the same engine
    j = cfg.judges
    if j.backend == "colocated":
        critic = shape if not j.model else lookup_shape(j.model, "judges.model")
        own = bool(j.model) and (not _same_arch(shape, critic) or r.proceed.enabled)
        why = "ProCeed asks it during the rollout" if r.proceed.enabled else \
            f"its architecture ({critic.name}) differs from the policy's ({shape.name})"
        if own and vllm:
            p._problem(f"judge: judges.model={j.model}: {why}, so it cannot share the policy's vLLM engine; serve it "
                       "in its own process and set judges.backend=http")
        else:
            p.phases["judge"] = {**res, **stays, **engine, "weights": critic.params * 2 // tp}
            where = "an HF engine of its own" if own else "the policy's engine and KV cache"
            p.notes.append(f"judge: {critic.name if j.model else 'the policy itself'} in {where}")
    elif j.backend == "http":
        p.notes.append(f"judge: served over HTTP at {j.url} (nothing on these GPUs)")

    asleep = ({"asleep": ASLEEP_BYTES} if vllm else {}) if d.colocate else engine
    p.phases["train"] = {**res, **asleep, **state, **ref,
                         "gather": 0 if zero2 else (2 * shape.layer_params() + root) * b, "activations": acts}
    # weight sync: engine weights woken while the training state is still on the GPU
    p.phases["sync"] = {**res, **asleep, **state, **({} if d.colocate else ref), "weights": weights,
                        "stream": shape.vocab * h * 6}
    if not d.colocate:
        p.notes.append("distributed.colocate=false: nothing sleeps, the training state stays beside the engine")

    advice = {"rollout": "lower rollout.gpu_memory_utilization, split the index over the ranks (retrieval.across_ranks="
                         "shard) or take it off the GPU (retrieval.device=cpu, index_type=hnsw/ivfpq or backend=http)",
              "judge": "use a smaller critic or serve it over HTTP (judges.backend=http)",
              "train": "shard over more GPUs, enable distributed.cpu_offload or lower optim.micro_batch_tokens",
              "sync": "shard over more GPUs or enable distributed.cpu_offload"}
    for ph in PHASES:
        if ph in p.phases and p.total(ph) > total:
            p._problem(f"{ph} phase needs {_gib(p.total(ph))} GiB of a {gpu_gib:g} GiB GPU: {advice[ph]}")
    return p


def format_plan(p: MemoryPlan) -> str:
    """Phase x component GiB, totals, the GPU's size and a verdict; then the notes and problems."""
    phases = [ph for ph in PHASES if ph in p.phases]
    comps = [c for c in LABELS if any(p.phases[ph].get(c) for ph in phases)]
    width = max(len(LABELS[c]) for c in comps) + 2
    head = "GiB per GPU".ljust(width) + "".join(f"{ph:>10}" for ph in phases)
    lines = [p.title, "", head, "-" * len(head)]
    for c in comps:
        cells = "".join(f"{_gib(p.phases[ph][c]) if c in p.phases[ph] else '-':>10}" for ph in phases)
        lines.append(LABELS[c].ljust(width) + cells)
    lines.append("-" * len(head))
    lines.append("total".ljust(width) + "".join(f"{_gib(p.total(ph)):>10}" for ph in phases))
    lines.append("GPU".ljust(width) + "".join(f"{p.gpu_gib:>10.1f}" for _ in phases))
    verdict = ["fits" if p.total(ph) <= p.gpu_gib * GIB else "OVER" for ph in phases]
    lines.append("verdict".ljust(width) + "".join(f"{v:>10}" for v in verdict))
    lines.append("")
    if p.utilization is not None:
        lines.append(f"vLLM gpu_memory_utilization: {p.utilization:.2f}; its KV cache holds {_tokens(p.kv_tokens)} "
                     f"tokens, a step asks for {_tokens(p.kv_tokens_step)} (max context {_tokens(p.max_context)})")
    lines += [f"- {n}" for n in p.notes]
    lines.append("problems:" if p.problems else "problems: none")
    lines += [f"  {'ERROR' if q in p.hard else 'note'}: {q}" for q in p.problems]
    return "\n".join(lines)
