"""``python -m fastcredit.<command>`` for the tests, forked from a warm interpreter instead of started cold.

    proc = run([sys.executable, "-m", "fastcredit.train", ...], capture_output=True, text=True, timeout=600,
               cwd=ROOT, env=env)              # a subprocess.CompletedProcess, as subprocess.run gives

Half of a two-step debug run on a 2-core machine is importing torch and transformers (about 4 of 8 seconds),
and the suite starts such runs by the hundred. A fork server pays that once per pytest worker: a separate,
single-threaded process started with the worker's environment imports the heavy third-party modules
(never fastcredit's own: the next run sees an edit) and serves one request at a time. Per request it forks a
child that takes the request's environment, working folder, argv and output files, and runs the module as
``python -m`` does (runpy, as ``__main__``, the working folder first on sys.path). The child is a real process
of its own: its output is its own, it can be signalled (its pid is known), and its exit status comes back as
subprocess reports it (``-N`` for signal N).

A script (``[python, "path.py", ...]``, run as ``python path.py`` runs it: its folder first on sys.path) and a
torchrun (``[python, "-m", "torch.distributed.run", ...]``) are forked the same way; the python commands that a
forked command starts in turn (a torchrun's ranks, compare's runs) are forked from a zygote of its own
(tests/zygote.py). Anything else (``-c``: a test that asks what a fresh process imports must get one), a platform
without fork, or ``FASTCREDIT_TEST_FORKSERVER=0`` goes to ``subprocess.run`` unchanged.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from typing import Optional

try:
    from tests import zygote
except ImportError:  # the server, run as a script: this folder is sys.path[0]
    import zygote

HERE = os.path.dirname(os.path.abspath(__file__))
# What a trainer, evaluator or exporter process imports first, and takes seconds to: imported once, by the server.
PRELOAD = ("torch", "torch.distributed", "numpy", "yaml", "transformers", "tokenizers", "matplotlib")
PRELOAD_NAMES = (("transformers", ("PreTrainedModel", "Qwen2Config", "Qwen2ForCausalLM", "PreTrainedTokenizerFast",
                                   "AutoTokenizer", "AutoModelForCausalLM")),)


def _preload() -> None:
    import importlib

    import matplotlib

    matplotlib.use("Agg")
    for name in PRELOAD:
        importlib.import_module(name)
    for module, names in PRELOAD_NAMES:
        m = importlib.import_module(module)
        for n in names:
            getattr(m, n)  # transformers imports its classes lazily
    importlib.import_module("matplotlib.pyplot")


def _read_line(conn: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf


def _child(req: dict) -> None:
    """In the forked child: become the requested ``python -m`` process; never returns."""
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    for target, path in ((1, req["stdout"]), (2, req["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, target)
        os.close(out)
    become(req)


def become(req: dict) -> None:
    """Run ``req``'s module (``python -m``) or script (``python SCRIPT``) in this forked process with its
    environment, folder and arguments, on the standard streams it has; never returns. The python commands it starts
    are forked from its zygote (tests/zygote.py) instead of starting cold."""
    import runpy

    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has them
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        if req.get("unbuffered") or os.environ.get("PYTHONUNBUFFERED"):  # python -u
            sys.stdout.reconfigure(line_buffering=True, write_through=True)
            sys.stderr.reconfigure(line_buffering=True, write_through=True)
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        first = os.path.dirname(req["script"]) if "script" in req else os.getcwd()
        sys.path[:] = [first, *extra, *[p for p in sys.path[1:] if p not in extra]]
        threads = os.environ.get("OMP_NUM_THREADS", "")
        import torch

        torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else os.cpu_count() or 1)
        if "script" in req:
            sys.argv = [req["script"], *req["args"]]
            zygote.install(become, None)
            runpy.run_path(req["script"], run_name="__main__")
        else:
            sys.argv = [req["module"], *req["args"]]
            zygote.install(become, req["module"])
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - reported as python would, then the exit status says so
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()  # what the interpreter would run at its exit (the command's own included)
        except BaseException:  # noqa: BLE001 - as at a real exit: reported, the status stands
            traceback.print_exc()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def serve(path: str) -> None:
    """The server's loop: one request at a time, each answered with the child's pid, then its exit status."""
    _preload()
    parent = os.getppid()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    srv.settimeout(5.0)
    print("ready", flush=True)
    while True:
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            if os.getppid() != parent:  # the pytest worker is gone
                return
            continue
        conn.settimeout(None)
        req = json.loads(_read_line(conn) or b"{}")
        if req.get("op") != "run":
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            srv.close()
            conn.close()
            _child(req)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        try:
            conn.sendall(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        except OSError:
            pass
        conn.close()


class _Server:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="fastcredit-forkserver-")
        self.path = os.path.join(self.dir, "sock")
        self.proc = subprocess.Popen([sys.executable, __file__, self.path], stdout=subprocess.PIPE, text=True,
                                     cwd=HERE, env=dict(os.environ))
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the test fork server did not start (it said {line!r})")
        atexit.register(self.close)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def run(self, target: dict, cwd: str, env: dict, timeout: Optional[float]):
        """``target``: {"module": M} or {"script": PATH}, with its "args"."""
        out = tempfile.NamedTemporaryFile(dir=self.dir, delete=False)
        err = tempfile.NamedTemporaryFile(dir=self.dir, delete=False)
        out.close()
        err.close()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            conn.sendall(json.dumps({"op": "run", **target, "cwd": cwd, "env": env,
                                     "stdout": out.name, "stderr": err.name}).encode() + b"\n")
            pid = json.loads(_read_line(conn))["pid"]
            conn.settimeout(timeout)
            try:
                rc = json.loads(_read_line(conn))["rc"]
            except socket.timeout:
                os.kill(pid, signal.SIGKILL)
                conn.settimeout(None)
                _read_line(conn)
                raise subprocess.TimeoutExpired([target.get("module") or target["script"], *target["args"]],
                                                timeout) from None
            with open(out.name, encoding="utf-8", errors="replace") as fo, \
                    open(err.name, encoding="utf-8", errors="replace") as fe:
                return rc, fo.read(), fe.read()
        finally:
            conn.close()
            for name in (out.name, err.name):
                os.unlink(name)


_SERVER: Optional[_Server] = None


def _server() -> Optional[_Server]:
    global _SERVER
    if _SERVER is None or _SERVER.proc.poll() is not None:
        _SERVER = _Server()
    return _SERVER


def run(cmd: list, *, capture_output: bool = True, text: bool = True, timeout: Optional[float] = None,
        cwd: Optional[str] = None, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=..., cwd=..., env=...)``, forked from the
    warm server where ``cmd`` is ``[sys.executable, "-m", "fastcredit.<command>", ...]`` (or ``bench.*``,
    ``tools.*``), a script (``[sys.executable, "path.py", ...]``) or a torchrun (``[sys.executable, "-m",
    "torch.distributed.run", ...]``); what such a command starts is forked too (tests/zygote.py)."""
    cwd = os.path.abspath(cwd or os.getcwd())
    target = zygote.target(cmd, cwd)
    if (target is None or not (capture_output and text) or not hasattr(os, "fork")
            or os.environ.get("FASTCREDIT_TEST_FORKSERVER", "1") == "0"):
        return subprocess.run(cmd, capture_output=capture_output, text=text, timeout=timeout, cwd=cwd, env=env)
    rc, out, err = _server().run(target, cwd, dict(os.environ if env is None else env), timeout)
    return subprocess.CompletedProcess(cmd, rc, out, err)


if __name__ == "__main__":
    serve(sys.argv[1])
