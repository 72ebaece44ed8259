"""``--profile`` without nsys (fastcredit.runtime.torch_profile): a torch.profiler trace in which the trainer's NVTX
phases are record_function ranges, and the per-phase table tools/gpu/nsys_phases.py makes from nsys (shared:
fastcredit.runtime.phase_table). A short debug run on the CPU (CPU ops standing in for kernels), then the
attribution rules on small hand-made traces, a GPU's included."""
import gzip
import json
import os

import pytest
import torch

from fastcredit.runtime.phase_table import ALL_NAMES, OTHER
from fastcredit.runtime.profiling import nvtx_range, record_phases
from fastcredit.runtime.torch_profile import StepProfile, Timeline, cpu_work, trace_table, work_by_phase

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["data.toy.num_people=80", "data.toy.num_companies=20", "data.toy.num_questions=60", "eval.questions=0"]
IN_STEP = ("rollout", "reward", "judge", "old_logprobs", "ref_logprobs", "values", "advantage", "update")


def test_a_profiled_debug_run_writes_the_trace_and_the_phase_table(tmp_path, capsys):
    """What ``python -m fastcredit.train --config configs/debug.yaml optim.total_steps=4 --profile`` runs (its
    ``main`` ends the process when it ends the process group, so the Trainer is run here as main runs it)."""
    from fastcredit.config import load_config
    from fastcredit.distributed.process_group import DistInfo
    from fastcredit.trainer.build import colocated_trainer

    out = tmp_path / "run"
    cfg = load_config(os.path.join(ROOT, "configs", "debug.yaml"),
                      ["optim.total_steps=4", *SMALL, "loss.kl_coef=0.001", f"data.world_dir={tmp_path / 'world'}",
                       f"logging.output_dir={out}",
                       "loss.old_logprobs=recompute"])  # a forward in that phase (auto: the rollout's, a copy)
    trainer = colocated_trainer(cfg, DistInfo(), profile=True)
    try:
        trainer.fit()
    finally:
        trainer.logger.close()
    printed = capsys.readouterr().out
    trace = out / "profile" / "trace_rank0.json.gz"
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    ranges = [e["name"] for e in events if e.get("cat") == "user_annotation"]
    assert ranges.count("fastcredit:step") == 2  # steps 3 and 4: --profile starts at the third, the run ends at 4
    for phase in ("rollout", "reward", "old_logprobs", "ref_logprobs", "advantage", "update", "sync_weights"):
        assert f"fastcredit:{phase}" in ranges, phase
    assert any(e.get("cat") == "cpu_op" for e in events)
    data = json.loads((out / "profile" / "phases_rank0.json").read_text())
    rows = {r["phase"]: r for r in data["rows"]}
    assert data["source"] == "torch" and data["device"] == "CPU-op" and data["num_steps"] == 2
    assert data["steps_found"] == [3, 4]  # the trainer's timers of the same steps
    named = sum(rows[p]["share"] for p in IN_STEP if p in rows)
    assert 0.9 < named <= 1.0 + 1e-9 and named + rows[OTHER]["share"] == pytest.approx(1.0)
    for phase in ("rollout", "update", "old_logprobs"):  # the profile's ranges are the timers' phases
        assert rows[phase]["ratio"] == pytest.approx(1.0, abs=0.05), phase
        assert 0 < rows[phase]["device_s_per_step"] and rows[phase]["top"], phase
    # The heaviest ops of the update are the trace's own ops, heaviest first, within the phase's time. Which op wins
    # is the CPU's business (an aten op, or the Python dispatch of a tensor subclass): not asserted.
    ops = {e["name"] for e in events if e.get("cat") == "cpu_op"}
    top = rows["update"]["top"]
    seconds = [s for _, s in top]
    assert {name for name, _ in top} <= ops and seconds == sorted(seconds, reverse=True)
    assert 0 < sum(seconds) <= rows["update"]["device_s_per_step"] * (1 + 1e-9)
    assert rows["step"]["share"] == 1.0
    table = (out / "profile" / "phases_rank0.md").read_text()
    head = "| phase | torch s/step | share of step | CPU-op s/step | instances | timers s/step | torch/timers |"
    assert head in table
    assert "Heaviest ops per phase" in table and table.rstrip() in printed  # printed at the end of the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as after:
        with nvtx_range("rollout"):
            pass
    assert "fastcredit:rollout" not in {e.name for e in after.events()}  # the session turned the ranges off again


def test_ranges_are_record_function_ranges_only_while_asked():
    for on in (True, False):
        record_phases(on)
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                with nvtx_range("update"):
                    torch.ones(3).sum()
        finally:
            record_phases(False)
        assert ("fastcredit:update" in {e.name for e in prof.events()}) is on


def test_the_session_leaves_cupti_to_a_cuda_tool(monkeypatch, tmp_path):
    cpu, cuda = torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA
    monkeypatch.delenv("CUDA_INJECTION64_PATH", raising=False)
    assert StepProfile(str(tmp_path), torch.device("cuda", 0)).activities == [cpu, cuda]
    assert StepProfile(str(tmp_path), torch.device("cpu")).activities == [cpu]
    monkeypatch.setenv("CUDA_INJECTION64_PATH", "/opt/nsight/libToolsInjection64.so")  # under nsys
    assert StepProfile(str(tmp_path), torch.device("cuda", 0)).activities == [cpu]


def _x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur,
            **({"args": args} if args else {})}


def _steps():
    """Two steps of 100 µs: rollout [0, 60) with a nested sync_weights [10, 20), update [70, 95); the second step
    100 µs later."""
    out = []
    for t0 in (0, 100):
        out += [_x("fastcredit:step", "user_annotation", t0, 100), _x("fastcredit:rollout", "user_annotation", t0, 60),
                _x("fastcredit:sync_weights", "user_annotation", t0 + 10, 10),
                _x("fastcredit:update", "user_annotation", t0 + 70, 25)]
    return out


def test_gpu_kernels_count_where_they_were_launched(tmp_path):
    """A kernel launched inside sync_weights that runs after it ended counts for sync_weights and rollout; one with
    no launch in the trace counts where it started; one launched between the phases counts as 'other'."""
    events = _steps() + [
        _x("cudaLaunchKernel", "cuda_runtime", 15, 1, correlation=1),
        _x("gemm", "kernel", 30, 20, tid=9, correlation=1),
        _x("cudaMemcpyAsync", "cuda_runtime", 80, 1, correlation=2),
        _x("Memcpy DtoH", "gpu_memcpy", 81, 4, tid=9, correlation=2),
        _x("cudaLaunchKernel", "cuda_runtime", 65, 1, correlation=3), _x("fill", "kernel", 66, 2, tid=9, correlation=3),
        _x("gemm", "kernel", 175, 10, tid=9),  # no launch recorded: its own start, in the second update
        _x("aten::mm", "cpu_op", 15, 1)]  # ops do not count where kernels ran
    device, work = work_by_phase(events)
    assert device == "GPU"
    assert work["sync_weights"] == {"gemm": 20e-6} and work["rollout"] == {"gemm": 20e-6}
    assert work["update"] == {"Memcpy DtoH": 4e-6, "gemm": 10e-6} and work[OTHER] == {"fill": 2e-6}
    assert sum(work["step"].values()) == pytest.approx(36e-6)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    rows, other, info = trace_table(str(path), {1: {"time/rollout": 60e-6, "time/step": 100e-6}}, "m.jsonl")
    rows = {r.phase: r for r in rows}
    assert info["device"] == "GPU" and info["num_steps"] == 2 and other == []
    assert rows["rollout"].s_per_step == pytest.approx(60e-6) and rows["rollout"].share == pytest.approx(0.6)
    assert rows["update"].device_s_per_step == pytest.approx(7e-6) and rows["update"].top[0] == ["gemm", 5e-6]
    assert rows[OTHER].share == pytest.approx(0.15) and rows["rollout"].ratio == pytest.approx(1.0)
    assert rows["sync_weights"].nested and rows["step"].timers_s_per_step == pytest.approx(100e-6)


def test_cpu_ops_count_their_self_time_on_any_thread():
    """Without kernels the ops' self time: a call's time leaves its caller's; another thread's op counts in the
    phase open at its start; ranges of other names are not phases."""
    events = _steps() + [
        _x("aten::linear", "cpu_op", 72, 10), _x("aten::addmm", "cpu_op", 73, 8), _x("aten::copy_", "cpu_op", 74, 2),
        _x("aten::mm", "cpu_op", 5, 30, tid=2),  # the rollout's thread
        _x("Optimizer.step#AdamW.step", "user_annotation", 90, 4)]
    assert sorted((name, round(s * 1e6, 6)) for _, name, s in cpu_work(events)) == \
        [("aten::addmm", 6.0), ("aten::copy_", 2.0), ("aten::linear", 2.0), ("aten::mm", 30.0)]
    device, work = work_by_phase(events)
    assert device == "CPU-op" and work["rollout"] == {"aten::mm": 30e-6}
    assert work["update"] == pytest.approx({"aten::linear": 2e-6, "aten::addmm": 6e-6, "aten::copy_": 2e-6})
    assert "sync_weights" not in work  # the op started before it opened
    timeline = Timeline(events)
    assert timeline.at(15) == ("rollout", "step", "sync_weights") and timeline.at(60) == ("step", OTHER)
    assert timeline.at(200) == () and set(timeline.at(15)) <= set(ALL_NAMES)
