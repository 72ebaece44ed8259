"""What the chosen estimator needs (a critic, a judge, a PRM, ProCeed rollouts) is checked before a run: by the
training command right after its config loads, and by the trainer before it builds anything."""
import glob
import os
import re
import subprocess
import sys

import pytest

from fastcredit.config import ConfigError, load_config
from fastcredit.credit.needs import JUDGE_SETTINGS, check_needs
from fastcredit.credit.registry import estimator_names, estimator_needs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UNMET = [  # (overrides, message)
    (["credit.estimator=criticsearch"],
     "credit.estimator=criticsearch needs a critic: set judges.backend to colocated, http or oracle"),
    (["credit.estimator=cwgrpo"],
     "credit.estimator=cwgrpo needs a judge: set judges.backend to colocated, http or oracle"),
    (["credit.estimator=pica"], "credit.estimator=pica needs a process reward model: set judges.prm"),
    (["credit.estimator=proceed", "judges.backend=oracle"],
     "credit.estimator=proceed needs rollout.proceed.enabled=true"),
]


@pytest.mark.parametrize("overrides, message", UNMET, ids=[o[0].split("=")[1] for o, _ in UNMET])
def test_an_unmet_need_is_refused_naming_the_key(overrides, message):
    cfg = load_config(None, overrides)  # the loader no longer asks: the config package knows no estimators
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        check_needs(cfg)


def test_met_needs_pass_for_every_estimator():
    met = {"criticsearch": ["judges.backend=oracle"], "cwgrpo": ["judges.backend=http"], "pica": ["judges.prm=oracle"],
           "proceed": ["judges.backend=oracle", "rollout.proceed.enabled=true"]}
    assert set(JUDGE_SETTINGS) == {estimator_needs(n).judge for n in estimator_names()} - {None}
    for name in estimator_names():
        check_needs(load_config(None, [f"credit.estimator={name}", *met.get(name, [])]))


@pytest.mark.parametrize("path", [p for p in sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
                                  if not os.path.basename(p).startswith("prm")], ids=os.path.basename)
def test_every_shipped_config_meets_its_estimators_needs(path):
    check_needs(load_config(path))


def test_the_training_command_refuses_before_anything_loads(tmp_path):
    out = tmp_path / "run"
    code = ("import sys\nfrom fastcredit.train import main\n"
            f"rc = main(['--config', 'configs/debug.yaml', 'credit.estimator=cwgrpo', 'logging.output_dir={out}'])\n"
            "print('RESULT', rc, 'fastcredit.trainer.loop' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert "RESULT 2 False" in proc.stdout, proc.stderr[-2000:]
    assert "config error: credit.estimator=cwgrpo needs a judge: set judges.backend" in proc.stderr
    assert not out.exists()


def test_the_runs_one_check_refuses_too(tmp_path):
    """``check_run``: what the training command (and bench/bench_step.py, bench/start_figures.py) runs once before
    a Trainer is built; the Trainer takes the config it passed."""
    from fastcredit.trainer.checks import check_run

    cfg = load_config(os.path.join(ROOT, "configs", "debug.yaml"),
                      ["credit.estimator=pica", f"logging.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="credit.estimator=pica needs a process reward model"):
        check_run(cfg)
    assert not (tmp_path / "run").exists()
