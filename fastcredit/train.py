"""Train a search agent with turn-level credit assignment.

    python -m fastcredit.train                                  # embedded default: configs/demo.yaml on a CPU
    python -m fastcredit.train --config configs/criticsearch.yaml optim.total_steps=800
    torchrun --nproc_per_node=8 -m fastcredit.train --config configs/cwgrpo.yaml
    torchrun --nproc_per_node=8 -m fastcredit.train --config configs/cwgrpo.yaml distributed.engine=deepspeed  # ZeRO-3
    python -m fastcredit.train --config configs/debug.yaml --resume      # continue from the last checkpoint
    nsys profile --capture-range=cudaProfilerApi python -m fastcredit.train --profile ...

``--help`` lists every config key. The training loop is :class:`fastcredit.trainer.Trainer`;
this module parses the command line, starts and ends the process group, and reports.
Exit status: 0 done, 2 bad config, 3 stopped by the collapse guard.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from fastcredit.config import ConfigError, load_config, parse_cli
from fastcredit.distributed.process_group import init_distributed, shutdown

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo.yaml")


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    resume, profile = "--resume" in argv, "--profile" in argv
    argv = [a for a in argv if a not in ("--resume", "--profile")]
    try:
        path, overrides = parse_cli(argv)
        cfg = load_config(path or DEFAULT_CONFIG, overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    from fastcredit.trainer import CollapseError, Trainer

    info = init_distributed(cfg.distributed.backend, cfg.distributed.shard_size)
    trainer = Trainer(cfg, info, resume=resume, profile=profile)
    try:
        summary = trainer.fit()
    except CollapseError as exc:
        trainer.say(f"error: {exc}")
        shutdown(info, 3)
        return 3
    finally:
        trainer.logger.close()
    if info.is_main:
        _report(trainer, summary)
    shutdown(info)
    return 0


def _report(trainer, summary: dict) -> None:
    """Held-out EM before and after, and where the metrics and curves are."""
    from fastcredit.tracking import plot_metrics

    before, after = summary.get("em_before"), summary.get("em_after")
    if after is not None:
        print(f"held-out EM: {'n/a' if before is None else f'{before:.3f}'} before -> {after:.3f} after "
              f"{trainer.step} steps")
    if trainer.logger.path and os.path.exists(trainer.logger.path):
        png = plot_metrics(trainer.logger.path, os.path.join(trainer.out_dir, "curves.png"),
                           keys=("reward", "em", "eval/em"), title=trainer.cfg.run_name)
        print(f"metrics: {trainer.logger.path}\ncurves:  {png}")


if __name__ == "__main__":
    sys.exit(main())
