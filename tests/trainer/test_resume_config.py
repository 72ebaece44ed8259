"""``--resume`` refuses a run whose saved config differs in a key that changes its results, naming the key; keys
that only extend or observe a run may change."""
import os

import pytest

from fastcredit.config import ConfigError, load_config, save_config
from fastcredit.trainer.checks import check_resume
from tests.commands import run_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEBUG = os.path.join(ROOT, "configs", "debug.yaml")


def saved_run(tmp_path, *overrides):
    cfg = load_config(DEBUG, [f"logging.output_dir={tmp_path}", *overrides])
    save_config(cfg, str(tmp_path / "config.yaml"))
    return cfg


def test_a_changed_result_key_is_refused_by_name(tmp_path):
    saved_run(tmp_path)
    with pytest.raises(ConfigError) as exc:
        check_resume(load_config(DEBUG, [f"logging.output_dir={tmp_path}", "optim.lr=0.5", "credit.estimator=ppo"]))
    msg = str(exc.value)
    assert "optim.lr: 0.001 → 0.5" in msg and "credit.estimator: 'grpo' → 'ppo'" in msg and "config.yaml" in msg


def test_extending_and_observing_keys_may_change(tmp_path):
    saved_run(tmp_path)
    check_resume(load_config(DEBUG, [f"logging.output_dir={tmp_path}", "optim.total_steps=9", "logging.log_every=5",
                                     "logging.checkpoint_every=3", "eval.every=2", "run_name=longer"]))
    check_resume(load_config(DEBUG, [f"logging.output_dir={tmp_path / 'fresh'}", "optim.lr=0.5"]))  # nothing saved


def test_the_training_command_refuses_before_anything_starts(tmp_path):
    saved_run(tmp_path)
    proc = run_main("fastcredit.train", ["--config", DEBUG, "--resume", f"logging.output_dir={tmp_path}",
                                         "rollout.n_samples=4"])
    assert proc.returncode == 2 and "rollout.n_samples: 2 → 4" in proc.stderr, proc.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["config.yaml"]  # nothing built, nothing moved
    assert load_config(str(tmp_path / "config.yaml")).rollout.n_samples == 2  # the saved config is kept
