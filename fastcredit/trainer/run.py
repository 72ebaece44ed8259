"""A training run's folder and what it writes there, opened before anything is built.

    run = open_run(cfg, info, resume)   # the folder (an earlier run moved aside), config.yaml, seeds, the metric log

The Trainer and its collaborators (the batch source, the weights sink: ``fastcredit.trainer.placement``) share
it: they log to the same ``metrics.jsonl``, time their phases on the same step timer and print on rank 0's console.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from fastcredit.config import TrainConfig, save_config, to_dict
from fastcredit.distributed.process_group import DistInfo
from fastcredit.runtime.files import seed_everything
from fastcredit.runtime.host_memory import host_memory_note
from fastcredit.runtime.profiling import PhaseTimer
from fastcredit.runtime.tracking import MetricLogger, archive_previous_run, write_line


@dataclass
class Run:
    """One run on this rank: its ranks (``info``: the training ranks' DistInfo), its folder, its metric log (rank 0
    writes) and the timer of the step's phases."""

    info: DistInfo
    out_dir: str
    logger: MetricLogger
    timer: PhaseTimer

    @property
    def ckpt_dir(self) -> str:
        return os.path.join(self.out_dir, "checkpoints")

    def say(self, text: str) -> None:
        """A line on rank 0's console, above the progress bar when one is showing."""
        if self.info.is_main:
            write_line(text)


def open_run(cfg: TrainConfig, info: DistInfo, resume: bool = False) -> Run:
    """The run of ``cfg`` (as :func:`~fastcredit.trainer.checks.check_run` passed it) on this rank: rank 0 makes
    ``logging.output_dir``, moves an earlier run's files aside (not with ``resume``) and saves ``config.yaml``;
    every rank seeds its generators from ``cfg.seed``, opens the metric log and applies
    ``distributed.keep_host_memory``; rank 0 prints the run's first lines."""
    out_dir = cfg.logging.output_dir
    if info.is_main:
        os.makedirs(out_dir, exist_ok=True)
        moved = None if resume else archive_previous_run(out_dir)
        if moved:
            print(f"{out_dir} held an earlier run (no --resume): its metrics and checkpoints moved to {moved}",
                  flush=True)
        save_config(cfg, os.path.join(out_dir, "config.yaml"))
    seed_everything(cfg.seed)
    logger = MetricLogger(out_dir, cfg.logging.jsonl, cfg.logging.tensorboard, cfg.logging.wandb, cfg.run_name,
                          to_dict(cfg), enabled=info.is_main)
    run = Run(info, out_dir, logger, PhaseTimer())
    run.say(f"fastcredit.train: {cfg.run_name} · estimator {cfg.credit.estimator} · {info.world_size} "
            f"process(es) on {info.device.type} → {out_dir}")
    note = host_memory_note(cfg.distributed.keep_host_memory, info.device.type == "cpu")
    if note:
        run.say(note)
    return run
