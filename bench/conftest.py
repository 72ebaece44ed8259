"""Benchmark harness for ``pytest --benchmark-only bench`` (``make bench``), run from the repository root.

Collects ``bench/bench_*.py``. Two kinds of case:

* CPU cases (every machine): pytest-benchmark's ``benchmark`` fixture times them on the host (wall clock, its own
  rounds); the table is pytest-benchmark's (``--benchmark-json PATH`` keeps it, with the device in ``extra_info``).
* GPU cases, marked ``gpu`` (skipped without CUDA): the ``harness`` fixture measures the device's ceilings once
  per session (copy bandwidth of a 1 GiB device-to-device copy, and the bf16 matmul rate of an 8192³ GEMM), times
  every case with ``triton.testing.do_bench`` (CUDA events, L2 flushed, median), measures its peak memory
  separately, and writes one JSON file per op, ``bench/results/<op>_<device>.json``, so numbers from different
  machines never mix.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Optional

import pytest
import torch

from bench.ceilings import bf16_matmul_tflops, copy_bandwidth_gbps
from bench.results_io import write_results


def pytest_collect_file(file_path, parent):
    """Collect ``bench_*.py`` (pytest.ini's patterns only cover ``test_*.py``); explicit paths pytest handles."""
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="kernel benchmarks need a CUDA GPU (none on this machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


class Harness:
    """Times cases, measures peak memory, and collects rows per op for the results files."""

    def __init__(self):
        import triton.testing

        self._do_bench = triton.testing.do_bench
        self.device = torch.cuda.get_device_name()
        self.copy_gbps = copy_bandwidth_gbps(self.median_ms)
        self.matmul_tflops = bf16_matmul_tflops(self.median_ms)
        self.rows: dict[str, list] = defaultdict(list)

    def median_ms(self, fn: Callable, rep_ms: int = 200) -> float:
        return float(self._do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))

    @staticmethod
    def peak_memory_bytes(fn: Callable) -> int:
        """Peak bytes allocated by one call beyond what was allocated before it (outputs included)."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        return int(peak)

    def measure(self, benchmark, op: str, case: dict, fn: Callable, *, bytes_moved: Optional[float] = None,
                flops: Optional[float] = None, rep_ms: int = 200) -> dict:
        """Time ``fn`` (median, do_bench), its peak memory and throughput; record one row for ``op``.

        A case that runs out of memory is recorded as such and skipped.
        """
        try:
            peak = self.peak_memory_bytes(fn)
            ms = self.median_ms(fn, rep_ms)
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()
            self.rows[op].append({**case, "status": "out of memory"})
            pytest.skip(f"out of memory: {str(exc).splitlines()[0]}")
        row = {**case, "status": "ok", "median_ms": ms, "peak_mem_gib": peak / 2 ** 30}
        if bytes_moved is not None:
            row["gbps"] = bytes_moved / (ms * 1e-3) / 1e9
            row["frac_of_copy_bw"] = row["gbps"] / self.copy_gbps
        if flops is not None:
            row["tflops"] = flops / (ms * 1e-3) / 1e12
            row["frac_of_bf16_matmul"] = row["tflops"] / self.matmul_tflops
        self.rows[op].append(row)
        benchmark.extra_info.update(row)

        def synced():
            fn()
            torch.cuda.synchronize()

        benchmark.pedantic(synced, rounds=3, warmup_rounds=1)  # pytest-benchmark's own wall-clock table
        return row

    def write(self) -> list[str]:
        return [write_results(op, {"op": op, "device": self.device, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                                   "torch": torch.__version__,
                                   "ceilings": {"copy_gbps": self.copy_gbps, "bf16_matmul_tflops": self.matmul_tflops},
                                   "rows": rows, "speedups": speedups(rows)})
                for op, rows in self.rows.items()]


def speedups(rows: list[dict], baseline: str = "torch") -> list[dict]:
    """For every (shape, mode): each provider's time and peak memory relative to ``baseline``."""
    ok = [r for r in rows if r.get("status") == "ok"]
    base = {(r["shape"], r["mode"]): r for r in ok if r["provider"] == baseline}
    out = []
    for r in ok:
        b = base.get((r["shape"], r["mode"]))
        if b is not None and r["provider"] != baseline:
            out.append({"shape": r["shape"], "mode": r["mode"], "provider": r["provider"], "vs": baseline,
                        "speedup": b["median_ms"] / r["median_ms"],
                        "peak_mem_ratio": r["peak_mem_gib"] / b["peak_mem_gib"] if b["peak_mem_gib"] else None})
    return out


@pytest.fixture(scope="session")
def harness(request):
    h = Harness()
    yield h
    h.write()
