"""``--profile`` without nsys: a torch.profiler (Kineto) trace of the profiled steps and its per-phase table.

    session = StepProfile(out_dir, info.device, info.rank)   # fastcredit.trainer.loop, around the profiled steps
    session.start()
    ...                                                      # steps; session.add_step(step, metrics) after each
    trace, table = session.stop()   # <out_dir>/profile/trace_rank<r>.json.gz, phases_rank<r>.md / .json

While the session records, every NVTX range of the trainer is also a ``record_function`` range
``fastcredit:<name>`` (``fastcredit.runtime.profiling.record_phases``), so the phases show in the Chrome trace
(gzipped JSON, a tenth of its size; gunzip it for a viewer that wants it plain), and the table is
``fastcredit.runtime.phase_table``'s, the one ``tools/gpu/nsys_phases.py`` makes from an nsys report: seconds per
step of each range, its share of the step, the device time inside it and its heaviest kernels, beside the
trainer's timers for the same steps.

Device time: on a GPU the kernels, copies and memsets, each counted in the ranges open when its launch ran on the
CPU (the ``correlation`` Kineto gives the kernel and its launch; the kernel's own start without one); on a CPU the
ops' self time (their time less that of the ops they call), counted in the ranges open when the op started, on any
thread (the rollout's threads too, where torch can record every thread). Under a CUDA tool that owns CUPTI (nsys,
ncu: ``CUDA_INJECTION64_PATH`` is set) the session records CPU activity only, and the kernels are the tool's.
"""
from __future__ import annotations

import bisect
import gzip
import json
import os
from collections import defaultdict
from typing import Optional

import torch

from fastcredit.runtime.phase_table import (ALL_NAMES, DOMAIN, OTHER, OUTSIDE_STEP, PHASES, STEP, RangeRow,
                                            build_rows, classify, markdown, num_profiled_steps, report, split_range)
from fastcredit.runtime.profiling import record_phases

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
IN_STEP = tuple(p for p in PHASES if p not in OUTSIDE_STEP)


def tool_attached() -> bool:
    """Whether a CUDA tool (nsys, ncu) is injected into this process: CUPTI is then the tool's."""
    return bool(os.environ.get("CUDA_INJECTION64_PATH"))


def _all_threads():
    """Kineto's setting that records the ops of every thread (the rollout's threads, not only the caller's); None
    where this torch has no such option."""
    from torch.profiler import _ExperimentalConfig

    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        return None


class StepProfile:
    """A torch.profiler session over the profiled steps of one rank, written under ``<out_dir>/profile``."""

    def __init__(self, out_dir: str, device: torch.device, rank: int = 0):
        self.folder, self.rank = os.path.join(out_dir, "profile"), rank
        self.metrics_path = os.path.join(out_dir, "metrics.jsonl")
        cuda = device.type == "cuda" and not tool_attached()
        self.activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                                   if cuda else [])
        self.metrics: dict[int, dict] = {}
        self.prof = None

    def start(self) -> None:
        """Start recording (and make the trainer's ranges record_function ranges)."""
        self.prof = torch.profiler.profile(activities=self.activities, experimental_config=_all_threads())
        self.prof.start()
        record_phases(True)

    def add_step(self, step: int, metrics: dict) -> None:
        """The metrics of a profiled step (its ``time/*`` timers go beside the profile's figures)."""
        self.metrics[step] = metrics

    def stop(self) -> tuple[str, str]:
        """Stop, write the trace and the table; ``(trace path, table text)``."""
        record_phases(False)
        self.prof.stop()
        os.makedirs(self.folder, exist_ok=True)
        trace = os.path.join(self.folder, f"trace_rank{self.rank}.json.gz")
        self.prof.export_chrome_trace(trace)
        self.prof = None
        rows, other, info = trace_table(trace, self.metrics, self.metrics_path)
        table = markdown(rows, info)
        prefix = os.path.join(self.folder, f"phases_rank{self.rank}")
        with open(prefix + ".md", "w", encoding="utf-8") as f:
            f.write(table)
        with open(prefix + ".json", "w", encoding="utf-8") as f:
            f.write(json.dumps(report(rows, other, info), indent=1) + "\n")
        return trace, table


def read_events(path: str) -> list[dict]:
    """The complete events (``"ph": "X"``) of a Chrome trace torch.profiler wrote (``.json`` or ``.json.gz``)."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "ts" in e]


def range_rows(events: list[dict]) -> list[RangeRow]:
    """A row per ``record_function`` name (category ``user_annotation``): total and instances."""
    totals: dict[str, list] = {}
    for e in events:
        if e.get("cat") == "user_annotation":
            row = totals.setdefault(e["name"], [0, 0])
            row[0] += round(float(e.get("dur", 0.0)) * 1000)
            row[1] += 1
    return [RangeRow(name, "PushPop", total, n) for name, (total, n) in totals.items()]


class Timeline:
    """Which of the trainer's ranges are open at a time: the ranges' ends cut the time into pieces, each with its
    set of open ranges."""

    def __init__(self, events: list[dict]):
        edges = []
        for e in events:
            domain, name = split_range(e["name"]) if e.get("cat") == "user_annotation" else (None, "")
            if domain == DOMAIN and name in ALL_NAMES:
                start = float(e["ts"])
                edges += [(start, 1, name), (start + float(e.get("dur", 0.0)), -1, name)]
        edges.sort(key=lambda edge: (edge[0], edge[1]))  # a range that ends where the next starts closes first
        self.cuts: list[float] = []
        self.open: list[tuple] = []
        count: dict[str, int] = defaultdict(int)
        for t, change, name in edges:
            count[name] += change
            now = tuple(sorted(n for n, c in count.items() if c > 0))
            if self.cuts and self.cuts[-1] == t:
                self.open[-1] = now
            else:
                self.cuts.append(t)
                self.open.append(now)

    def at(self, t: float) -> tuple:
        """The names of the ranges open at ``t`` (µs), plus ``other`` inside a step but in none of its phases."""
        i = bisect.bisect_right(self.cuts, t) - 1
        names = self.open[i] if i >= 0 else ()
        if STEP in names and not any(n in IN_STEP for n in names):
            names += (OTHER,)
        return names


def device_work(events: list[dict]) -> list[tuple[float, str, float]]:
    """``(time attributed, kernel, seconds)`` of each kernel, copy and memset; the time is its launch's on the CPU
    when the trace links the two by ``correlation``, else the kernel's own start."""
    launched = {e["args"]["correlation"]: float(e["ts"]) for e in events
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    out = []
    for e in events:
        if e.get("cat") in DEVICE_CATS:
            t = launched.get(e.get("args", {}).get("correlation"), float(e["ts"]))
            out.append((t, e["name"], float(e.get("dur", 0.0)) / 1e6))
    return out


def cpu_work(events: list[dict]) -> list[tuple[float, str, float]]:
    """``(start, op, self seconds)`` of each CPU op: its time less that of the ops it calls on its thread."""
    by_thread: dict[tuple, list] = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op":
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out = []
    for ops in by_thread.values():
        ops.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        stack: list[list] = []  # [end, index in out] of the ops open at this point
        for e in ops:
            start, dur = float(e["ts"]), float(e.get("dur", 0.0))
            while stack and stack[-1][0] <= start:
                stack.pop()
            if stack:  # a call inside its parent: the parent's self time loses it
                parent = out[stack[-1][1]]
                out[stack[-1][1]] = (parent[0], parent[1], parent[2] - dur / 1e6)
            out.append((start, e["name"], dur / 1e6))
            stack.append([start + dur, len(out) - 1])
    return out


def work_by_phase(events: list[dict]) -> tuple[str, dict[str, dict[str, float]]]:
    """``(device label, {phase: {kernel or op: seconds}})``: kernels where the trace has any ("GPU"), else the CPU
    ops' self time ("CPU-op"), each in every range open at its time."""
    work = device_work(events)
    label = "GPU"
    if not work:
        work, label = cpu_work(events), "CPU-op"
    timeline = Timeline(events)
    spent: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for t, name, seconds in work:
        for phase in timeline.at(t):
            spent[phase][name] += seconds
    return label, {phase: dict(names) for phase, names in spent.items()}


def trace_table(path: str, metrics: Optional[dict[int, dict]] = None, metrics_path: Optional[str] = None):
    """``(rows, other ranges, info)`` of the per-phase table of a trace ``StepProfile`` wrote; ``metrics``: the
    profiled steps' metrics by step (the timers), ``metrics_path`` where they are logged (named in the table)."""
    events = read_events(path)
    phases, other = classify(range_rows(events))
    n_steps, n_from = num_profiled_steps(phases, None, path)
    device, work = work_by_phase(events)
    rows = build_rows(phases, n_steps, metrics or None, work)
    info = {"source": "torch", "profile": path, "metrics": metrics_path if metrics else None,
            "steps": sorted(metrics or {}), "steps_found": sorted(metrics or {}), "num_steps": n_steps,
            "num_steps_from": n_from, "device": device}
    return rows, other, info
