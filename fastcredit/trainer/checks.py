"""What a training run checks of its config, once, before anything loads or a process group starts.

    check_run(cfg, resume, world_size=2)  # the needs, the local paths, the ranks, with --resume the saved settings
    check_run(cfg, local=False)           # the estimator's needs alone: a plan for another machine (--memory-report)

The training command runs it on every rank before ``init_distributed`` (a ConfigError there exits 2 on every rank
together); so do the benchmarks that build a Trainer themselves. The Trainer and the builders take the config it
passed and do not check again.
"""
from __future__ import annotations

import os
from typing import Optional

from fastcredit.config import ConfigError, TrainConfig, config_drift, load_config
from fastcredit.config.checks import check_paths
from fastcredit.credit.needs import check_needs


# What a resumed run may change: keys that extend it (more steps), observe it (logging, evaluation cadence) or
# only plan it (distributed.gpus).
RESUME_MAY_CHANGE = ("optim.total_steps", "logging.", "eval.every", "run_name", "distributed.gpus")


def check_run(cfg: TrainConfig, resume: bool = False, local: bool = True, world_size: Optional[int] = None) -> None:
    """Every check a training run makes of its config, once, before anything loads or a process group starts: the
    estimator's needs (a judge, a PRM, ProCeed rollouts: ``fastcredit.credit.needs``), the local paths it names
    (``fastcredit.config.checks.check_paths``), that the step's prompts share out over ``world_size`` ranks (when
    given: :func:`check_world`), and with ``resume`` that the saved run was made with these settings
    (:func:`check_resume`). ``local=False``: the config is planned for another machine (``--memory-report``), whose
    paths and runs are not here: its needs alone. A ConfigError names what is wrong."""
    check_needs(cfg)
    if not local:
        return
    check_paths(cfg)
    if world_size is not None:
        check_world(cfg, world_size)
    if resume:
        check_resume(cfg)  # before the saved config.yaml is replaced


def check_world(cfg: TrainConfig, world_size: int) -> None:
    """A colocated run's ``world_size`` ranks each roll out ``optim.batch_prompts / world_size`` prompts a step: a
    count that does not divide is refused (it would drop the remainder), naming both numbers. The split placement's
    rollout ranks are checked when the job is laid out (``fastcredit.distributed.split.split_layout``)."""
    prompts = cfg.optim.batch_prompts
    if cfg.distributed.placement == "colocated" and prompts % world_size:
        near = sorted({n for n in (prompts - prompts % world_size, prompts - prompts % world_size + world_size) if n})
        raise ConfigError(f"optim.batch_prompts={prompts} is not a multiple of the {world_size} ranks: each rank rolls "
                          f"out an equal share of a step's prompts, and {prompts % world_size} would be dropped; set "
                          f"it to a multiple of {world_size} ({' or '.join(map(str, near))}) or run on a number of "
                          f"ranks that divides {prompts}")


def check_resume(cfg: TrainConfig) -> None:
    """``--resume`` continues the run saved in ``logging.output_dir`` only with the settings it was made with: a
    ConfigError names every other key whose value differs from the saved ``config.yaml``."""
    saved = os.path.join(cfg.logging.output_dir, "config.yaml")
    if not os.path.exists(saved):
        return
    try:
        before = load_config(saved)
    except ConfigError as exc:
        raise ConfigError(f"--resume: the run's saved config does not load ({exc})") from exc
    drift = config_drift(before, cfg, ignore=RESUME_MAY_CHANGE)
    if drift:
        may = ", ".join(k + "*" if k.endswith(".") else k for k in RESUME_MAY_CHANGE)
        raise ConfigError(f"--resume: {saved} was made with other settings: {'; '.join(drift)}. A resumed run may "
                          f"change only {may}; start a new run without --resume (the old one moves to previous/) or "
                          "in another logging.output_dir")
