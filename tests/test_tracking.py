"""Metric sinks: jsonl (truncated on resume), the console table, TensorBoard, the PNG; phase timers."""
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fastcredit.runtime.profiling import PhaseTimer
from fastcredit.runtime.tracking import MetricLogger, metrics_figure, plot_metrics, read_metrics

PNG = b"\x89PNG\r\n\x1a\n"
# One step's metrics as the trainer logs them (a subset).
STEP = {"reward": 0.5, "em": 0.4, "f1": 0.45, "turns_per_traj": 2.5, "searches_per_traj": 1.5, "actor/kl_ref": 1e-3,
        "actor/entropy": 1.1, "actor/clipfrac": 0.02, "actor/grad_norm": 0.7, "tokens_per_s": 900.0,
        "time/step": 3.2, "time/rollout": 1.5, "time/reward": 0.01, "time/judge": 0.2, "time/old_logprobs": 0.4,
        "time/advantage": 0.01, "time/update": 1.0, "time/rollout/retrieval_wait_per_traj": 0.3}


def test_jsonl_console_tensorboard_and_png(tmp_path, capsys):
    log = MetricLogger(str(tmp_path), jsonl=True, tensorboard=True)
    for step in (1, 2, 3):
        log.log(step, {"reward": 0.1 * step, "em": 0.05 * step, "nan": float("nan"), "flag": True})
    log.close()
    rows = read_metrics(log.path)
    assert [r["step"] for r in rows] == [1, 2, 3] and "nan" not in rows[0] and "flag" not in rows[0]
    out = capsys.readouterr().out.splitlines()
    assert "reward" in out[0] and "EM" in out[0] and out[1].split()[0] == "1"
    assert os.listdir(tmp_path / "tensorboard")
    png = plot_metrics(log.path, str(tmp_path / "c.png"))
    assert open(png, "rb").read(8) == PNG
    log2 = MetricLogger(str(tmp_path))
    log2.truncate_after(2)
    assert [r["step"] for r in read_metrics(log.path)] == [1, 2]


def test_other_ranks_write_nothing(tmp_path):
    log = MetricLogger(str(tmp_path / "x"), enabled=False)
    log.log(1, {"reward": 1.0})
    assert not os.path.exists(tmp_path / "x")


def test_phase_timer_accumulates_and_resets():
    t = PhaseTimer()
    for _ in range(2):
        with t.phase("rollout"):
            sum(range(1000))
    s = t.reset()
    assert set(s) == {"rollout"} and s["rollout"] > 0 and t.reset() == {}


def test_console_shows_phase_seconds_and_dashes_for_missing(tmp_path):
    log = MetricLogger(str(tmp_path), jsonl=False)
    first = log.console_line(1, STEP).splitlines()
    assert len(first) == 2
    head = first[0].split()
    for title in ("roll", "retr", "judge", "logp", "upd", "time"):
        assert title in head
    assert "sync" not in head and first[1].split()[head.index("roll")] == "1.50"
    # The weight sync is first timed at step 2: the header is printed again with its column.
    second = log.console_line(2, {**STEP, "time/colocate/sync_weights": 0.25}).splitlines()
    assert len(second) == 2 and second[0].split()[-1] == "sync" and second[1].split()[-1] == "0.25"
    # A step without some metrics keeps the columns, shows '-', and prints no header.
    third = log.console_line(3, {"reward": 0.1}).splitlines()
    assert len(third) == 1 and third[0].split()[:3] == ["3", "0.100", "-"]
    assert len(third[0]) == len(second[1]) < 130


def _axes_titles(fig) -> list:
    return [ax.get_title(loc="left") for ax in fig.axes if ax.get_title(loc="left")]


def test_curves_have_a_panel_per_group(tmp_path):
    log = MetricLogger(str(tmp_path))
    log.log(0, {"eval/em": 0.1, "eval/em/nq": 0.2, "eval/em/hotpotqa": 0.0}, console=False)
    for step in (1, 2, 3):
        log.log(step, {**STEP, "actor/kl_ref": float("nan") if step == 2 else 1e-3}, console=False)
    with open(log.path, "a") as f:
        f.write('{"step": 4, "rew')  # a write cut short by a crash
    rows = read_metrics(log.path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    fig = metrics_figure(rows)
    assert len(_axes_titles(fig)) == 5
    labels = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert {"held-out EM", "held-out EM: nq", "train EM", "rollout", "update", "KL", "entropy"} <= set(labels)
    plt.close(fig)
    log.truncate_after(3)  # a resume drops the torn line
    assert open(log.path).read().endswith("}\n") and len(read_metrics(log.path)) == 4


def test_curves_leave_out_empty_panels(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "reward": 0.2, "time/rollout": 1.0}) + "\n")
    fig = metrics_figure(read_metrics(str(path)))
    assert _axes_titles(fig) == ["reward and exact match", "seconds per step"]
    plt.close(fig)
    path.write_text("")
    assert open(plot_metrics(str(path), str(tmp_path / "c.png")), "rb").read(8) == PNG
