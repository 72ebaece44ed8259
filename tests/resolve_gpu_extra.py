"""Resolve the ``gpu`` extra as a Linux x86-64 GPU machine would install it: ``python tests/resolve_gpu_extra.py
OUTDIR [--python 3.12]``. Writes ``OUTDIR/result.json``: ``{"skip": reason}`` when the package index is
unreachable, else ``{"returncode", "stderr", "report"}`` (``report``: pip's ``--report`` file, when it wrote one).

``pip install --dry-run --report`` reads only package metadata, but from the network: about a minute of waiting
and almost no CPU. tests/test_install.py checks the result; tests/background.py starts this script when the suite
collects that test, so the wait overlaps the suite's CPU-bound tests instead of holding a worker (run without the
suite's hooks, the test runs it in place). The resolution leaves this machine's pip setup out (its local CPU build
of torch would stand in for the CUDA one) and asks the package index for manylinux x86-64 wheels of the target
Python; deepspeed, which PyPI ships as source only, is given as a wheel built here.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INDEX = "https://pypi.org/simple/"
# glibc 2.35 (Ubuntu 22.04, the base of NVIDIA's CUDA 13 images) down to the oldest manylinux tags
PLATFORMS = [f"manylinux_2_{v}_x86_64" for v in range(35, 4, -1)] + \
    ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]


def _pip_env() -> dict:
    # No config files, no find-links: only the package index, as on a fresh GPU machine.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def build_wheels(out: str) -> tuple[int, str]:
    """fastcredit and deepspeed as wheels into ``out`` (the resolution takes binary distributions only)."""
    for target in (ROOT, "deepspeed==0.19.8"):
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, target],
                              capture_output=True, text=True, timeout=900, cwd=ROOT,
                              env={**os.environ, "FASTCREDIT_BUILD_CUDA": "0"})
        if proc.returncode != 0:
            return proc.returncode, f"pip wheel {target}: {proc.stderr[-2000:]}"
    return 0, ""


def resolve(out: str, python: str) -> dict:
    """The resolution's outcome as written to ``result.json``."""
    try:
        urllib.request.urlopen(INDEX + "pip/", timeout=20).close()
    except OSError as exc:
        return {"skip": f"the package index {INDEX} is unreachable from this machine ({exc})"}
    wheels = os.path.join(out, "wheels")
    os.makedirs(wheels, exist_ok=True)
    rc, err = build_wheels(wheels)
    if rc != 0:
        return {"returncode": rc, "stderr": err}
    report = os.path.join(out, "report.json")
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--python-version", python, *platforms, "--only-binary=:all:", "--index-url", INDEX,
                           "--find-links", wheels, "--report", report, "fastcredit[gpu,dev]==0.1.0"],
                          capture_output=True, text=True, timeout=900, env=_pip_env(), cwd=ROOT)
    return {"returncode": proc.returncode, "stderr": proc.stderr[-4000:],
            "report": report if os.path.exists(report) else None}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--python", default="3.12")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    try:
        result = resolve(a.out, a.python)
    except subprocess.TimeoutExpired as exc:
        result = {"returncode": -9, "stderr": f"timed out: {exc}"}
    tmp = os.path.join(a.out, "result.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(a.out, "result.json"))  # whole or absent: the waiting test never reads half


if __name__ == "__main__":
    main()
