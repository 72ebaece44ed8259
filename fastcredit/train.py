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

The training loop is :class:`fastcredit.trainer.loop.Trainer`, built by ``fastcredit.trainer.build``; this module
parses the command line, starts and ends the process group, and reports.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from fastcredit.config import ConfigError, load_config
from fastcredit.distributed.process_group import init_distributed, rank_failure_ends_job, shutdown, world_size_here
from fastcredit.runtime.progress import quiet_library_bars
from fastcredit.trainer.build import colocated_trainer, memory_report_request, split_trainer, train_parser
from fastcredit.trainer.checks import check_run
from fastcredit.trainer.memory.request import memory_report

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo.yaml")


def parser():
    """The command's line: :func:`fastcredit.trainer.build.train_parser`, with this module's docstring as its help."""
    return train_parser(__doc__)


def main(argv: Optional[list] = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    report = memory_report_request(p, args)
    quiet_library_bars()  # a log gets plain progress lines, not the libraries' bar frames
    try:
        cfg = load_config(args.config or DEFAULT_CONFIG, args.overrides)
        # on every rank, before the process group starts: a wrong path named by its key; a plan's paths are the
        # target machine's (it reads the estimator's needs alone)
        check_run(cfg, args.resume, local=report is None, world_size=None if report else world_size_here())
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if report is not None:
        return memory_report(cfg, report)
    info = init_distributed(cfg.distributed.backend, cfg.distributed.shard_size)
    with rank_failure_ends_job(info):  # under torchrun a failing rank must not leave the others waiting on it
        if cfg.distributed.placement == "split":
            return split_main(cfg, info, args)
        return colocated_main(cfg, info, args)


def colocated_main(cfg, info, args) -> int:
    """Every rank rolls out and trains (``fastcredit.trainer.build.colocated_trainer``), to the end."""
    trainer = colocated_trainer(cfg, info, args.resume, args.profile)
    # every rank trips the collapse guard on the same (rank-averaged) metrics: they leave together
    return _fit(trainer, info, info.is_main, lambda: shutdown(info, 3))


def split_main(cfg, info, args) -> int:
    """``distributed.placement=split``: this rank's role (``fastcredit.trainer.split``), run to the end."""
    from fastcredit.distributed.split import SplitError, split_layout
    from fastcredit.trainer.split import RolloutWorker

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
    trainer = split_trainer(cfg, layout, args.resume, args.profile)
    # the rollout ranks wait for weights that will not come after a collapse: torchrun stops them
    return _fit(trainer, info, layout.info.is_main, lambda: os._exit(3))


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
