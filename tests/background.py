"""Work a test waits on that needs the network, not the CPU, started in the background as soon as the suite knows
the test will run, so the wait overlaps the CPU-bound tests instead of holding one of `make test`'s two workers.

Each job is a script run as ``python SCRIPT OUT ARGS``; it writes ``OUT/result.json`` atomically when done (a
minute of package-index queries for the gpu extra's resolution, tests/resolve_gpu_extra.py). The process that
schedules the tests (pytest-xdist's controller, or pytest itself without workers) starts a job when the collected
tests include its test, and tells the workers the folder (``workerinput``). The test calls :func:`result`: it
waits for the job's result, or runs the script in place when nothing started it (a run without these hooks). The
controller kills a job still running at the end of the session and removes the folder.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "fastcredit_background"
# job name: (the test's node id, the script and its arguments after OUT)
JOBS = {"gpu_extra_3.12": ("tests/test_install.py::test_the_gpu_extra_resolves_with_one_cuda_major[3.12]",
                           ["tests/resolve_gpu_extra.py", "--python", "3.12"])}
RUNNING: dict = {}


def configure(config) -> None:
    """On the scheduling process only: a folder for this session's jobs."""
    if not hasattr(config, "workerinput"):
        config.fastcredit_background = tempfile.mkdtemp(prefix="fastcredit-background-")


def folder(config):
    """This session's job folder (None where none was made)."""
    if hasattr(config, "workerinput"):
        return config.workerinput.get(KEY)
    return getattr(config, "fastcredit_background", None)


def start_for(config, nodeids) -> None:
    """Start every job whose test is among ``nodeids`` (once per session)."""
    base = folder(config)
    if base is None:
        return
    wanted = set(nodeids)
    for name, (nodeid, _) in JOBS.items():
        if nodeid not in wanted or name in RUNNING:
            continue
        out = os.path.join(base, name)
        os.makedirs(out, exist_ok=True)
        log = open(os.path.join(out, "job.log"), "w")
        RUNNING[name] = subprocess.Popen(_command(name, out), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        with open(os.path.join(out, "pid"), "w") as f:
            f.write(str(RUNNING[name].pid))


def _command(name: str, out: str) -> list:
    """Job ``name``'s command line writing into ``out``: ``python SCRIPT OUT ARGS``."""
    script, *args = JOBS[name][1]
    return [sys.executable, script, out, *args]


def finish(config) -> None:
    """Kill jobs still running (their test was deselected late, or the session was interrupted); remove the
    folder."""
    for proc in RUNNING.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    RUNNING.clear()
    base = getattr(config, "fastcredit_background", None)
    if base:
        shutil.rmtree(base, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not yet reaped by the controller) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def result(config, name: str, tmp_path, timeout: float = 900.0) -> dict:
    """Job ``name``'s ``result.json``: waited for when the session started the job, else made here by running the
    script in ``tmp_path``. A job that died without a result, or ran past ``timeout``, raises with its log."""
    base = folder(config)
    out = os.path.join(base, name) if base else None
    if out is None or not os.path.exists(os.path.join(out, "pid")):
        out = str(tmp_path / name)
        os.makedirs(out, exist_ok=True)
        cmd = _command(name, out)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout + 60)
        if proc.returncode != 0:
            raise RuntimeError(f"{cmd[1]} exited {proc.returncode}: {proc.stderr[-3000:]}")
        return json.load(open(os.path.join(out, "result.json")))
    done = os.path.join(out, "result.json")
    pid = int(open(os.path.join(out, "pid")).read())
    deadline = time.monotonic() + timeout
    while not os.path.exists(done):
        if not _alive(pid) and not os.path.exists(done):
            raise RuntimeError(f"background job {name} ended without a result: {_log(out)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"background job {name} still running after {timeout:.0f} s: {_log(out)}")
        time.sleep(0.5)
    return json.load(open(done))


def _log(out: str) -> str:
    try:
        return open(os.path.join(out, "job.log")).read()[-3000:]
    except OSError:
        return "(no log)"
