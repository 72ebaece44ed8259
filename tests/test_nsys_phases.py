"""tools/gpu/nsys_phases.py: nsys's nvtx_sum CSV -> the trainer's per-phase table, against metrics.jsonl.

Runs the command as a subprocess, as a user would; no nsys needed (a stand-in plays it once)."""
from __future__ import annotations

import csv
import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE = "tools.gpu.nsys_phases"
HEADER = ["Time (%)", "Total Time (ns)", "Instances", "Avg (ns)", "Med (ns)", "Min (ns)", "Max (ns)",
          "StdDev (ns)", "Style", "Range"]
# (range, total ns, instances): three profiled steps of the fastcredit domain, and ranges of other domains
RANGES = [("fastcredit:step", 6_300_000_000, 3), ("fastcredit:rollout", 3_600_000_000, 3),
          ("vllm:execute_model", 2_000_000_000, 120), ("fastcredit:update", 1_500_000_000, 3),
          ("fastcredit:eval", 900_000_000, 1), ("fastcredit:old_logprobs", 450_000_000, 3),
          ("fastcredit:sync_weights", 300_000_000, 3), ("fastcredit:reward", 150_000_000, 3),
          ("fastcredit:engine_wake", 90_000_000, 6), (":update", 5_000_000, 2), (":forward", 1_000_000, 4)]
OTHER = {"vllm:execute_model", ":update", ":forward"}


def nvtx_csv(ranges=RANGES, header=HEADER, preamble: str = "") -> str:
    """An nvtx_sum CSV as ``nsys stats -f csv`` writes it, every cell quoted."""
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(header)
    grand = sum(t for _, t, _ in ranges)
    for name, total, n in ranges:
        avg = total / n
        full = [f"{100 * total / grand:.1f}", str(total), str(n), f"{avg:.1f}", f"{avg:.1f}", str(int(avg)),
                str(int(avg)), "0.0", "PushPop", name]
        w.writerow([full[HEADER.index(h)] if h in HEADER else full[_OLD[h]] for h in header])
    return preamble + out.getvalue()


_OLD = {"Time(%)": 0, "Total Time": 1, "Average": 3, "Minimum": 5, "Maximum": 6, "Name": 9}


def step_row(step: int, total: float, rollout: float, logp: float, **extra) -> dict:
    return {"step": step, "reward": 0.5, "time/rollout": rollout, "time/reward": 0.05, "time/old_logprobs": logp,
            "time/update": 0.5, "time/colocate/sync_weights": 0.1, "time/colocate/engine_wake": 0.03,
            "time/step": total, **extra}


def metrics_lines() -> list[str]:
    rows = [{"step": 0, "eval/em": 0.1, "time/eval": 4.0},                    # evaluation before training
            step_row(1, 3.0, 2.5, 0.3, **{"time/judge": 0.2}), step_row(2, 2.5, 1.2, 0.25),
            step_row(3, 2.0, 1.0, 0.1), step_row(4, 2.2, 1.5, 0.2),
            {"step": 4, "time/checkpoint": 0.6},                              # the save's line of its own
            step_row(5, 2.1, 2.0, 0.15, **{"time/eval": 0.9}),                 # evaluated after step 5
            {"step": 5, "eval/em": 0.3, "time/eval": 5.0}]                    # evaluation after training
    return [json.dumps(r) for r in rows] + ['{"step": 6, "time/st']          # torn last line


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    prof = tmp_path / "prof_nvtx_sum.csv"
    prof.write_text(nvtx_csv())
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(metrics_lines()))  # no newline after the torn line, as a killed writer leaves it
    return prof, metrics


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", MODULE, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          env=env)


def report(prefix: Path) -> tuple[dict, dict]:
    data = json.loads(Path(f"{prefix}.json").read_text())
    return data, {r["phase"]: r for r in data["rows"]}


def assert_bad(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nsys_phases: error: "), done.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_phases_against_the_timers(files, tmp_path):
    prof, metrics = files
    out = tmp_path / "out" / "table"
    done = run(prof, "--metrics", metrics, "--steps", "3,4,5", "--out", out)
    assert done.returncode == 0, done.stderr
    assert "not JSON" not in done.stderr and "warning" not in done.stderr  # the torn last line is skipped quietly
    data, rows = report(out)
    assert data["num_steps"] == 3 and data["num_steps_from"] == "Instances of the step range"
    assert data["steps_found"] == [3, 4, 5]
    # the trainer's order; checkpoint from the timers only; judge (step 1 only) and absent phases left out
    assert list(rows) == ["rollout", "reward", "old_logprobs", "update", "checkpoint", "eval", "sync_weights",
                          "engine_wake", "other", "step"]
    expect_nsys = {"rollout": 3.6e9, "reward": 0.15e9, "old_logprobs": 0.45e9, "update": 1.5e9, "eval": 0.9e9,
                   "sync_weights": 0.3e9, "engine_wake": 0.09e9, "step": 6.3e9}
    for phase, total in expect_nsys.items():
        assert rows[phase]["total_ns"] == total
        assert rows[phase]["s_per_step"] == pytest.approx(total / 1e9 / 3, rel=1e-12)
    expect_timers = {"rollout": 1.5, "reward": 0.05, "old_logprobs": 0.15, "update": 0.5, "checkpoint": 0.2,
                     "eval": 0.3, "sync_weights": 0.1, "engine_wake": 0.03, "step": 2.1}
    for phase, seconds in expect_timers.items():
        assert rows[phase]["timers_s_per_step"] == pytest.approx(seconds, rel=1e-12), phase
    assert rows["rollout"]["ratio"] == pytest.approx(0.8, rel=1e-12)
    assert rows["step"]["ratio"] == pytest.approx(1.0, rel=1e-12)
    assert rows["eval"]["ratio"] == pytest.approx(1.0, rel=1e-12)
    assert rows["engine_wake"]["instances"] == 6
    # shares of the step (2.1 s): the phases inside it, and "other" the rest (2.1 - 1.2 - 0.05 - 0.15 - 0.5 s)
    assert rows["rollout"]["share"] == pytest.approx(1.2 / 2.1, rel=1e-12)
    assert rows["other"]["s_per_step"] == pytest.approx(0.2, rel=1e-9) and rows["step"]["share"] == 1.0
    inside = ("rollout", "reward", "old_logprobs", "update", "other")
    assert sum(rows[p]["share"] for p in inside) == pytest.approx(1.0, rel=1e-12)
    assert rows["eval"]["share"] is None and rows["checkpoint"]["share"] is None  # between steps
    assert all(r["device_s_per_step"] is None and r["top"] == [] for r in data["rows"])  # nvtx_sum has no kernels
    assert rows["checkpoint"]["s_per_step"] is None and rows["checkpoint"]["ratio"] is None
    assert [r["phase"] for r in data["rows"] if r["nested"]] == ["sync_weights", "engine_wake"]
    # other domains' ranges, ":update" included: the file names the fastcredit domain, so it is not ours
    assert {o["range"] for o in data["other"]} == OTHER
    assert {o["range"]: o["total_ns"] for o in data["other"]}[":update"] == 5_000_000
    table = Path(f"{out}.md").read_text()
    assert done.stdout == table
    assert "| phase | nsys s/step | share of step | instances | timers s/step | nsys/timers |" in table
    assert "| rollout | 1.2000 | 57.1% | 3 | 1.5000 | 0.800 |" in table
    assert "| sync_weights* | 0.1000 | 4.8% | 3 | 0.1000 | 1.000 |" in table
    assert "| checkpoint |  |  |  | 0.2000 |  |" in table
    assert "| other | 0.2000 | 9.5% |  |  |  |" in table
    assert table.splitlines()[-3].startswith("| step | 2.1000 | 100.0% | 3 | 2.1000 | 1.000 |")
    assert "nested inside their parent phase" in table and "does not add up" in table


def test_steps_chosen_and_step_range_spelling(files, tmp_path):
    prof, metrics = files
    done = run(prof, "--metrics", metrics, "--steps", "1-2", "--out", tmp_path / "early")
    assert done.returncode == 0, done.stderr
    data, rows = report(tmp_path / "early")
    assert data["steps"] == [1, 2] and data["steps_found"] == [1, 2]
    assert rows["rollout"]["timers_s_per_step"] == pytest.approx((2.5 + 1.2) / 2, rel=1e-12)
    assert rows["judge"]["timers_s_per_step"] == pytest.approx(0.1, rel=1e-12)  # step 2 without it counts 0
    assert rows["judge"]["s_per_step"] is None
    assert "2 step(s) of timers against 3 profiled step(s)" in done.stderr


def test_default_out_next_to_the_csv_without_metrics(files):
    prof, _ = files
    done = run(prof)
    assert done.returncode == 0, done.stderr
    data, rows = report(prof.with_name("prof_nvtx_sum_phases"))
    assert prof.with_name("prof_nvtx_sum_phases.md").read_text() == done.stdout
    assert data["metrics"] is None and data["steps_found"] == []
    assert all(r["timers_s_per_step"] is None and r["ratio"] is None for r in rows.values())
    assert rows["rollout"]["s_per_step"] == pytest.approx(1.2, rel=1e-12)


def test_colon_spelling(tmp_path):
    """Recent nsys writes ``:name`` for a range whose domain's name it did not capture."""
    prof = tmp_path / "p.csv"
    prof.write_text(nvtx_csv([(f":{r[len('fastcredit:'):]}" if r.startswith("fastcredit:") else r, t, n)
                              for r, t, n in RANGES if r not in (":update", ":forward")]))
    done = run(prof, "--out", tmp_path / "p")
    assert done.returncode == 0, done.stderr
    data, rows = report(tmp_path / "p")
    assert rows["update"]["total_ns"] == 1.5e9 and rows["step"]["instances"] == 3
    assert rows["rollout"]["s_per_step"] == pytest.approx(1.2, rel=1e-12)
    assert [o["range"] for o in data["other"]] == ["vllm:execute_model"]


def test_bare_names_in_the_older_nvtxppsum_columns(tmp_path, files):
    """nvtxppsum: Time(%), Total Time (ns), Instances, Average, Minimum, Maximum, Range; no Style; bare names."""
    _, metrics = files
    header = ["Time(%)", "Total Time (ns)", "Instances", "Average", "Minimum", "Maximum", "Range"]
    ranges = [(r.split(":", 1)[1] if r.startswith("fastcredit:") else r, t, n) for r, t, n in RANGES[:5]]
    prof = tmp_path / "old.csv"
    prof.write_text(nvtx_csv(ranges, header, preamble="Processing [prof.sqlite] with [nvtxppsum.py]...\n"))
    done = run(prof, "--metrics", metrics, "--out", tmp_path / "old")
    assert done.returncode == 0, done.stderr
    data, rows = report(tmp_path / "old")
    assert rows["rollout"]["ratio"] == pytest.approx(0.8, rel=1e-12)
    assert rows["step"]["s_per_step"] == pytest.approx(2.1, rel=1e-12)
    assert [(o["range"], o["style"]) for o in data["other"]] == [("vllm:execute_model", "")]


def test_unitless_total_and_name_column(tmp_path):
    header = ["Time(%)", "Total Time", "Instances", "Average", "Minimum", "Maximum", "Name"]
    prof = tmp_path / "older.csv"
    prof.write_text(nvtx_csv(RANGES[:2], header))
    done = run(prof, "--out", tmp_path / "older")
    assert done.returncode == 0, done.stderr
    assert report(tmp_path / "older")[1]["rollout"]["s_per_step"] == pytest.approx(1.2, rel=1e-12)


def test_num_steps_when_the_profile_has_no_step_range(tmp_path, files):
    _, metrics = files
    prof = tmp_path / "nostep.csv"
    prof.write_text(nvtx_csv([r for r in RANGES if r[0] != "fastcredit:step"]))
    assert_bad(run(prof, "--metrics", metrics), "no 'fastcredit:step' range", "--num-steps", str(prof))
    done = run(prof, "--metrics", metrics, "--num-steps", "2", "--out", tmp_path / "n")
    assert done.returncode == 0, done.stderr
    data, rows = report(tmp_path / "n")
    assert data["num_steps"] == 2 and data["num_steps_from"] == "--num-steps"
    assert rows["rollout"]["s_per_step"] == pytest.approx(1.8, rel=1e-12)
    assert rows["step"]["s_per_step"] is None and rows["step"]["timers_s_per_step"] == pytest.approx(2.1)


def test_missing_files(files, tmp_path):
    prof, metrics = files
    assert_bad(run(tmp_path / "absent.csv"), str(tmp_path / "absent.csv"), "no such file")
    assert_bad(run(prof, "--metrics", tmp_path / "none.jsonl"), str(tmp_path / "none.jsonl"), "no such file")


def test_csv_without_the_needed_columns(tmp_path):
    prof = tmp_path / "cut.csv"
    header = ["Time (%)", "Total Time (ns)", "Avg (ns)", "Style"]
    prof.write_text(nvtx_csv(RANGES[:2], header))
    assert_bad(run(prof), str(prof), "Instances", "Range")
    assert "Total Time" not in run(prof).stderr.split("column(s)")[1]
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    assert_bad(run(empty), str(empty), "Total Time (ns), Instances, Range")


def test_no_profiled_steps_in_metrics(files):
    prof, metrics = files
    assert_bad(run(prof, "--metrics", metrics, "--steps", "7,8"), str(metrics), "step(s) 7, 8")
    assert_bad(run(prof, "--metrics", metrics, "--steps", "0"), str(metrics), "step(s) 0")  # eval row only


def test_bad_arguments_exit_2(files):
    prof, _ = files
    done = run(prof, "--steps", "three")
    assert done.returncode == 2 and "not a list of step numbers" in done.stderr and "Traceback" not in done.stderr


def test_report_without_nsys_on_path(tmp_path):
    rep = tmp_path / "prof.nsys-rep"
    rep.write_bytes(b"not really a report")
    empty = tmp_path / "bin"
    empty.mkdir()
    done = run(rep, env={**os.environ, "PATH": str(empty)})
    assert_bad(done, "nsys is not on PATH", str(rep), "nsys stats -q -r nvtx_sum -f csv -o prof")


def test_report_through_nsys_stats(tmp_path):
    """A stand-in ``nsys`` (shell builtins only) writes <prefix>_nvtx_sum.csv as nsys stats -o does."""
    rep = tmp_path / "prof.nsys-rep"
    rep.write_bytes(b"report")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    argv_file = tmp_path / "argv"
    body = nvtx_csv(RANGES[:3]).replace("\\", "\\\\").replace("%", "%%").replace("'", "'\\''")
    fake = bin_dir / "nsys"
    fake.write_text("#!/bin/sh\n"
                    f"printf '%s\\n' \"$@\" > '{argv_file}'\n"
                    'while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done\n'
                    f"printf '{body}' > \"${{out}}_nvtx_sum.csv\"\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    done = run(rep, "--out", tmp_path / "viarep", env={**os.environ, "PATH": str(bin_dir)})
    assert done.returncode == 0, done.stderr
    argv = argv_file.read_text().split("\n")
    assert argv[:7] == ["stats", "-q", "-r", "nvtx_sum", "-f", "csv", "-o"] and argv[8] == str(rep)
    data, rows = report(tmp_path / "viarep")
    assert data["profile"] == str(rep)
    assert rows["rollout"]["s_per_step"] == pytest.approx(1.2, rel=1e-12)
    assert [o["range"] for o in data["other"]] == ["vllm:execute_model"]
