"""Train a search agent with turn-level credit assignment.

    python -m fastcredit.train                                  # embedded default: configs/demo.yaml on a CPU
    python -m fastcredit.train --config configs/criticsearch.yaml optim.total_steps=800
    torchrun --nproc_per_node=8 -m fastcredit.train --config configs/cwgrpo.yaml
    torchrun --nproc_per_node=8 -m fastcredit.train --config configs/cwgrpo.yaml distributed.engine=deepspeed  # ZeRO-3
    python -m fastcredit.train --config configs/debug.yaml --resume      # continue from the last checkpoint
    python -m fastcredit.train --config configs/debug.yaml --profile     # torch.profiler trace + phase table
    nsys profile --capture-range=cudaProfilerApi python -m fastcredit.train --profile ...     # where nsys exists
    python -m fastcredit.train --config configs/criticsearch.yaml --memory-report --gpu-gib 80 --gpus 8

Settings come from the YAML (default: configs/demo.yaml), then key=value overrides. Each step
prints a line of the console table (reward, EM, KL, gradient norm, seconds per phase); the run
folder (logging.output_dir) gets metrics.jsonl, curves.png and the checkpoints. At the end the
held-out EM before and after training is printed.

``--memory-report`` prints the GPU memory budget of every phase and the host RAM each node
needs beside it (``fastcredit.trainer.memory``) and exits before anything loads: 0 when it fits, 2
when it cannot run.
Exit status: 0 done, 2 bad config (or a memory report that cannot run), 3 stopped by the collapse guard.

The training loop is :class:`fastcredit.trainer.loop.Trainer`; this module parses the command line,
starts and ends the process group, and reports.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from fastcredit.config.help import format_usage, handle_help
from fastcredit.config import ConfigError, load_config, parse_cli
from fastcredit.credit.needs import check_needs
from fastcredit.distributed.process_group import init_distributed, rank_failure_ends_job, shutdown
from fastcredit.runtime.progress import quiet_library_bars
from fastcredit.trainer.memory.command import memory_report, report_flags

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo.yaml")


SYNOPSIS = """python -m fastcredit.train [--config X.yaml] [key=value ...] [--resume] [--profile]
       python -m fastcredit.train [--config X.yaml] [key=value ...] --memory-report [--gpu-gib G] [--gpus N]
                                  [--host-gib H] [--gpus-per-node N]"""
FLAGS = """
--config X.yaml       the run's YAML (values only; default configs/demo.yaml); key=value overrides apply after it
--resume              continue from the run folder's last checkpoint (metrics.jsonl is cut back to it)
--profile             three steps profiled: a torch.profiler trace and its per-phase table in RUN/profile/, and
                      the CUDA profiler range nsys captures (nsys --capture-range=cudaProfilerApi) where it runs
--memory-report       print the GPU and host memory budget of each phase and exit (nothing loads); exit 2 if it
                      cannot run
  --gpu-gib G         GPU size in GiB (default: the local GPU's, else 80)
  --gpus N            GPUs, one rank each (default: torchrun's WORLD_SIZE, else distributed.gpus, else 1)
  --host-gib H        host RAM of a node in GiB (default: this machine's MemTotal where it has a GPU for each
                      of a node's ranks, else an 8 x H100 DGX node's 2048; the report says which)
  --gpus-per-node N   ranks on a node (default: torchrun's LOCAL_WORLD_SIZE, else the smaller of the GPUs and 8)
  --index-rows N --index-dim D   retrieval index size when its file is not here
-h, --help [PREFIX]   this help; with PREFIX the config keys under it (rollout, optim.lr, all)
"""
USAGE = format_usage(SYNOPSIS, __doc__, FLAGS)


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    handle_help(argv, USAGE)
    quiet_library_bars()  # a log gets plain progress lines, not the libraries' bar frames
    resume, profile = "--resume" in argv, "--profile" in argv
    argv = [a for a in argv if a not in ("--resume", "--profile")]
    try:
        report, argv = report_flags(argv)
        path, overrides = parse_cli(argv)
        cfg = load_config(path or DEFAULT_CONFIG, overrides)
        if report is None:  # on every rank, before the process group starts: a wrong path named by its key
            from fastcredit.trainer.checks import check_run

            check_run(cfg, resume)
        else:  # the plan reads the estimator's needs; the paths are the target machine's
            check_needs(cfg)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if report is not None:
        return memory_report(cfg, report)
    info = init_distributed(cfg.distributed.backend, cfg.distributed.shard_size)
    with rank_failure_ends_job(info):  # under torchrun a failing rank must not leave the others waiting on it
        if cfg.distributed.placement == "split":
            return split_main(cfg, info, resume, profile)
        return colocated_main(cfg, info, resume, profile)


def colocated_main(cfg, info, resume: bool, profile: bool) -> int:
    """Every rank rolls out and trains (``fastcredit.trainer.loop.Trainer``), to the end."""
    from fastcredit.trainer.loop import Trainer

    # every rank trips the collapse guard on the same (rank-averaged) metrics: they leave together
    return _fit(Trainer(cfg, info, resume=resume, profile=profile), info, info.is_main, lambda: shutdown(info, 3))


def split_main(cfg, info, resume: bool, profile: bool) -> int:
    """``distributed.placement=split``: this rank's role (``fastcredit.trainer.split``), run to the end."""
    from fastcredit.distributed.split import SplitError, split_layout
    from fastcredit.trainer.split import RolloutWorker, SplitTrainer

    try:
        layout = split_layout(info, cfg.distributed.rollout_ranks, cfg.optim.batch_prompts)
    except SplitError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if cfg.rollout.engine == "vllm":  # vLLM's groups span the job: every rank makes them, engine or not
        from fastcredit.rollout.engines.vllm import parallel_state_on_every_rank

        parallel_state_on_every_rank(info.rank, info.world_size, info.local_rank, info.device,
                                     engine_here=layout.role == "rollout")
    if layout.role == "rollout":
        RolloutWorker(cfg, layout).run()
        shutdown(info)
        return 0
    # the rollout ranks wait for weights that will not come after a collapse: torchrun stops them
    return _fit(SplitTrainer(cfg, layout, resume=resume, profile=profile), info, layout.info.is_main,
                lambda: os._exit(3))


def _fit(trainer, info, main: bool, on_collapse) -> int:
    """Train to the end; the held-out figures and where the metrics went on the ``main`` rank; status 3 (through
    ``on_collapse``) when the collapse guard stops the run."""
    from fastcredit.trainer.loop import CollapseError

    try:
        summary = trainer.fit()
    except CollapseError as exc:
        trainer.say(f"error: {exc}")
        sys.stdout.flush()
        on_collapse()
        return 3
    finally:
        trainer.logger.close()
    if main:
        trainer.report(summary)
    shutdown(info)
    return 0


if __name__ == "__main__":
    from fastcredit.distributed.process_group import exit_process

    exit_process(main())
