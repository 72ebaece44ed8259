"""Metric sinks: jsonl (truncated on resume), the console table, TensorBoard, the PNG; phase timers."""
import os

from fastcredit.profiling import PhaseTimer
from fastcredit.tracking import MetricLogger, plot_metrics, read_metrics


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
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
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
