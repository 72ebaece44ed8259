"""A run's Trainer, built from its config, and the training command's memory-report flags.

    trainer = colocated_trainer(cfg, info)                  # every rank rolls out and trains in turn
    trainer = split_trainer(cfg, layout)                    # distributed.placement=split: a training rank
    summary = trainer.fit()

    add_memory_report_flags(parser)                         # --memory-report and its options, on the command's parser
    request = memory_report_request(parser, args)           # fastcredit.trainer.memory.request.ReportRequest or None

The training command (``python -m fastcredit.train``), the benchmarks and the tests build a Trainer here; each
builder takes a config ``fastcredit.trainer.checks.check_run`` has passed. Nothing loads at import: the memory report
plans without torch.
"""
from __future__ import annotations

import argparse
from typing import Optional

from fastcredit.config.command_line import command_parser
from fastcredit.trainer.memory.request import ReportRequest

# --memory-report's options: (flag, ReportRequest field, type, metavar, help)
REPORT_OPTIONS = (
    ("--gpu-gib", "gpu_gib", float, "G", "GPU size in GiB (default: the local GPU's, else 80)"),
    ("--gpus", "gpus", int, "N", "GPUs, one rank each (default: torchrun's WORLD_SIZE, else distributed.gpus, else 1)"),
    ("--host-gib", "host_gib", float, "H", "host RAM of a node in GiB (default: this machine's MemTotal where it has a "
                                           "GPU for each of a node's ranks, else an 8 x H100 DGX node's 2048; the "
                                           "report says which)"),
    ("--gpus-per-node", "gpus_per_node", int, "N", "ranks on a node (default: torchrun's LOCAL_WORLD_SIZE, else the "
                                                   "smaller of the GPUs and 8)"),
    ("--index-rows", "index_rows", int, "N", "retrieval index rows when its file is not here"),
    ("--index-dim", "index_dim", int, "D", "retrieval index dimension when its file is not here"),
)


def colocated_trainer(cfg, info, resume: bool = False, profile: bool = False, collect=None):
    """The Trainer of a colocated rank (``info``: its DistInfo): both roles here
    (``fastcredit.trainer.parts.build_colocated``), its batches collected by this rank's own engine, searcher and
    judges, its weights synced into that engine before each rollout (``fastcredit.trainer.placement``).
    ``collect(rollout_parts, cfg, info, timer)``: the batch source (None: ``LocalCollect``; a benchmark passes one
    that records the batches)."""
    from fastcredit.trainer.loop import Trainer
    from fastcredit.trainer.parts import build_colocated
    from fastcredit.trainer.placement import EngineSync, LocalCollect
    from fastcredit.trainer.run import open_run

    run = open_run(cfg, info, resume)
    training, rollout = build_colocated(cfg, info, run.out_dir, run.say)
    source = (collect or LocalCollect)(rollout, cfg, info, run.timer)
    return Trainer(cfg, run, training, source, EngineSync(), resume=resume, profile=profile)


def split_trainer(cfg, layout, resume: bool = False, profile: bool = False):
    """The Trainer of a split placement's training rank (``layout``: this rank's view of the split): the training
    side alone, its batches from the rollout ranks over the mailbox, its weights streamed to them
    (``fastcredit.trainer.split``)."""
    from fastcredit.trainer.loop import Trainer
    from fastcredit.trainer.parts import build_training_rank
    from fastcredit.trainer.run import open_run
    from fastcredit.trainer.split import MailboxCollect, RolloutStream

    run = open_run(cfg, layout.info, resume)
    training = build_training_rank(cfg, layout, run.out_dir, run.say)
    source = MailboxCollect(cfg, layout, run, len(training.shared.data.train))
    sink = RolloutStream(cfg, layout, training.training.policy, run.timer)
    return Trainer(cfg, run, training, source, sink, resume=resume, profile=profile)


TRAIN_SYNOPSIS = """python -m fastcredit.train [--config X.yaml] [key=value ...] [--resume] [--profile]
       python -m fastcredit.train [--config X.yaml] [key=value ...] --memory-report [--gpu-gib G] [--gpus N]
                                  [--host-gib H] [--gpus-per-node N]"""


def train_parser(doc: str = "") -> argparse.ArgumentParser:
    """The training command's line (``python -m fastcredit.train``): the config, its overrides, the run's flags and
    the memory report's. ``doc``: the command's help prose (its module docstring)."""
    p = command_parser("python -m fastcredit.train", doc, usage=TRAIN_SYNOPSIS, help_prefixes="rollout, optim.lr",
                       config="the run's YAML (values only; default configs/demo.yaml); key=value overrides apply "
                              "after it")
    p.add_argument("--resume", action="store_true",
                   help="continue from the run folder's last checkpoint (metrics.jsonl is cut back to it)")
    p.add_argument("--profile", action="store_true",
                   help="three steps profiled: a torch.profiler trace and its per-phase table in RUN/profile/, and "
                        "the CUDA profiler range nsys captures (nsys --capture-range=cudaProfilerApi) where it runs")
    add_memory_report_flags(p)
    return p


def add_memory_report_flags(parser: argparse.ArgumentParser) -> None:
    """``--memory-report`` and its options, as a group of the training command's flags."""
    group = parser.add_argument_group("memory report")
    group.add_argument("--memory-report", action="store_true",
                       help="print the GPU and host memory budget of each phase and exit (nothing loads); exit 2 if "
                            "it cannot run")
    for flag, field, kind, metavar, text in REPORT_OPTIONS:
        group.add_argument(flag, dest=field, type=kind, metavar=metavar, help=text)


def memory_report_request(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Optional[ReportRequest]:
    """The report ``args`` (read by ``parser``, with :func:`add_memory_report_flags`) asks for, or None when none is
    asked for; its options without ``--memory-report`` are a usage error (exit 2) that names them."""
    given = {flag: getattr(args, field) for flag, field, *_ in REPORT_OPTIONS if getattr(args, field) is not None}
    if not args.memory_report:
        if given:
            parser.error(f"{', '.join(given)} only apply with --memory-report")
        return None
    return ReportRequest(**{field: getattr(args, field) for _, field, *_ in REPORT_OPTIONS})
