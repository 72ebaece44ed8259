"""The config tree's sections: one dataclass per component, every field documented where it is declared.

    cfg = TrainConfig()                      # the defaults; fastcredit.config.load_config reads YAML and overrides

YAML files hold values only; every default lives here (and in the section modules beside this
one: credit, loss, toy), next to its documentation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from fastcredit.config.credit import CreditConfig
from fastcredit.config.fields import COUNT, NONNEG, POS, SEED, UNIT, opt
from fastcredit.config.loss import LossConfig
from fastcredit.config.toy import ToyWorldConfig


@dataclass
class ModelConfig:
    policy: str = opt("tiny", "policy weights: a local HF folder, 'smollm2' (the packaged SmolLM2-135M) or 'tiny' (a "
                              "random tiny Qwen2 built in code)")
    tokenizer: Optional[str] = opt(None, "tokenizer folder; null: the model's own ('tiny' trains a byte-level BPE "
                                         "over the run's texts: the toy corpus, or a PRM's training trajectories)")
    value: Optional[str] = opt(None, "value-model initialisation for ppo / pica; defaults to the policy's weights "
                                     "with a fresh scalar head")
    dtype: Literal["float32", "bfloat16", "float16"] = opt(
        "bfloat16", "compute dtype on a GPU under distributed.mixed_precision (and the rollout engine's weight "
                    "dtype); trained weights are held in float32 (master weights) everywhere, and the CPU computes in "
                    "float32")
    chat_template: bool = opt(False, "wrap prompts with the tokenizer's chat template (instruct models)")
    attn_impl: Literal["sdpa", "eager", "flash_attention_2"] = opt(
        "sdpa", "attention implementation passed to transformers")
    tiny_hidden: int = opt(128, "hidden size of the 'tiny' model", range=COUNT)
    tiny_layers: int = opt(2, "decoder layers of the 'tiny' model", range=COUNT)
    tiny_heads: int = opt(4, "attention heads of the 'tiny' model", range=COUNT)
    tiny_vocab: int = opt(2000, "vocabulary size of the 'tiny' model's BPE tokenizer",
                          range="[300, inf)", note="256 bytes and the agent tags")
    tiny_intermediate: int = opt(0, "MLP width of the 'tiny' policy (0: 2 x tiny_hidden)",
                                 range=NONNEG, note="0: 2 x tiny_hidden")
    tiny_kv_heads: int = opt(0, "key/value heads of the 'tiny' policy (0: tiny_heads, no grouping)",
                             range=NONNEG, note="0: tiny_heads")
    tiny_vocab_rows: int = opt(0, "rows of the 'tiny' policy's embedding and LM head (0: its tokenizer's size); a "
                                  "real model's vocabulary size gives its LM-head cost for timing "
                                  "(bench/bench_step.py), ids past the tokenizer decode to nothing",
                               range=NONNEG, note="0: the tokenizer's size")


@dataclass
class DataConfig:
    source: Literal["toy", "searchr1", "flashrag"] = opt(
        "toy", "dataset format: the generated toy world, Search-R1 parquet, or FlashRAG jsonl")
    train_path: Optional[str] = opt(None, "training file: QA pairs (parquet / jsonl; unused for data.source=toy), or "
                                          "a PRM's labelled trajectories (parquet; python -m fastcredit.prm.label "
                                          "writes them)")
    test_path: Optional[str] = opt(None, "evaluation file: QA pairs (unused for data.source=toy), or a PRM's "
                                         "held-out labelled trajectories (null: data.test_fraction of the training "
                                         "file's questions are held out)")
    world_dir: str = opt("runs/toyworld", "where the toy world's files are written and read")
    toy: ToyWorldConfig = opt(ToyWorldConfig, "toy-world generator settings")
    prompt_template: Literal["searchr1"] = opt("searchr1", "training prompt (Search-R1 / CriticSearch Prompt 1)")
    prompt_source: Literal["template", "parquet"] = opt(
        "template", "'template': build each prompt from the question with data.prompt_template; 'parquet': use the "
                    "row's own 'prompt' chat list as Search-R1's veRL dataset does (chat template applied when "
                    "model.chat_template is on, else the first message's text)")
    max_prompt_tokens: int = opt(4096, "prompts longer than this are dropped with a warning", range=COUNT)
    shuffle: bool = opt(True, "shuffle the training set each epoch (seeded)")


@dataclass
class RetrievalConfig:
    backend: Literal["local", "http"] = opt("local", "in-process batched retriever, or a Search-R1 /retrieve server")
    url: str = opt("http://127.0.0.1:8000/retrieve", "server address for backend=http")
    corpus: Optional[str] = opt(None, "corpus jsonl (Search-R1 format); defaults to the toy world's")
    index: Optional[str] = opt(None, "index file (e.g. Search-R1's e5_Flat.index) or folder of python -m "
                                     "fastcredit.retrieval.build; null: the index beside the corpus "
                                     "(<corpus>.fastcredit/, the toy world's), built or brought up to date at start")
    build_index: Literal["auto", "missing", "never"] = opt(
        "auto", "when the run builds an index: 'auto' only the one beside the corpus (retrieval.index null), so a "
                "retrieval.index that is set must exist; 'missing' also a set retrieval.index that does not exist, "
                "at that path; 'never' nothing (retrieval.index must be set and exist)")
    index_type: Literal["flat", "hnsw", "ivfpq", "torch"] = opt(
        "flat", "FAISS flat IP, HNSW, IVF-PQ, or a torch matmul flat index")
    encoder: str = opt("minilm", "query encoder: 'minilm' (packaged all-MiniLM-L6-v2) or a local HF encoder folder")
    pooling: Literal["mean", "cls"] = opt("mean", "encoder pooling")
    query_prefix: str = opt("", "prepended to queries (E5: 'query: ')")
    passage_prefix: str = opt("", "prepended to passages (E5: 'passage: ')")
    topk: int = opt(3, "passages per search", range=COUNT)
    max_passage_tokens: int = opt(256, "per-passage cap in the observation", range=COUNT)
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "where the index and encoder live")
    batch_size: int = opt(256, "largest retrieval micro-batch", range=COUNT)
    batch_timeout_ms: float = opt(2.0, "a micro-batch is sent when full or after this long", range=NONNEG)
    num_shards: int = opt(1, "GPUs one process spreads its index over (0: every visible GPU, for a standalone "
                             "server); under torchrun with across_ranks=replicate each rank keeps its copy from its "
                             "own GPU (unused with across_ranks=shard)", range=NONNEG, note="0: every visible GPU")
    across_ranks: Literal["shard", "replicate"] = opt(
        "shard", "under torchrun with backend=local: 'shard' splits the index rows over the ranks (each "
                 "holds 1/W, every search is answered by all shards together, results identical to one "
                 "flat index; index_type=hnsw cannot be split), 'replicate' gives each rank a whole "
                 "copy; one process: the same thing")
    round_cadence_ms: float = opt(5.0, "across_ranks=shard: an idle rank waits this long for a search before it "
                                       "meets the other ranks in a retrieval round", range=NONNEG)


@dataclass
class ProceedRolloutConfig:
    enabled: bool = opt(False, "ProCeedRL rewind-and-refine rollouts (docs/methods.md section 5)")
    fraction: float = opt(0.5, "fraction of each group rolled out with ProCeed (paper: G/2)", range="(0, 1]")
    tau: int = opt(3, "a step whose critic score is below tau is rewound and refined",
                   range="[0, 10]", note="the process critic scores 0-10")
    max_rewinds: int = opt(4, "cap on rewinds per trajectory", range=NONNEG)
    refiner: Literal["self", "external"] = opt("self", "who writes refined actions: the policy, or the judge engine")


@dataclass
class RolloutConfig:
    engine: Literal["hf", "vllm"] = opt("hf", "generation engine")
    mode: Literal["auto", "async", "lockstep"] = opt(
        "auto", "async: each trajectory's next turn starts when its own search returns; lockstep: Search-R1's turns, "
        "every active trajectory in one engine call; auto: async on an engine that batches in flight (vLLM) or with "
        "ProCeed, else lockstep (printed at start with its reason)")
    n_samples: int = opt(5, "G: samples per prompt (a group)", range=COUNT)
    temperature: float = opt(1.0, "sampling temperature",
                             range=POS, note="training divides the logits by it; greedy decoding is evaluation's")
    top_p: float = opt(1.0, "nucleus sampling", range="(0, 1]")
    top_k: int = opt(-1, "top-k sampling (-1: off)", range=COUNT, also=(-1,), note="-1: off")
    max_turns: int = opt(4, "action budget per trajectory; the last turn is 'truncated' if it runs out", range=COUNT)
    max_action_tokens: int = opt(500, "tokens one action may generate", range=COUNT)
    max_obs_tokens: int = opt(500, "cap on one observation's tokens", range=COUNT)
    max_response_tokens: int = opt(4096, "cap on a whole response (actions + observations)", range=COUNT)
    stop_at_tags: bool = opt(True, "stop generating an action at </search> or </answer>; false: Search-R1's turns, "
                                   "generated to EOS or max_action_tokens and cut after the first tag "
                                   "(configs/searchr1_design.yaml)")
    gpu_memory_utilization: float = opt(0.0, "vLLM's share of the GPU (weights, activations, KV cache); 0: auto, "
                                             "what is free once the trainer's resident state is in place minus "
                                             "rollout.memory_margin_gib (fastcredit.trainer.memory)",
                                        range=UNIT, note="0: auto")
    memory_margin_gib: float = opt(2.0, "GPU memory left free beside the vLLM engine with gpu_memory_utilization=0 "
                                        "(allocator fragmentation, NCCL buffers)", range=NONNEG)
    sleep_level: Literal[1, 2] = opt(2, "vLLM sleep level for the policy engine (2: drop weights, "
                                        "re-synced after the update)")
    enable_prefix_caching: bool = opt(True, "vLLM prefix caching")
    tensor_parallel: int = opt(1, "vLLM tensor parallel size", range=COUNT)
    max_staleness: int = opt(0, "k: a batch trains only if every turn in it came from a policy at most k updates "
                                "old (0: synchronous; 1: one-step-off; > 0 needs distributed.placement=split)",
                             range=NONNEG)
    partial: bool = opt(False, "placement=split: new weights load between two engine steps and a trajectory in "
                               "flight goes on with them (its turns keep their versions); false: they load between "
                               "batches, every trajectory finishes on the weights it started with")
    proceed: ProceedRolloutConfig = opt(ProceedRolloutConfig, "ProCeedRL rewinds")


@dataclass
class JudgesConfig:
    backend: Literal["none", "colocated", "http", "oracle"] = opt(
        "none", "critic / judge backend; 'oracle' answers from the toy world's gold facts")
    model: Optional[str] = opt(None, "judge weights (colocated: a local HF folder; of the policy's architecture it "
                                     "is switched into the policy's engine) or model name (http)")
    url: str = opt("http://127.0.0.1:8001/v1", "OpenAI-compatible endpoint for backend=http")
    temperature: float = opt(0.0, "judge sampling temperature", range=NONNEG, note="0: greedy")
    retry_temperature: float = opt(0.7, "temperature of a re-ask after an unparseable verdict (each with a seed of "
                                        "its own; a greedy re-ask repeats the same text)",
                                   range=NONNEG, note="0: greedy, a re-ask then repeats the same text")
    constrained: bool = opt(False, "decode under the verdict grammar so every verdict parses "
                                   "(fastcredit.judges.grammar; the HF engine masks logits, vLLM uses structured "
                                   "outputs; backend=http needs a vLLM server)")
    max_tokens: int = opt(1024, "judge output budget", range=COUNT)
    concurrency: int = opt(64, "in-flight requests to an http judge", range=COUNT)
    timeout_s: float = opt(60.0, "per-request timeout for an http judge", range=POS)
    sleep_level: Literal[1, 2] = opt(1, "sleep level of a colocated judge with an engine of its own (the HF engine; "
                                        "a critic of the policy's architecture shares the policy's engine, "
                                        "fastcredit.judges.switch)")
    prm: Optional[str] = opt(None, "PiCA process reward model folder; 'oracle' uses the toy world's gold facts")
    oracle_noise: float = opt(0.0, "probability that the oracle judge and oracle PRM flip each per-turn verdict (a "
                                   "noisy critic on the toy world; deterministic per run seed and trajectory)",
                              range=UNIT)


@dataclass
class OptimConfig:
    lr: float = opt(1e-6, "learning rate of the model trained (the policy, or a PRM), the schedule's peak (0: it "
                          "stays as it started, every step doing the same work: bench/bench_step.py's equal-work "
                          "timing)", range=NONNEG, note="0: frozen")
    critic_lr: float = opt(1e-5, "value-model learning rate (ppo, pica; 0: frozen)", range=NONNEG, note="0: frozen")
    weight_decay: float = opt(0.01, "AdamW weight decay", range=NONNEG)
    betas: list[float] = opt([0.9, 0.999], "AdamW betas", range="[0, 1)", note="each of the two")
    warmup_ratio: float = opt(0.0, "linear warm-up over this fraction of the optimizer steps", range="[0, 1)")
    critic_warmup_ratio: Optional[float] = opt(None, "the value model's warm-up fraction (ppo, pica; Search-R1: "
                                                     "critic.optim.lr_warmup_steps_ratio); null: optim.warmup_ratio",
                                               range="[0, 1)", note="or null: optim.warmup_ratio")
    schedule: Literal["constant", "cosine", "linear"] = opt("constant", "schedule after warm-up")
    grad_clip: float = opt(1.0, "max global gradient norm (inf: no clipping, the norm is still measured)",
                           range="(0, inf]", note="inf: no clipping")
    total_steps: int = opt(1000, "training steps", range=NONNEG)
    batch_prompts: int = opt(512, "prompts per step (each sampled n_samples times)", range=COUNT)
    mini_batch_prompts: int = opt(256, "prompts per optimizer step (PPO mini-batch)", range=COUNT)
    micro_batch_tokens: int = opt(16384, "tokens per packed forward / backward micro-batch on a rank", range=COUNT)
    ppo_epochs: int = opt(1, "passes over each step's data", range=COUNT)


@dataclass
class DistributedConfig:
    engine: Literal["fsdp2", "deepspeed"] = opt(
        "fsdp2", "engine training the policy and value model: torch FSDP2, or DeepSpeed ZeRO (distributed.zero_stage)")
    zero_stage: Literal[2, 3] = opt(3, "DeepSpeed ZeRO stage (engine=deepspeed): 3 shards parameters, gradients and "
                                       "optimizer state; 2 only gradients and optimizer state")
    backend: Literal["auto", "nccl", "gloo"] = opt("auto", "process-group backend (auto: nccl on GPU, gloo on CPU)")
    mixed_precision: bool = opt(True, "bf16 compute with fp32 master weights and reduction (on CUDA; "
                                      "the CPU computes in fp32)")
    activation_checkpointing: bool = opt(True, "recompute decoder layers in backward")
    cpu_offload: bool = opt(False, "keep parameters and optimizer state in CPU memory (DeepSpeed: ZeRO-Offload of "
                                   "the optimizer, and of the parameters at stage 3)")
    offload_state: Literal["auto", True, False] = opt(
        "auto", "colocated on a GPU: whether the training state (the policy's and value model's parameters and "
                "optimizer state, the reference policy) goes to the host while the engines roll out and judge. auto: "
                "it stays on the GPU, and so do the HF engine's weights, when the memory plan "
                "(fastcredit.trainer.memory.offload) fits every phase with it there, with a margin; it moves otherwise "
                "(the choice and its reason are printed at start and shown by --memory-report). true: it always "
                "moves, as Search-R1 does (veRL's param_offload / optimizer_offload); false: it always stays (with "
                "vLLM, set rollout.gpu_memory_utilization)")
    keep_host_memory: Literal["auto", True, False] = opt(
        "auto", "glibc's malloc keeps the host memory torch frees (large blocks from the heap, no trimming), so the "
                "next training pass reuses it instead of page-faulting fresh zeroed pages (fastcredit.runtime."
                "host_memory). Process-wide; the resident size stays at its peak. auto: where training runs on the CPU")
    shard_size: int = opt(-1, "FSDP2 shard group size, HSDP when it divides the world (-1: all "
                              "ranks; engine=fsdp2 only)", range=COUNT, also=(-1,), note="-1: all ranks")
    colocate: bool = opt(True, "rollout, judge and training take turns on every GPU (vLLM sleep mode)")
    placement: Literal["colocated", "split"] = opt(
        "colocated", "colocated: every rank rolls out, judges and trains in turn; split: the first ranks train, "
        "the last distributed.rollout_ranks only roll out and judge, overlapping with training "
        "(rollout.max_staleness; fastcredit.distributed.split)")
    rollout_ranks: int = opt(0, "placement=split: ranks that roll out (the last ones; the others train); 0: half "
                                "the world", range=NONNEG, note="0: half the world")
    gpus: int = opt(0, "GPUs the run is planned for, one rank each (a paper config: its paper's count); "
                       "--memory-report plans for it unless --gpus or torchrun's WORLD_SIZE says otherwise. Training "
                       "runs on the ranks torchrun starts, whatever this says (0: not stated, one GPU)",
                    range=NONNEG, note="0: not stated, one GPU")


@dataclass
class LoggingConfig:
    output_dir: str = opt("runs/default", "run directory: merged config, metrics, checkpoints")
    log_every: int = opt(1, "steps between console lines", range=COUNT)
    jsonl: bool = opt(True, "append per-step metrics to metrics.jsonl")
    tensorboard: bool = opt(False, "write TensorBoard events")
    wandb: bool = opt(False, "log to Weights & Biases (offline unless configured)")
    progress: bool = opt(True, "progress bars")
    curves: bool = opt(True, "draw curves.png (a panel per group of metrics) from metrics.jsonl when the run ends")
    nvtx: bool = opt(True, "NVTX ranges around phases (no-op without a GPU)")
    checkpoint_every: int = opt(50, "steps between checkpoints (0: only at the end)",
                                range=NONNEG, note="0: only at the end")
    keep_checkpoints: int = opt(2, "checkpoints kept on disk (0: all)", range=NONNEG, note="0: all")


@dataclass
class WarmStartConfig:
    enabled: bool = opt(False, "supervised pass on the toy world's oracle trajectories before RL (a tiny policy "
                               "cannot search otherwise)")
    epochs: int = opt(3, "passes over the training questions", range=COUNT)
    lr: float = opt(3e-3, "warm-start learning rate (cosine decay)", range=POS)
    batch_size: int = opt(16, "trajectories per warm-start step", range=COUNT)
    questions: int = opt(0, "training questions used (0: all)", range=NONNEG, note="0: all")
    detour_fraction: float = opt(0.0, "share of the oracle trajectories given one detour: a wrong search (a twin's "
                                      "or another relation's sub-query, checked to miss), a think that names the "
                                      "miss, then the right search (toy world; fastcredit.data.detours)", range=UNIT)
    waste_prob: float = opt(0.0, "lookup world: the demonstrator's chance, at each search, of wasting it on an entity "
                                 "it has already found or one the question does not name (while a spare search is "
                                 "left; fastcredit.data.lookup_demos)", range=UNIT)
    misquery_prob: float = opt(0.0, "lookup world: the demonstrator's chance, at each search, of searching the needed "
                                    "entity's surname only and taking the code of whatever comes first, the entity "
                                    "or its decoy", range=UNIT)
    seed: Optional[int] = opt(None, "seed of the warm start: the tiny policy's initialisation and the order of the "
                                    "supervised pass (null: the run seed); runs that differ only in their run seed "
                                    "share a warm start when this is set", range=SEED)
    threads: int = opt(2, "CPU threads of the warm start's supervised pass (torch's intra-op threads, restored "
                          "after): fixed, because float sums follow the thread count and the warm-started weights "
                          "(greedy EM 0.500 on 2 threads, 0.447 on 1, configs/compare_detour.yaml) would otherwise "
                          "depend on the machine; 2, the reference machine's cores, which made the demo's figure; "
                          "part of the warm start's cache key (0: torch's default, this machine's count)",
                       range=NONNEG, note="0: torch's default")
    cache_dir: Optional[str] = opt(None, "folder of cached warm starts: one made with the same data, model, "
                                         "retrieval, warm-start seed and warmstart settings (and the rollout "
                                         "settings that shape its observations) is loaded instead of redone")

    def seed_for(self, run_seed: int) -> int:
        """The seed the warm start runs with (the tiny policy's initialisation, the supervised pass's order):
        ``warmstart.seed``, else the run seed."""
        return run_seed if self.seed is None else self.seed


@dataclass
class EvalConfig:
    questions: int = opt(100, "held-out questions scored with greedy rollouts (0: no evaluation)",
                         range=NONNEG, note="0: no evaluation")
    every: int = opt(0, "steps between evaluations (0: none during training; the policy trainer also "
                        "evaluates before and after training, a PRM's after)",
                     range=NONNEG, note="0: none during training")
    observations: Literal["real", "none", "shuffled"] = opt(
        "real", "what a held-out search returns: the retriever's passages; none, an empty <information> block; "
                "shuffled, passages drawn at random from the corpus (closed-book controls: how much of held-out EM "
                "comes from retrieval; training rollouts always search for real)")
    seed: Optional[int] = opt(None, "seed that picks the held-out questions (null: the run seed); runs that differ "
                                    "only in their run seed score the same questions when this is set", range=SEED)

    def seed_for(self, run_seed: int) -> int:
        """The seed that picks the held-out questions: ``eval.seed``, else the run seed."""
        return run_seed if self.seed is None else self.seed


@dataclass
class GuardConfig:
    max_kl: float = opt(float("inf"), "collapse guard: KL to the reference policy above this trips it",
                        range="(0, inf]", note="inf: off")
    max_grad_norm: float = opt(float("inf"), "collapse guard: pre-clip gradient norm above this trips it",
                               range="(0, inf]", note="inf: off")
    min_reward: float = opt(float("-inf"), "collapse guard: mean reward below this (after warm-up) trips it",
                            range="[-inf, inf)", note="-inf: off")
    after_step: int = opt(1, "the guard is armed from this step on", range=NONNEG)
    action: Literal["stop", "rollback"] = opt("rollback", "stop the run, or reload the last checkpoint and go on")
    max_rollbacks: int = opt(3, "rollbacks before the run stops anyway", range=NONNEG)


@dataclass
class TrainConfig:
    seed: int = opt(0, "global seed: a 'tiny' model's initialisation, the data order, sampling, held-out picks",
                    range=SEED)
    run_name: str = opt("fastcredit", "name shown in logs")
    model: ModelConfig = opt(ModelConfig, "policy, tokenizer and value model")
    data: DataConfig = opt(DataConfig, "datasets and prompts")
    retrieval: RetrievalConfig = opt(RetrievalConfig, "corpus, encoder and index")
    rollout: RolloutConfig = opt(RolloutConfig, "generation and the agent loop")
    judges: JudgesConfig = opt(JudgesConfig, "critics, judges, process reward model")
    credit: CreditConfig = opt(CreditConfig, "outcome reward and advantage estimator")
    loss: LossConfig = opt(LossConfig, "policy and value losses")
    optim: OptimConfig = opt(OptimConfig, "optimiser, schedule and batch sizes")
    distributed: DistributedConfig = opt(DistributedConfig, "FSDP2 / DeepSpeed, colocation")
    logging: LoggingConfig = opt(LoggingConfig, "metrics, checkpoints, profiling")
    warmstart: WarmStartConfig = opt(WarmStartConfig, "supervised warm start on oracle trajectories")
    eval: EvalConfig = opt(EvalConfig, "held-out exact match")
    guard: GuardConfig = opt(GuardConfig, "collapse guard on KL, gradient norm and reward")
