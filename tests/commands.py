"""The tests' two ways to run a command: its ``main(argv)`` in the test's own process, or a process of its own.

    proc = run_main("fastcredit.train", ["--config", "configs/debug.yaml", ...], env={...})   # as python -m would
    proc = run_process([sys.executable, "-m", "torch.distributed.run", ...], timeout=600, env={...})

Both give a :class:`subprocess.CompletedProcess` (``returncode``, ``stdout``, ``stderr`` as text).

:func:`run_main` is for a command run as one process with no process group: it imports the module, calls its
``main(argv)`` with ``sys.argv``, the environment and the working folder the command line would give, takes its
output at the file descriptors (what the command's children and C++ code write included), and turns its return
value, its ``SystemExit`` or its uncaught exception into the exit status ``python -m`` would give (the exception's
traceback on stderr, status 1). Afterwards it puts back what a run changes in a process that goes on: the
environment, the working folder, ``sys.argv`` and ``sys.path``, torch's thread count and default dtype, the torch,
numpy and ``random`` generators, the signal handlers, the warning filters and the root logger. A run that leaves a
process group behind, or a thread that would keep ``python -m`` from exiting, fails the test: that command is to
be run with :func:`run_process`.

:func:`run_process` is for where a process is the thing under test: torchrun jobs, a run that is killed or
signalled, a run whose one-process group (FSDP2, DeepSpeed) ends its process, servers. The command gets a session
of its own, and a timeout kills the whole session (torchrun's ranks with it), then raises
``subprocess.TimeoutExpired`` as ``subprocess.run`` does.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the handlers a command may install; SIGKILL and SIGSTOP cannot be caught
SIGNALS = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]


def run_process(cmd: list, timeout: float, env: Optional[dict] = None, cwd: Optional[str] = None,
                stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess:
    """``cmd`` as a process of its own, its output captured as text; on ``timeout`` its session is killed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=stdin, text=True,
                            cwd=cwd or ROOT, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_main(module: str, argv: list, env: Optional[dict] = None, cwd: Optional[str] = None) -> \
        subprocess.CompletedProcess:
    """``python -m module *argv`` as the module's ``main(argv)`` in this process (``env``: the whole environment
    the command sees, as ``subprocess.run``'s; default this process's); everything it changes put back."""
    argv = [str(a) for a in argv]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        with _restored(), _output_to(out, err):
            if env is not None:
                os.environ.clear()
                os.environ.update(env)
            os.chdir(cwd or ROOT)
            threads = os.environ.get("OMP_NUM_THREADS")
            if threads and threads.isdigit() and int(threads) > 0:  # what a fresh process's pool would start with
                torch.set_num_threads(int(threads))
            code = _call(module, argv)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([sys.executable, "-m", module, *argv], code,
                                           out.read().decode(errors="replace"), err.read().decode(errors="replace"))


def _call(module: str, argv: list) -> int:
    """The exit status of ``python -m module *argv``: main's return value, its SystemExit's code, or 1 with the
    traceback printed for an uncaught exception."""
    try:
        mod = importlib.import_module(module)
        if hasattr(mod, "__path__"):  # a package: python -m runs its __main__ (whose main this imports, not runs)
            mod = importlib.import_module(module + ".__main__")
        sys.argv = [mod.__file__, *argv]
        code = mod.main(argv)
    except SystemExit as exc:
        code = exc.code
    except Exception:  # KeyboardInterrupt goes on: the test run is what was interrupted
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"): printed, status 1
    return 1


@contextlib.contextmanager
def _output_to(out, err):
    """File descriptors 1 and 2, and sys.stdout / sys.stderr (line-buffered text on them), go to ``out`` and
    ``err`` for the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    saved_streams = sys.stdout, sys.stderr
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(ValueError, OSError):  # a command that closed its stream
                stream.flush()
                stream.close()
        sys.stdout, sys.stderr = saved_streams
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)


@contextlib.contextmanager
def _restored():
    """Put back, after the block, what a command's run changes in the process that runs it; fail when it left a
    process group or a running non-daemon thread."""
    environ, cwd, argv, path = dict(os.environ), os.getcwd(), list(sys.argv), list(sys.path)
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    rng = torch.get_rng_state(), np.random.get_state(), random.getstate()
    handlers = {s: signal.getsignal(s) for s in SIGNALS}
    root = logging.getLogger()
    root_handlers, root_level = list(root.handlers), root.level
    before = set(threading.enumerate())
    group_before = dist.is_available() and dist.is_initialized()
    try:
        with warnings.catch_warnings():
            yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.argv[:], sys.path[:] = argv, path
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        torch.set_rng_state(rng[0])
        np.random.set_state(rng[1])
        random.setstate(rng[2])
        for s, h in handlers.items():
            if h is not None:  # None: a handler not installed from Python, left as it is
                signal.signal(s, h)
        root.handlers[:] = root_handlers
        root.setLevel(root_level)
    left = [t for t in set(threading.enumerate()) - before if t.is_alive() and not t.daemon]
    for t in left:
        t.join(timeout=10)
    left = [t.name for t in left if t.is_alive()]
    assert not left, f"the command left non-daemon threads running ({left}): python -m would not exit"
    if dist.is_available() and dist.is_initialized() and not group_before:
        dist.destroy_process_group()
        raise AssertionError("the command left a process group: run it with run_process (its exit ends the process)")


__all__ = ["ROOT", "run_main", "run_process"]
