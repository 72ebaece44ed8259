"""``make gpu-check`` proves itself on a CPU: the same script, quick shapes under the Triton interpreter,
CUDA stages reported as "not run" (never "passed"); and its targets can fail."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from gpu_check import check_targets  # noqa: E402


@pytest.mark.slow
def test_the_gpu_check_runs_on_a_cpu(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run(["bash", "bench/gpu_check.sh", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    status = {p.stem[6:]: json.load(open(p))["status"] for p in out.glob("stage_*.json")}
    assert status == {"env": "passed", "build": "not run", "tests": "not run", "kernels": "passed",
                      "train": "passed", "ranks": "not run", "rollout": "not run", "step": "not run",
                      "search_step": "not run", "split": "not run", "nsys": "not run"}
    assert "needs 2 or more GPUs" in json.load(open(out / "stage_ranks.json"))["reason"]
    assert "needs CUDA (the CPU figure" in json.load(open(out / "stage_split.json"))["reason"]
    env = json.load(open(out / "env.json"))
    assert env["cuda_available"] is False and "torch" in env and "vllm" in env["packages"]
    rows = [json.loads(line) for line in open(out / "kernels.jsonl")][1:]
    assert {(r["op"], r["provider"]) for r in rows} == {("turn_surrogate", "torch"), ("turn_surrogate", "triton"),
                                                        ("linear_logprob", "torch"), ("linear_logprob", "triton")}
    assert all(r["status"] == "ok" and r["python_ms"] > 0 and r["graph_ms"].startswith("not run") for r in rows)
    assert {t["status"] for t in json.load(open(out / "targets.json"))} == {"not run"}
    engines = json.load(open(out / "step_times.json"))["engines"]
    assert set(engines) == {"hf_switch"}  # on a CPU the switch run alone (it runs every step of the plain one)
    switched = engines["hf_switch"]["steps"]
    assert [s["step"] for s in switched] == [1, 2, 3] and all(s["time/step"] > 0 for s in switched)
    # the frozen critic of the policy's architecture switched into the rollout engine every step, and back
    assert all(s["time/colocate/switch_to_critic"] > 0 and s["time/colocate/sync_weights"] > 0 for s in switched[1:])
    assert "time/judge" in switched[0]
    packed = json.load(open(next(out.glob("packed_forward_*.json"))))
    assert packed["max_abs_logp_diff"] < 1e-4 and {r["mode"] for r in packed["results"]} == {"forward",
                                                                                             "forward+backward"}
    summary = (out / "summary.md").read_text()
    assert "| kernels | passed |" in summary and "not run" in summary and "packed vs padded forward" in summary


def _row(op, shape, provider, ms, **kw):
    return {"op": op, "shape": shape, "provider": provider, "status": "ok", "python_ms": ms, "graph_ms": ms, **kw}


@pytest.mark.parametrize("fast", [True, False])
def test_targets_pass_and_fail_on_the_numbers(fast):
    rows = [_row("turn_surrogate", "N8M", "torch", 10.0),
            _row("turn_surrogate", "N8M", "triton", 1.0 if fast else 4.0, frac_of_copy_bw=0.8 if fast else 0.3),
            _row("linear_logprob", "qwen2.5-3b-N8k", "matmul", 10.0),
            _row("linear_logprob", "qwen2.5-3b-N8k", "triton", 14.0 if fast else 16.0, peak_bytes=10),
            _row("linear_logprob", "qwen2.5-3b-N8k", "torch", 30.0, peak_bytes=100 if fast else 50)]
    got = {t["name"]: t["status"] for t in check_targets(rows, cuda=True)}
    assert set(got.values()) == {"PASS" if fast else "FAIL"}, got
    assert {t["status"] for t in check_targets(rows, cuda=False)} == {"not run"}


def test_a_check_split_over_two_runs_is_not_a_pass_until_every_stage_ran(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_STAGES": "env build"}
    proc = subprocess.run(["bash", "bench/gpu_check.sh", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    failed = "FAILED: tests, kernels, train, ranks, rollout, step, search_step, split, nsys"
    assert proc.returncode == 1 and failed in proc.stdout
    assert "| kernels | failed | no result in OUTDIR" in (tmp_path / "summary.md").read_text()
    assert json.load(open(tmp_path / "stage_build.json"))["status"] == "not run"


def test_ranks_stage_counts_the_gpus_of_the_runs_own_processes(tmp_path, monkeypatch):
    """The sampler reads nvidia-smi's compute apps and keeps the GPUs of the run's processes only."""
    import threading

    from gpu_check_ranks import _descendants, _sample_gpus

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '101, GPU-aaa, 500 MiB'\necho '102, GPU-bbb, 700 MiB'\n"
                    "echo '999, GPU-ccc, 900 MiB'\necho 'No running processes found'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    seen, stop = {}, threading.Event()
    t = threading.Thread(target=_sample_gpus, args=(lambda: {101, 102}, stop, seen))
    t.start()
    threading.Timer(1.5, stop.set).start()
    t.join(10)
    assert seen == {"GPU-aaa": 500, "GPU-bbb": 700}
    assert os.getpid() in _descendants(os.getppid())


def test_the_preflights_rule_tests_exist():
    """make gpu-preflight runs these files by path: a moved test file must not turn its rules stage into 0 tests."""
    from gpu_preflight import RULE_TESTS

    missing = [p for p in RULE_TESTS if not os.path.exists(os.path.join(ROOT, p))]
    assert RULE_TESTS and missing == []
