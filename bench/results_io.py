"""Where benchmark results go: one JSON file per op and device, ``bench/results/<op>_<device>.json``,
so numbers from different machines are never mixed."""
from __future__ import annotations

import json
import os

from fastcredit.runtime.profiling import device_name, device_slug  # noqa: F401  (re-exported for the benchmarks)

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def write_results(op: str, report: dict, out_dir: str = RESULTS_DIR) -> str:
    """Write ``report`` (which names its ``device``) to ``<out_dir>/<op>_<device slug>.json``; returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{op}_{device_slug(report['device'])}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    return path


def child_env(*paths: str, **extra: str) -> dict:
    """This process's environment for a child, with ``paths`` put before any ``PYTHONPATH`` already set (never in
    its place: on a lent GPU machine's bare image the packages carried in, faiss and the encoder, live there)."""
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join([*paths, *kept])}


if __name__ == "__main__":  # `python -m bench.results_io --slug`: this machine's device, as results files name it
    import sys

    import torch

    if sys.argv[1:] != ["--slug"]:
        sys.exit("usage: python -m bench.results_io --slug")
    print(device_slug(device_name("cuda" if torch.cuda.is_available() else "cpu")))
