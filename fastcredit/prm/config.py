"""The configuration of PiCA's PRM training (``python -m fastcredit.prm.train``): one dataclass per section.

    cfg = load_config("configs/prm.yaml", ["optim.lr=5e-6"], root=PRMTrainConfig)

Values come from the YAML, then ``key=value`` overrides (``fastcredit.config.load_config``: unknown keys
and wrong types are errors naming the key and its file and line). The ``distributed`` and ``logging``
sections are the policy trainer's own (``fastcredit.config``); a key the policy's tree also holds
(``model.dtype``, ``optim.lr``, ``seed``, ...) takes its type, help and range from there
(``fastcredit.config.share.shared``) with the PRM's default, and the rules between keys the two trees
share are ``fastcredit.config.checks``'s. Every number declares its range beside its field, checked by
:meth:`PRMTrainConfig.validate` with the key and where it was set. Defaults follow PiCA's Table 4
(Appendix G) where it gives a value; the ``why`` notes (shown by ``--help``) say where it does not.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Mapping, Optional

from fastcredit.config import (ConfigPathError, DataConfig, DistributedConfig, EvalConfig, LoggingConfig,
                               ModelConfig, OptimConfig, TrainConfig)
from fastcredit.config.checks import betas_rule, raise_broken, shard_size_rule, tiny_heads_rule
from fastcredit.config.fields import COUNT, NONNEG, POS, opt
from fastcredit.config.ranges import check_ranges
from fastcredit.config.share import section, shared

NOT_IN_TABLE_4 = "not in Table 4"


@section
class PRMModelConfig:
    backbone: str = opt("tiny", "PRM backbone: a local Hugging Face causal-LM folder (Table 4: a 3B model, "
                                "Qwen2.5-3B-Instruct) or 'tiny' (a random tiny Qwen2 built in code)")
    tokenizer = shared(ModelConfig)
    dtype = shared(ModelConfig, why="Table 4: bf16")
    attn_impl = shared(ModelConfig)
    tiny_hidden = shared(ModelConfig, 64)
    tiny_layers = shared(ModelConfig, 2)
    tiny_heads = shared(ModelConfig, 2)
    tiny_vocab = shared(ModelConfig, 1000)


@section
class PRMDataConfig:
    train_path = shared(DataConfig, "runs/prm_data/train.parquet")
    test_path = shared(DataConfig)
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


@section
class PRMOptimConfig:
    lr = shared(OptimConfig, 5e-6, why="Table 4: 5e-6")
    weight_decay = shared(OptimConfig, 0.0, why=NOT_IN_TABLE_4)
    betas = shared(OptimConfig, why=NOT_IN_TABLE_4)
    warmup_ratio = shared(OptimConfig, 0.03, why=NOT_IN_TABLE_4)
    schedule = shared(OptimConfig, "cosine", why=NOT_IN_TABLE_4)
    grad_clip = shared(OptimConfig)
    epochs: int = opt(1, "passes over the training trajectories (Table 4: max_epochs 1)", range=COUNT)
    max_steps: int = opt(0, "stop after this many optimizer steps (0: optim.epochs decide); the schedule spans it",
                         range=NONNEG, note="0: optim.epochs decide")
    batch_size: int = opt(256, "trajectories per optimizer step, over all ranks (Table 4: train_batch_size 256)",
                          range=COUNT)
    micro_batch_tokens = shared(OptimConfig, 16384, why="Table 4 has micro_batch_size 16 trajectories per GPU; "
                                                        "here a token budget, a trajectory never split")


@section
class PRMEvalConfig:
    every = shared(EvalConfig, why="not Table 4's eval_steps 100, which configs/prm_qwen.yaml sets")
    max_trajectories: int = opt(0, "held-out trajectories evaluated (0: all)", range=NONNEG, note="0: all")


@dataclass
class PRMExportConfig:
    dtype: Literal["float32", "bfloat16", "float16"] = opt("float32", "dtype of the exported backbone's weights "
                                                                     "(<output_dir>/export; the head stays float32)")


@section
class PRMTrainConfig:
    seed = shared(TrainConfig)
    run_name = shared(TrainConfig, "fastcredit-prm")
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
        raise_broken([
            betas_rule(self.optim),
            tiny_heads_rule(m, m.backbone == "tiny"),
            shard_size_rule(self.distributed),
            (bool(self.prm.placeholder), "prm.placeholder must be a token's text, got ''"),
            (bool(self.data.train_path), "data.train_path is required: the labelled trajectories to train on"),
        ])

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

