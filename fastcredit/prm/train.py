"""Train PiCA's process reward model on labelled trajectories (PiCA §4.1, Eqs. 8-10; docs/methods.md §6).

    python -m fastcredit.prm.train --config configs/prm.yaml                    # the toy preset, on a CPU
    python -m fastcredit.prm.train --config configs/prm.yaml optim.epochs=5 data.train_path=runs/prm_data/train.parquet
    torchrun --nproc_per_node=2 -m fastcredit.prm.train --config configs/prm_qwen.yaml   # Table 4's setting
    python -m fastcredit.prm.train --config configs/prm.yaml --resume           # continue from the last checkpoint
    python -m fastcredit.prm.train --config configs/prm.yaml --export-only      # the last checkpoint → a PRM folder

The PRM gives ``f(t) = σ(head(h_t))`` at the placeholder after the question and after each turn
(``fastcredit.models.prm_inputs`` / ``fastcredit.models.prm``), all of a trajectory's from one forward over a
packed micro-batch.
The loss (``prm_loss``) is summed over a step's ``optim.batch_size`` trajectories and divided by that
global count: the gradient is the same however the batch is split over ranks and micro-batches. The
model trains through the policy trainer's engine (FSDP2 or DeepSpeed). Every ``eval.every`` steps and at
the end the held-out trajectories give ``eval/auc`` (f(T) vs the outcome), ``eval/loss``,
``eval/pivot_gain`` / ``eval/nonpivot_gain`` (mean log f(t) − log f(t−1) at pivot / other turns),
``eval/pivot_auc`` and ``eval/f0_mean``. The run folder (``logging.output_dir``) ends with
``metrics.jsonl``, ``curves.png``, checkpoints, ``eval.json``, ``eval_scores.jsonl`` (f at each placeholder
of each held-out trajectory) and ``export/``: a PRM folder for ``judges.prm`` (``load_prm``, ``PRMScorer``).

Legend (shape suffixes): B trajectories, P placeholders (``1 + turns`` per trajectory).
Exit status: 0 done, 2 bad config or data (the message names the key or the file).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import warnings
from typing import Optional, Sequence

import numpy as np
import torch

from fastcredit.distributed.checkpoint import resume_checkpoint, save_checkpoint
from fastcredit.config import ConfigError, command_parser, load_config, save_config, to_dict
from fastcredit.runtime.files import built_from, mark_built, seed_everything, wait_for_built
from fastcredit.data.loaders import DataError
from fastcredit.data.tokenizer import build_tiny_tokenizer
from fastcredit.distributed.build import build_train_engine, compute_dtype
from fastcredit.distributed.engine import adamw
from fastcredit.distributed.process_group import (all_reduce_sum, init_distributed, max_over_ranks,
                                                 rank_failure_ends_job, shutdown)
from fastcredit.distributed.weights import DTYPES, ExportError, find_checkpoint, name_deepspeed_accelerator
from fastcredit.models.tiny import build_tiny_policy
from fastcredit.prm.config import PRMTrainConfig
from fastcredit.models.prm import PRMModel, add_placeholder, prm_loss, save_prm
from fastcredit.models.prm_inputs import PRMEncoder, pack, require_placeholder, token_budget_groups
from fastcredit.prm.data import LabelledTrajectory, read_labelled
from fastcredit.prm.metrics import eval_line, eval_metrics, plot_curves
from fastcredit.runtime.progress import progress_bar, quiet_library_bars
from fastcredit.runtime.tracking import MetricLogger, archive_previous_run, write_line
from fastcredit.trainer.schedule import lr_factor

NAME = "prm"  # the trained model's name in a checkpoint (DCP keys prm.model.*, or engine/prm)
EXPORT = "export"
def split_by_question(rows: list, fraction: float, seed: int) -> tuple[list, list]:
    """``(train, test)``: ``fraction`` of the distinct questions (seeded) and all their rows held out."""
    questions = sorted({r.question for r in rows})
    held = np.random.default_rng(seed).permutation(len(questions))[:int(round(len(questions) * fraction))]
    test_q = {questions[i] for i in held.tolist()}
    return [r for r in rows if r.question not in test_q], [r for r in rows if r.question in test_q]


def load_rows(cfg: PRMTrainConfig) -> tuple[list, list]:
    """The training and held-out trajectories (``data.*``); DataError names the file, ConfigError the key."""
    d = cfg.data
    rows = read_labelled(d.train_path)
    if d.test_path is not None:
        return rows, read_labelled(d.test_path)
    train, test = split_by_question(rows, d.test_fraction, cfg.seed)
    if not train:
        raise ConfigError(f"data.test_fraction={d.test_fraction} holds out every question of {d.train_path}")
    return train, test


def load_prm_tokenizer(cfg: PRMTrainConfig, out_dir: str, rows: Optional[Sequence[LabelledTrajectory]] = None,
                       rank: int = 0):
    """The backbone's tokenizer; ``tiny`` trains a byte-level BPE over ``rows``' questions and turns into
    ``<out_dir>/tokenizer`` (rank 0, once; reused while the training file is the same; ``rows`` None: it must
    exist). The placeholder is added by ``add_placeholder``, not here."""
    from transformers import AutoTokenizer

    m = cfg.model
    if m.backbone != "tiny" or m.tokenizer:
        return AutoTokenizer.from_pretrained(m.tokenizer or m.backbone, local_files_only=True)
    folder = os.path.join(out_dir, "tokenizer")
    if rows is None:
        if not os.path.exists(os.path.join(folder, "tokenizer.json")):
            raise ConfigError(f"{folder}/tokenizer.json is missing: the tiny backbone's tokenizer is built by training")
        return AutoTokenizer.from_pretrained(folder)
    st = os.stat(cfg.data.train_path)
    key = {"vocab": m.tiny_vocab, "train_path": os.path.abspath(cfg.data.train_path), "bytes": st.st_size,
           "mtime_ns": st.st_mtime_ns, "rows": len(rows)}
    if rank == 0 and not built_from(folder, key):
        build_tiny_tokenizer([r.question for r in rows] + [t for r in rows for t in r.turn_texts()], m.tiny_vocab,
                             folder)
        mark_built(folder, key)
    wait_for_built(folder, key)
    return AutoTokenizer.from_pretrained(folder)


def build_backbone(cfg: PRMTrainConfig, tokenizer) -> torch.nn.Module:
    """The backbone in float32 (the master weights), the placeholder added to ``tokenizer`` (and to the
    embeddings when the vocabulary is full)."""
    m = cfg.model
    if m.backbone == "tiny":
        if require_placeholder(tokenizer, cfg.prm.placeholder) is None:  # in the vocabulary the model is built for
            tokenizer.add_special_tokens({"additional_special_tokens": [cfg.prm.placeholder]})
        lm = build_tiny_policy(tokenizer, m.tiny_hidden, m.tiny_layers, m.tiny_heads, seed=cfg.seed,
                               max_positions=max(cfg.data.max_tokens, 64))
    else:
        from transformers import AutoModelForCausalLM

        lm = AutoModelForCausalLM.from_pretrained(m.backbone, torch_dtype=torch.float32, local_files_only=True,
                                                  attn_implementation=m.attn_impl)
    add_placeholder(tokenizer, lm, cfg.prm.placeholder)
    return lm.float().train().requires_grad_(True)


class PRMTrainer:
    """One PRM run: the data encoded once, the model in its training engine, the loop, checkpoints, evaluation."""

    def __init__(self, cfg: PRMTrainConfig, info, train_rows: list, test_rows: list, resume: bool = False):
        self.cfg, self.info = cfg, info
        self.out_dir, self.ckpt_dir = cfg.logging.output_dir, os.path.join(cfg.logging.output_dir, "checkpoints")
        if info.is_main:
            os.makedirs(self.out_dir, exist_ok=True)
            moved = None if resume else archive_previous_run(self.out_dir)
            if moved:
                self.say(f"{self.out_dir} held an earlier run (no --resume): its files moved to {moved}")
            save_config(cfg, os.path.join(self.out_dir, "config.yaml"))
        seed_everything(cfg.seed)
        self.logger = MetricLogger(self.out_dir, cfg.logging.jsonl, cfg.logging.tensorboard, cfg.logging.wandb,
                                   cfg.run_name, to_dict(cfg), enabled=info.is_main)
        self.tokenizer = load_prm_tokenizer(cfg, self.out_dir, train_rows, info.rank)
        lm = build_backbone(cfg, self.tokenizer)
        enc = PRMEncoder(self.tokenizer, cfg.prm.placeholder, cfg.data.max_tokens)
        self.train_rows, self.test_rows = train_rows, test_rows[:cfg.eval.max_trajectories or len(test_rows)]
        self.train_seqs = enc.encode_many([(r.question, r.turn_texts()) for r in self.train_rows])
        self.test_seqs = enc.encode_many([(r.question, r.turn_texts()) for r in self.test_rows])
        if enc.forged:
            self.say(f"note: {enc.forged} segments spelled the placeholder {cfg.prm.placeholder!r} as text; it was "
                     "tokenized as plain text")
        o = cfg.optim
        self.steps_per_epoch = math.ceil(len(train_rows) / o.batch_size)
        self.total_steps = min(o.epochs * self.steps_per_epoch, o.max_steps or o.epochs * self.steps_per_epoch)
        self.data_key = {"trajectories": len(train_rows), "steps_per_epoch": self.steps_per_epoch, "seed": cfg.seed}
        self.model = PRMModel(lm)
        self.engine = build_train_engine(self.model, info, cfg.distributed,
                                         adamw(lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay),
                                         o.grad_clip, compute_dtype(cfg.distributed, info, cfg.model.dtype))
        self.step = 0
        self.say(f"fastcredit.prm.train: {cfg.run_name} · {cfg.model.backbone} · {len(train_rows)} training / "
                 f"{len(self.test_rows)} held-out trajectories · {self.total_steps} steps of {o.batch_size} · "
                 f"{info.world_size} process(es) on {info.device.type} → {self.out_dir}")
        if resume:
            self._resume()

    def say(self, text: str) -> None:
        if self.info.is_main:
            write_line(text)

    def batch(self, step: int) -> list[int]:
        """The training trajectories of optimizer step ``step`` (0-based): a seeded permutation per epoch, cut in
        ``optim.batch_size`` slices; the same on every rank, and a function of the step alone (resume)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.train_seqs))
        bs = self.cfg.optim.batch_size
        return order[k * bs:(k + 1) * bs].tolist()

    def _micro_batches(self, seqs: list, mine: list[int], fallback: list[int]) -> list[tuple[list[int], float]]:
        """``(indices, scale)`` per micro-batch of this rank's ``mine``: as many on every rank (a rank with fewer
        repeats ``fallback`` with scale 0: FSDP2 and ZeRO-3 gather parameters in every forward)."""
        groups = [[mine[i] for i in g] for g in token_budget_groups([seqs[i] for i in mine],
                                                                     self.cfg.optim.micro_batch_tokens)]
        n = max_over_ranks(len(groups), self.info)
        return [(g, 1.0) for g in groups] + [(groups[0] if groups else fallback, 0.0)] * (n - len(groups))

    def _inputs(self, rows: list, seqs: list, idx: list[int]):
        dev = self.info.device
        x, cu_P = pack([seqs[i] for i in idx], dev)
        outcome_B = torch.tensor([rows[i].outcome for i in idx], dtype=torch.float32, device=dev)
        pivot_P = torch.tensor([p for i in idx for p in [0, *rows[i].pivots]], dtype=torch.int64, device=dev)
        return x, cu_P, outcome_B, pivot_P

    def train_step(self) -> dict:
        """One optimizer step over :meth:`batch`; its metrics (global)."""
        cfg, info, o = self.cfg, self.info, self.cfg.optim
        t0 = time.perf_counter()
        idx = self.batch(self.step)
        lr = o.lr * lr_factor(self.step, self.total_steps, o.warmup_ratio, o.schedule)
        self.engine.set_lr(lr)
        self.engine.zero_grad()
        norm = info.world_size / len(idx)  # each rank's loss x W / N: the ranks' mean gradient is the batch's
        sums = torch.zeros(3, dtype=torch.float64, device=info.device)  # Σ loss, Σ L_final, Σ L_gold
        for mb, scale in self._micro_batches(self.train_seqs, idx[info.rank::info.world_size], idx[:1]):
            x, cu_P, outcome_B, pivot_P = self._inputs(self.train_rows, self.train_seqs, mb)
            loss_B, parts = prm_loss(self.engine(x), cu_P, outcome_B, pivot_P, cfg.prm.lambda_g, cfg.prm.tau_g)
            self.engine.backward(loss_B.sum() * (norm * scale))
            sums += scale * torch.stack([loss_B.detach().sum(), parts["final_B"].sum(), parts["gold_B"].sum()]).double()
        sums = all_reduce_sum(sums, info).cpu() / len(idx)
        grad_norm = self.engine.clip_and_step(o.grad_clip)
        seconds = time.perf_counter() - t0
        tokens = sum(len(self.train_seqs[i].ids) for i in idx)
        return {"loss": float(sums[0]), "loss_final": float(sums[1]), "loss_gold": float(sums[2]),
                "grad_norm": grad_norm, "lr": lr, "epoch": (self.step + 1) / self.steps_per_epoch,
                "trajectories_per_s": len(idx) / seconds, "tokens_per_s": tokens / seconds, "time/step": seconds}

    @torch.no_grad()
    def predict(self) -> torch.Tensor:
        """The head's logits at every placeholder of the held-out trajectories, ``[P]`` float64 on the CPU (each
        rank scores its share; one all-reduce assembles them)."""
        seqs, info = self.test_seqs, self.info
        starts = np.cumsum([0] + [len(s.placeholders) for s in seqs])
        z_P = torch.zeros(int(starts[-1]), dtype=torch.float64)
        mine = list(range(info.rank, len(seqs), info.world_size))
        for mb, scale in self._micro_batches(seqs, mine, [0]):
            x, cu_P, _, _ = self._inputs(self.test_rows, seqs, mb)
            z = self.engine(x).double().cpu()
            if scale:
                for j, i in enumerate(mb):
                    z_P[starts[i]:starts[i + 1]] = z[int(cu_P[j]):int(cu_P[j + 1])]
        return all_reduce_sum(z_P.to(info.device), info).cpu()

    def evaluate(self) -> tuple[dict, Optional[torch.Tensor]]:
        """``(metrics, z_P)`` on the held-out trajectories; ``({}, None)`` without any."""
        if not self.test_seqs:
            return {}, None
        t0 = time.perf_counter()
        z_P = self.predict()
        rows = self.test_rows
        cu_P = torch.tensor(np.cumsum([0] + [len(r.turns) + 1 for r in rows]), dtype=torch.int64)
        outcome_B = torch.tensor([r.outcome for r in rows], dtype=torch.float64)
        pivot_P = torch.tensor([p for r in rows for p in [0, *r.pivots]], dtype=torch.int64)
        m = eval_metrics(z_P, cu_P, outcome_B, pivot_P, self.cfg.prm.lambda_g, self.cfg.prm.tau_g)
        m["time/eval"] = time.perf_counter() - t0
        return m, z_P

    def _checkpointed(self) -> tuple[dict, dict, dict]:
        state = self.engine.dcp_state()  # None: the engine saves itself (DeepSpeed)
        return ({}, {}, {NAME: self.engine}) if state is None else ({NAME: state[0]}, {NAME: state[1]}, {})

    def save(self) -> None:
        models, optims, engines = self._checkpointed()
        save_checkpoint(self.ckpt_dir, self.step, models, optims, {"data": self.data_key},
                        keep=self.cfg.logging.keep_checkpoints, engines=engines)

    def _resume(self) -> None:
        models, optims, engines = self._checkpointed()
        found = resume_checkpoint(self.ckpt_dir, models, optims, engines=engines, say=self.say)
        if found is None:
            self.say(f"--resume: no checkpoint in {self.ckpt_dir}; starting from step 0")
            return
        path, state = found
        if state.get("data") != self.data_key:
            raise ConfigError(f"--resume: {path} was trained on {state.get('data')}, this run has {self.data_key} "
                              "(data.train_path, optim.batch_size or seed changed)")
        self.step = state["step"]
        self.logger.truncate_after(self.step)
        self.say(f"resumed from {path} (step {self.step})")

    def _console(self, m: dict) -> str:
        return (f"step {self.step:>5d}/{self.total_steps} · loss {m['loss']:.4f} (final {m['loss_final']:.4f}, "
                f"gold {m['loss_gold']:.4f}) · |g| {m['grad_norm']:.3f} · lr {m['lr']:.2e} · "
                f"{m['trajectories_per_s']:.1f} traj/s · {m['tokens_per_s']:.0f} tok/s")

    def fit(self) -> dict:
        """Train to the last step (checkpoints, evaluations), then the final evaluation; returns its metrics."""
        cfg = self.cfg
        t0 = time.perf_counter()
        bar = progress_bar(total=self.total_steps, initial=self.step, desc="PRM", unit="step", leave=False,
                   disable=not (cfg.logging.progress and self.info.is_main))
        while self.step < self.total_steps:
            m = self.train_step()
            self.step += 1
            if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < self.total_steps:
                scores, _ = self.evaluate()
                m.update(scores)
                if scores:
                    self.say(f"step {self.step}: {eval_line(scores)}")
            bar.set_postfix(loss=f"{m['loss']:.4f}", refresh=False)
            bar.update(1)
            self.logger.log(self.step, m, console=False)
            if self.step % cfg.logging.log_every == 0:
                self.say(self._console(m))
            every = cfg.logging.checkpoint_every
            if (every and self.step % every == 0) or self.step == self.total_steps:
                self.save()
        bar.close()
        final, z_P = self.evaluate()
        if final:
            self.logger.log(self.step, final, console=False)
            self.say(f"after {self.step} steps: {eval_line(final)}")
        if self.info.is_main:
            self._write_eval(final, z_P, time.perf_counter() - t0)
        return final

    def _write_eval(self, final: dict, z_P: Optional[torch.Tensor], seconds: float) -> None:
        """``eval.json`` (the final metrics) and ``eval_scores.jsonl`` (f per placeholder, held-out trajectory)."""
        with open(os.path.join(self.out_dir, "eval.json"), "w") as f:
            json.dump({"step": self.step, "metrics": {k: v if math.isfinite(v) else None for k, v in final.items()},
                       "train_trajectories": len(self.train_seqs), "seconds": seconds}, f, indent=1)
        f_P = iter(torch.sigmoid(z_P).tolist() if z_P is not None else [])
        with open(os.path.join(self.out_dir, "eval_scores.jsonl"), "w") as out:
            for r, s in zip(self.test_rows, self.test_seqs):
                out.write(json.dumps({"question": r.question, "sample": r.sample, "outcome": r.outcome,
                                      "pivots": r.pivots, "f": [next(f_P) for _ in s.placeholders]}) + "\n")


def read_prm_weights(ckpt: str, model) -> str:
    """Load the PRM of the checkpoint folder ``ckpt`` (``step_N``: DCP ``model/`` of FSDP2, or DeepSpeed's
    ``engine/prm``) into ``model`` (a PRMModel) in place, in this one process; returns what was read."""
    from fastcredit.distributed.engine import hf_name
    from fastcredit.distributed.weights import check_names_and_shapes, check_tied

    own, zero, folder = model.state_dict(), os.path.join(ckpt, "engine", NAME), os.path.join(ckpt, "model")
    if os.path.isdir(zero):  # the fp32 master weights, consolidated from every rank's partition
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(zero), tag=NAME, lazy_mode=True)
        keys = {hf_name(k): k for k in state}
        for names in check_names_and_shapes(model, {n: tuple(state[k].shape) for n, k in keys.items()}, zero):
            tensors = [state[keys[n]].contiguous() for n in names]
            check_tied(names, tensors, zero)
            own[names[0]].copy_(tensors[0])
        return f"{len(keys)} tensors from DeepSpeed ZeRO {zero}"
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix, reader = f"{NAME}.model.", dcp.FileSystemReader(folder)
    meta = reader.read_metadata().state_dict_metadata
    keys = {hf_name(k[len(prefix):]): k for k, m in meta.items()
            if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    if not keys:
        raise ExportError(f"{folder}/.metadata has no {prefix}* tensors: not a PRM checkpoint")
    groups = check_names_and_shapes(model, {n: tuple(meta[k].size) for n, k in keys.items()}, folder)
    targets = {}
    for names in groups:  # the first copy straight into the model, a tied twin beside it for the check
        targets[keys[names[0]]] = own[names[0]]
        targets.update({keys[n]: torch.empty_like(own[n]) for n in names[1:]})
    with warnings.catch_warnings():  # "torch.distributed is disabled": one process reads, as intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(targets, storage_reader=reader, no_dist=True)
    for names in groups:
        check_tied(names, [targets[keys[n]] for n in names], folder)
    return f"{len(keys)} tensors from DCP {folder}"


def export_prm(cfg: PRMTrainConfig, tokenizer) -> str:
    """Write ``<output_dir>/export`` (``fastcredit.models.prm.save_prm``) from the run's last checkpoint (verified
    against its manifest), in one process; returns the folder."""
    name_deepspeed_accelerator()  # transformers' save_pretrained imports DeepSpeed (through accelerate)
    ckpt, model = find_checkpoint(cfg.logging.output_dir), PRMModel(build_backbone(cfg, tokenizer))
    what = read_prm_weights(ckpt, model)
    out = save_prm(os.path.join(cfg.logging.output_dir, EXPORT), model.lm.to(DTYPES[cfg.export.dtype]),
                   model.value_head, tokenizer, cfg.prm.placeholder, cfg.data.max_tokens,
                   {"checkpoint": os.path.abspath(ckpt), "backbone": cfg.model.backbone, "lambda_g": cfg.prm.lambda_g,
                    "tau_g": cfg.prm.tau_g})
    print(f"exported {os.path.basename(ckpt)} to {out} ({what})", flush=True)
    return out


DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "configs", "prm.yaml")
SYNOPSIS = "python -m fastcredit.prm.train [--config X.yaml] [key=value ...] [--resume | --export-only]"


def parser():
    """The command's line: the config, its overrides (PRMTrainConfig's keys) and the run's flags."""
    p = command_parser("python -m fastcredit.prm.train", __doc__, usage=SYNOPSIS, keys=PRMTrainConfig,
                       config_default=DEFAULT_CONFIG, help_prefixes="optim, prm.tau_g",
                       config="the run's YAML (values only; default configs/prm.yaml); key=value overrides apply "
                              "after it")
    p.add_argument("--resume", action="store_true",
                   help="continue from the run folder's last checkpoint (data position, RNG; metrics.jsonl cut back)")
    p.add_argument("--export-only", action="store_true",
                   help="write <output_dir>/export from the run's last checkpoint and exit (one process)")
    return p


def main(argv: Optional[list] = None) -> int:
    args = parser().parse_args(argv)
    quiet_library_bars()  # a log gets plain progress lines, not the libraries' bar frames
    resume, export_only = args.resume, args.export_only
    try:
        cfg = load_config(args.config, args.overrides, root=PRMTrainConfig)
        cfg.check_paths(data=not export_only)
        if export_only:
            export_prm(cfg, load_prm_tokenizer(cfg, cfg.logging.output_dir))
            return 0
        train_rows, test_rows = load_rows(cfg)
    except (ConfigError, DataError, ExportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    info = init_distributed(cfg.distributed.backend, cfg.distributed.shard_size)
    with rank_failure_ends_job(info):  # under torchrun a failing rank must not leave the others waiting on it
        return _train(cfg, info, train_rows, test_rows, resume)


def _train(cfg, info, train_rows, test_rows, resume: bool) -> int:
    try:
        trainer, code = PRMTrainer(cfg, info, train_rows, test_rows, resume), 0
    except ValueError as exc:  # ConfigError: a checkpoint of other data; a trajectory past data.max_tokens
        print(f"error: {exc}", file=sys.stderr)
        shutdown(info, 2)
        return 2
    try:
        trainer.fit()
        if info.is_main:
            png = plot_curves(trainer.logger.path, os.path.join(trainer.out_dir, "curves.png"), cfg.run_name) \
                if trainer.logger.path else None
            trainer.say(f"metrics: {trainer.logger.path}\ncurves:  {png}\neval:    "
                        f"{os.path.join(trainer.out_dir, 'eval.json')}")
            # NOTE: in a fresh process: with a DeepSpeed engine's state in this one, building the model hangs
            run_cfg = os.path.join(trainer.out_dir, "config.yaml")
            code = subprocess.run([sys.executable, "-m", "fastcredit.prm.train", "--config", run_cfg, "--export-only"]
                                  ).returncode
    finally:
        trainer.logger.close()
    shutdown(info, code)
    return code


if __name__ == "__main__":
    from fastcredit.distributed.process_group import exit_process

    exit_process(main())
