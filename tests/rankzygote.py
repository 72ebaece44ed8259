"""torchrun's worker processes for the tests, forked from a warm interpreter instead of started cold.

A ``torchrun`` that tests/forkserver.py runs is itself forked from the fork server (torch and transformers already
imported), but its agent starts every rank as ``python -u -m MODULE ...`` or ``python -u SCRIPT ...``: a cold
interpreter that imports torch and transformers again, about 4 s of CPU a rank on a 2-core machine, and the suite
starts about fifty ranks. Here the forked torchrun first forks a *zygote* (a copy of itself before its agent starts
a thread), and the agent's ``SubprocessHandler._popen`` asks the zygote for each rank instead of ``Popen``:

- the zygote forks the rank, which takes the agent's environment (its RANK, LOCAL_RANK, MASTER_PORT, ...), working
  folder and output streams, starts its own session as ``Popen(start_new_session=True)`` does, and runs the
  module or script as ``python -u`` would (runpy, as ``__main__``);
- the rank is a real process with its own pid: the agent signals its process group (``os.killpg``) as it signals a
  Popen's, a rank can SIGKILL itself, and its exit status comes back through the zygote, which reaps it, as
  ``Popen.poll`` and ``Popen.wait`` report it (``-N`` for signal N);
- the zygote dies with the agent's process, and a rank with the zygote (``PR_SET_PDEATHSIG``): a torchrun that a
  test's timeout SIGKILLs leaves no rank behind. (A Popen'd rank of a SIGKILLed torchrun would run on, orphaned;
  the agent itself waits for its ranks, so only a killed agent differs.)

Only what the agent would start as ``[sys.executable, "-u", ...]`` with its output not redirected to files is
forked; anything else (``--no-python``, ``--redirects``, NUMA binding, a torch whose handler has another shape)
goes to ``Popen`` unchanged.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import Callable, Optional

_REPLY_TIMEOUT_S = 120.0


class ZygoteProc:
    """What the agent keeps of a rank: a ``subprocess.Popen``'s pid, returncode, poll, wait and signals."""

    def __init__(self, zygote: "Zygote", pid: int, args):
        self._zygote, self.pid, self.args, self.returncode = zygote, pid, args, None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self._zygote.pump(0.0)
            self.returncode = self._zygote.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        import time

        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._zygote.pump(0.05 if left is None else min(0.05, left))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The agent's end: one socket to the zygote, read by whichever agent thread asks (under a lock)."""

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid, self.exits, self._buf, self._lock = sock, pid, {}, b"", threading.Lock()
        self._pids: list = []
        self.alive = True

    def _lines(self, timeout: float) -> None:
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return
        chunk = self.sock.recv(1 << 16)
        if not chunk:  # the zygote is gone: ranks not yet reported cannot be reaped any more
            self.alive = False
            raise RuntimeError("the rank zygote exited")
        self._buf += chunk
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            msg = json.loads(line)
            if "exit" in msg:
                self.exits[msg["exit"]] = msg["rc"]
            else:
                self._pids.append(msg["pid"])

    def pump(self, timeout: float) -> None:
        with self._lock:
            self._lines(timeout)

    def spawn(self, req: dict, args) -> ZygoteProc:
        import time

        with self._lock:
            self.sock.sendall(json.dumps(req).encode() + b"\n")
            end = time.monotonic() + _REPLY_TIMEOUT_S
            while not self._pids:
                if time.monotonic() > end:
                    raise RuntimeError("the rank zygote did not answer")
                self._lines(0.05)
            return ZygoteProc(self, self._pids.pop(0), args)


def _die_with(parent: int) -> None:
    """This process is SIGKILLed when ``parent`` (the process that forked it) ends (Linux's PR_SET_PDEATHSIG)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it ended before the setting took
        os._exit(0)


def _zygote_loop(sock: socket.socket, parent: int, become: Callable[[dict], None]) -> None:
    """The zygote: fork a rank per request, report its pid, reap it and report its exit status; never returns."""
    _die_with(parent)
    me = os.getpid()
    live, buf = set(), b""
    while True:
        ready, _, _ = select.select([sock], [], [], 0.05)
        if ready:
            chunk = sock.recv(1 << 20)
            if not chunk:
                os._exit(0)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    sock.close()
                    os.setsid()  # Popen(start_new_session=True): the agent signals the rank's process group
                    _die_with(me)
                    become(req)
                live.add(pid)
                sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        while live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                live.clear()
                break
            if pid == 0:
                break
            live.discard(pid)
            sock.sendall(json.dumps({"exit": pid, "rc": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


def _request(args, env: dict) -> Optional[dict]:
    """The rank's request for ``[python, -u, -m MODULE | SCRIPT, ...]``; None for any other command."""
    args = [str(a) for a in args]
    if len(args) < 3 or args[0] != sys.executable or args[1] != "-u":
        return None
    base = {"env": env, "cwd": os.getcwd(), "stdio": "inherit", "unbuffered": True}
    if args[2] == "-m" and len(args) >= 4:
        return {**base, "module": args[3], "args": args[4:]}
    if not args[2].startswith("-"):
        return {**base, "script": os.path.abspath(args[2]), "args": args[3:]}
    return None


def _reap(sock: socket.socket, pid: int) -> None:
    """At the agent's exit: the zygote sees its socket close and exits; it is reaped here (not left a zombie)."""
    import time

    sock.close()
    end = time.monotonic() + 5.0
    while time.monotonic() < end:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            return
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def install(become: Callable[[dict], None]) -> bool:
    """In a forked ``torch.distributed.run`` before its main: fork the zygote and route the agent's ranks to it.
    Returns False (nothing changed) where this torch's handler is not the shape this was written against."""
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as sh
    except ImportError:
        return False
    handler = getattr(sh, "SubprocessHandler", None)
    popen = getattr(handler, "_popen", None)
    if popen is None or popen.__code__.co_varnames[:3] != ("self", "args", "env"):
        return False
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    mine, theirs = socket.socketpair()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        mine.close()
        _zygote_loop(theirs, parent, become)
    theirs.close()
    zygote = Zygote(mine, pid)
    atexit.register(_reap, mine, pid)

    def _popen(self, args, env):
        req = _request(args, env)
        if req is None or self._stdout is not None or self._stderr is not None or not zygote.alive:
            return popen(self, args, env)
        return zygote.spawn(req, list(args))

    handler._popen = _popen
    return True
