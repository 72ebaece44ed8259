"""A colocated run's prompts share out evenly over its ranks: ``optim.batch_prompts`` that the world size does not
divide is refused before anything starts, naming both numbers (each rank once took ``batch_prompts // ranks``
prompts and the rest were dropped without a word)."""
import os

import pytest

from fastcredit.config import ConfigError, load_config
from fastcredit.trainer.checks import check_run
from tests.commands import run_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEBUG = os.path.join(ROOT, "configs", "debug.yaml")


def test_an_indivisible_batch_is_refused_with_both_numbers(tmp_path):
    cfg = load_config(DEBUG, [f"logging.output_dir={tmp_path}", f"data.world_dir={tmp_path / 'world'}"])
    assert cfg.optim.batch_prompts == 4
    with pytest.raises(ConfigError) as exc:
        check_run(cfg, world_size=3)
    msg = str(exc.value)
    assert "optim.batch_prompts=4 is not a multiple of the 3 ranks" in msg and "1 would be dropped" in msg
    assert "(3 or 6)" in msg
    for ranks in (1, 2, 4):
        check_run(cfg, world_size=ranks)


def test_the_split_placement_is_laid_out_by_its_rollout_ranks(tmp_path):
    """There the training ranks roll out nothing: the split layout checks the prompts against its rollout ranks."""
    cfg = load_config(DEBUG, [f"logging.output_dir={tmp_path}", "distributed.placement=split"])
    check_run(cfg, world_size=3)


def test_the_training_command_refuses_before_the_process_group(tmp_path):
    """torchrun's WORLD_SIZE is read before the group starts: no rank waits for the others to find the error."""
    env = {**os.environ, "WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0"}
    proc = run_main("fastcredit.train", ["--config", DEBUG, f"logging.output_dir={tmp_path}",
                                         f"data.world_dir={tmp_path / 'world'}"], env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config error: optim.batch_prompts=4 is not a multiple of the 3 ranks" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
