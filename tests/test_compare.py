"""``python -m fastcredit.compare`` end to end on the debug config: every run trains, a second start keeps the
finished runs, the report has a row per method and noisy variant, and one seed gives the same numbers twice."""
import json
import os
import subprocess
import sys

import pytest

from fastcredit.compare import summarize_run, variants
from fastcredit.compare_report import mean_interval, steps_to, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["data.toy.num_people=80", "data.toy.num_companies=20", "data.toy.num_questions=60", "eval.questions=4",
         "eval.every=1", "optim.total_steps=2", "logging.checkpoint_every=1", "warmstart.enabled=true",
         "warmstart.epochs=1", "warmstart.questions=8"]


def compare(tmp, runs, *args):
    cmd = [sys.executable, "-m", "fastcredit.compare", "--config", os.path.join(ROOT, "configs", "debug.yaml"),
           "--runs", str(runs), "--out", str(tmp / "out"), f"data.world_dir={tmp / 'world'}", *SMALL, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_compare_runs_every_method_resumes_and_reproduces(tmp_path):
    runs = tmp_path / "runs"
    proc = compare(tmp_path, runs, "--methods", "grpo,criticsearch", "--seeds", "1", "--noise", "0.5")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    labels = ["grpo", "criticsearch", "criticsearch+noise0.5"]
    for label in labels:
        res = json.loads((runs / label / "seed0" / "result.json").read_text())
        assert res["steps"] == 2 and set(res["eval_em"]) == {"0", "1", "2"}
    assert json.loads((runs / "criticsearch" / "seed0" / "result.json").read_text())["judge_calls_per_step"] > 0
    md = next((tmp_path / "out").glob("compare_debug_*.md")).read_text()
    for label in labels:
        assert f"| {label} |" in md
    assert next((tmp_path / "out").glob("compare_debug_*.png")).stat().st_size > 0
    # A second start keeps every finished run (nothing retrains).
    again = compare(tmp_path, runs, "--methods", "grpo,criticsearch", "--seeds", "1", "--noise", "0.5")
    assert again.returncode == 0 and again.stdout.count("done before, kept") == 3
    # The same seed in a fresh folder reproduces the numbers (noisy judge included).
    other = tmp_path / "runs2"
    proc = compare(tmp_path, other, "--methods", "criticsearch", "--seeds", "1", "--noise", "0.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for label in ("criticsearch", "criticsearch+noise0.5"):
        a = json.loads((runs / label / "seed0" / "result.json").read_text())
        b = json.loads((other / label / "seed0" / "result.json").read_text())
        assert a["eval_em"] == b["eval_em"] and a["judge_calls_per_step"] == b["judge_calls_per_step"]
    # The warm start was made once and shared.
    assert len(list((runs / "warmstart").glob("warmstart_*.pt"))) == 1


def test_compare_rejects_bad_arguments(tmp_path):
    for args, needle in ((["--methods", "grpo,dpo"], "unknown dpo"), (["--seeds", "0"], "--seeds"),
                         (["--noise", "1.5"], "--noise"), (["optim.lr"], "key=value")):
        proc = compare(tmp_path, tmp_path / "r", *args)
        assert proc.returncode == 2 and needle in proc.stderr, (args, proc.stderr)
    proc = compare(tmp_path, tmp_path / "r", "optim.total_steps=-1")
    assert proc.returncode == 2 and "optim.total_steps" in proc.stderr


def test_variants_and_summaries():
    assert [v for v, _ in variants(["grpo", "pica"], 0.2)] == ["grpo", "pica", "pica+noise0.2"]
    assert "judges.oracle_noise=0.2" in dict(variants(["pica"], 0.2))["pica+noise0.2"]
    assert [v for v, _ in variants(["grpo", "pica"], 0.0)] == ["grpo", "pica"]
    rows = [{"step": 0, "eval/em": 0.1}, {"step": 1, "reward": 0.5, "critic/requests": 8, "time/step": 2.0},
            {"step": 2, "reward": 0.5, "critic/requests": 4, "proceed/critiqued_steps": 2, "time/step": 4.0},
            {"step": 2, "eval/em": 0.4}]
    s = summarize_run(rows)
    assert s == {"eval_em": {"0": 0.1, "2": 0.4}, "steps": 2, "seconds_per_step": 3.0, "judge_calls_per_step": 7.0}
    mean, half = mean_interval([0.2, 0.4, 0.6])
    assert mean == pytest.approx(0.4) and half == pytest.approx(4.303 * 0.2 / 3 ** 0.5, rel=1e-3)
    assert mean_interval([0.5]) == (0.5, None)
    run = {"eval_em": {"0": 0.5, "10": 0.3, "20": 0.6}, "steps": 20, "seed": 0, "seconds_per_step": 1.0,
           "judge_calls_per_step": 0.0}
    assert steps_to(run, 0.5) == 20  # step 0 does not count
    table = summarize({"grpo": [run], "ppo": [{**run, "eval_em": {"0": 0.5, "20": 0.7}}]}, None)
    assert table["threshold"] == 0.6 and table["methods"]["ppo"]["vs_grpo"] == pytest.approx(0.1)
