"""The configuration of PiCA's PRM training (``python -m fastcredit.prm.train``): one dataclass per section.

    cfg = load_config("configs/prm.yaml", ["optim.lr=5e-6"], root=PRMTrainConfig)

Values come from the YAML, then ``key=value`` overrides (``fastcredit.config.load_config``: unknown keys
and wrong types are errors naming the key and its file and line). The ``distributed`` and ``logging``
sections are the policy trainer's own (``fastcredit.config``). Every number declares its range
beside its field, checked by :meth:`PRMTrainConfig.validate` with the key and where it was set.
Defaults follow PiCA's Table 4 (Appendix G) where it gives a value; the comments say where it does not.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Mapping, Optional

from fastcredit.config import ConfigError, ConfigPathError, DistributedConfig, LoggingConfig
from fastcredit.config.fields import COUNT, NONNEG, POS, SEED, opt
from fastcredit.config.ranges import check_ranges


@dataclass
class PRMModelConfig:
    backbone: str = opt("tiny", "PRM backbone: a local Hugging Face causal-LM folder (Table 4: a 3B model, "
                                "Qwen2.5-3B-Instruct) or 'tiny' (a random tiny Qwen2 built in code)")
    tokenizer: Optional[str] = opt(None, "tokenizer folder; null: the backbone's ('tiny' trains a byte-level BPE over "
                                         "the training trajectories' texts into <output_dir>/tokenizer)")
    dtype: Literal["float32", "bfloat16", "float16"] = opt(
        "bfloat16", "compute dtype on a GPU under distributed.mixed_precision (Table 4: bf16); weights are trained "
                    "as float32 master weights, and the CPU computes in float32")
    attn_impl: Literal["sdpa", "eager", "flash_attention_2"] = opt("sdpa", "attention implementation passed to "
                                                                           "transformers")
    tiny_hidden: int = opt(64, "hidden size of the 'tiny' backbone", range=COUNT)
    tiny_layers: int = opt(2, "decoder layers of the 'tiny' backbone", range=COUNT)
    tiny_heads: int = opt(2, "attention heads of the 'tiny' backbone", range=COUNT)
    tiny_vocab: int = opt(1000, "vocabulary size of the 'tiny' backbone's BPE tokenizer",
                          range="[300, inf)", note="256 bytes and the agent tags")


@dataclass
class PRMDataConfig:
    train_path: str = opt("runs/prm_data/train.parquet", "labelled trajectories to train on (parquet; python -m "
                                                         "fastcredit.prm.label writes them)")
    test_path: Optional[str] = opt(None, "held-out labelled trajectories; null: data.test_fraction of the training "
                                         "file's questions are held out")
    test_fraction: float = opt(0.1, "with data.test_path null: the share of the training file's questions held out "
                                    "(split by question, so no question is in both; 0: no evaluation)",
                               range="[0, 1)", note="0: no held-out split")
    max_tokens: int = opt(4096, "token budget of one trajectory's PRM input (Table 4: sequence.max_length 32768); "
                                "longer ones keep the head of every segment (fastcredit.models.prm_inputs)",
                          range="[2, inf)", note="a question and one turn, with their placeholders")


@dataclass
class PRMLossConfig:
    placeholder: str = opt("<|vision_start|>", "the token read after the question and after every turn (Appendix "
                                               "G.1: Qwen's <|vision_start|>); added to the tokenizer when missing")
    lambda_g: float = opt(1.0, "λg, weight of L_gold against L_final (Eq. 10; the paper gives no value)",
                          range=NONNEG, note="0: L_final alone")
    tau_g: float = opt(0.1, "τg, temperature of L_gold = -Σ_pivots log σ((log f(t) - log f(t-1)) / "
                            "τg) (docs/methods.md §6)", range=POS)


@dataclass
class PRMOptimConfig:
    lr: float = opt(5e-6, "peak learning rate (Table 4: 5e-6)", range=POS)
    weight_decay: float = opt(0.0, "AdamW weight decay (not in Table 4)", range=NONNEG)
    betas: list[float] = opt([0.9, 0.999], "AdamW betas (not in Table 4)", range="[0, 1)", note="each of the two")
    warmup_ratio: float = opt(0.03, "linear warm-up over this share of the optimizer steps (not in Table 4)",
                              range="[0, 1)")
    schedule: Literal["constant", "cosine", "linear"] = opt("cosine", "schedule after warm-up (not in Table 4)")
    grad_clip: float = opt(1.0, "max global gradient norm (inf: no clipping, the norm is still measured)",
                           range="(0, inf]", note="inf: no clipping")
    epochs: int = opt(1, "passes over the training trajectories (Table 4: max_epochs 1)", range=COUNT)
    max_steps: int = opt(0, "stop after this many optimizer steps (0: optim.epochs decide); the schedule spans it",
                         range=NONNEG, note="0: optim.epochs decide")
    batch_size: int = opt(256, "trajectories per optimizer step, over all ranks (Table 4: train_batch_size 256)",
                          range=COUNT)
    micro_batch_tokens: int = opt(16384, "tokens per packed forward / backward (Table 4 has micro_batch_size 16 "
                                         "trajectories per GPU; here a token budget, a trajectory never split)",
                                  range=COUNT)


@dataclass
class PRMEvalConfig:
    every: int = opt(0, "optimizer steps between evaluations on the held-out trajectories (0: only at the end; "
                        "Table 4: eval_steps 100)", range=NONNEG, note="0: only at the end")
    max_trajectories: int = opt(0, "held-out trajectories evaluated (0: all)", range=NONNEG, note="0: all")


@dataclass
class PRMExportConfig:
    dtype: Literal["float32", "bfloat16", "float16"] = opt("float32", "dtype of the exported backbone's weights "
                                                                     "(<output_dir>/export; the head stays float32)")


@dataclass
class PRMTrainConfig:
    seed: int = opt(0, "seed of the tiny backbone, the data order and the held-out split", range=SEED)
    run_name: str = opt("fastcredit-prm", "name shown in logs")
    model: PRMModelConfig = opt(PRMModelConfig, "backbone and tokenizer")
    data: PRMDataConfig = opt(PRMDataConfig, "labelled trajectories and the held-out split")
    prm: PRMLossConfig = opt(PRMLossConfig, "placeholder token and the loss (PiCA Eqs. 8-10)")
    optim: PRMOptimConfig = opt(PRMOptimConfig, "optimizer, schedule and batch sizes")
    distributed: DistributedConfig = opt(DistributedConfig, "FSDP2 / DeepSpeed (the policy trainer's section; "
                                                            "colocate is unused)")
    logging: LoggingConfig = opt(LoggingConfig, "run folder, metrics, checkpoints (the policy trainer's section)")
    eval: PRMEvalConfig = opt(PRMEvalConfig, "held-out evaluation")
    export: PRMExportConfig = opt(PRMExportConfig, "the exported PRM folder")

    def validate(self, origins: Optional[Mapping[str, str]] = None) -> None:
        """Every number in its field's range and the rules between keys; errors name the key and where it was
        set (``origins``: key → file and line, or the command line)."""
        check_ranges(self, origins)
        m = self.model
        rules = [
            (len(self.optim.betas) == 2, f"optim.betas must be two numbers in [0, 1), got {self.optim.betas!r}"),
            (m.backbone != "tiny" or m.tiny_hidden % m.tiny_heads == 0,
             f"model.tiny_hidden={m.tiny_hidden} must be a multiple of model.tiny_heads={m.tiny_heads}"),
            (self.distributed.engine == "fsdp2" or self.distributed.shard_size == -1,
             f"distributed.shard_size={self.distributed.shard_size} applies to distributed.engine=fsdp2 only"),
            (bool(self.prm.placeholder), "prm.placeholder must be a token's text, got ''"),
            (bool(self.data.train_path), "data.train_path is required: the labelled trajectories to train on"),
        ]
        for ok, message in rules:
            if not ok:
                raise ConfigError(message)

    def check_paths(self, data: bool = True) -> None:
        """The local files and folders the config names exist (a ConfigPathError naming the key), before a
        library takes a missing folder for a Hugging Face hub id; ``data``: the data files too."""
        m, d = self.model, self.data
        for key, path, what in (
                ("model.backbone", None if m.backbone == "tiny" else m.backbone,
                 "a local Hugging Face causal-LM folder, or tiny"),
                ("model.tokenizer", m.tokenizer, "a local tokenizer folder, or null: the backbone's"),
                ("data.train_path", d.train_path if data else None,
                 "python -m fastcredit.prm.label writes labelled trajectories"),
                ("data.test_path", d.test_path if data else None, "or null: hold out data.test_fraction")):
            if path is not None and not os.path.exists(path):
                raise ConfigPathError(f"{key}: {path} does not exist ({what})")

