"""Where benchmark results go: one JSON file per op and device, ``bench/results/<op>_<device>.json``,
so numbers from different machines are never mixed."""
from __future__ import annotations

import json
import os
import platform
import re

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def device_name(device: str = "cpu") -> str:
    """The GPU's name for ``cuda``; else the CPU model (from /proc/cpuinfo where there is one) and torch's threads."""
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"model name\s*:\s*(.+)", f.read())
            model = found.group(1).strip() if found else model
    except OSError:
        pass
    return f"{model} ({torch.get_num_threads()} threads)"


def device_slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def write_results(op: str, report: dict, out_dir: str = RESULTS_DIR) -> str:
    """Write ``report`` (which names its ``device``) to ``<out_dir>/<op>_<device slug>.json``; returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{op}_{device_slug(report['device'])}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":  # `python bench/results_io.py --slug`: this machine's device, as results files name it
    import sys

    import torch

    if sys.argv[1:] != ["--slug"]:
        sys.exit("usage: python bench/results_io.py --slug")
    print(device_slug(device_name("cuda" if torch.cuda.is_available() else "cpu")))
