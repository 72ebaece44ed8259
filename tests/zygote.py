"""The python commands that a command forked by tests/forkserver.py starts, forked warm from a zygote of its own.

A command the fork server runs (a torchrun, ``fastcredit.compare``, ``bench.bench_step``, ...) starts python
commands of its own: torchrun's agent a rank per process (``python -u -m MODULE`` or ``python -u SCRIPT``), compare
a ``python -m fastcredit.train`` per run. Each would be a cold interpreter importing torch and transformers again,
about 4 s of CPU on a 2-core machine, and the suite starts about a hundred of them. So before the command runs (one
thread, the server's modules imported), :func:`install` forks a *zygote* from it and routes those starts there:

- ``subprocess.Popen`` becomes :class:`WarmPopen`: a command :func:`target` accepts is forked by the zygote with
  the Popen's environment, folder, session and standard streams (their descriptors passed over the zygote's
  socket, pipes included); its pid, ``poll``, ``wait``, signals and exit status are a Popen's. Anything else (a
  shell, ``-c``, another program, ``preexec_fn``, ``pass_fds``, ...) is started by Popen as before.
- in a torchrun, the agent's ``SubprocessHandler._popen`` asks the zygote for each rank; a rank dies with the
  zygote, and the zygote with the agent (``PR_SET_PDEATHSIG``), so a torchrun that a test's timeout SIGKILLs leaves
  no rank behind. (A rank Popen'd by a SIGKILLed torchrun would run on, orphaned; the agent itself waits for its
  ranks, so only a killed agent differs.) Other commands' children outlive their parent as Popen's do.

The zygote reaps each child and reports its wait status, which Popen decodes as it decodes ``waitpid``'s. What
the server preloaded (torch, transformers, triton, ...) was imported with the server's environment: a script that
sets a variable those modules read at import must start cold (``subprocess.run`` from the test, as
tests/kernels/test_aot_compile.py starts its preflight, or ``python -c``).
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
import time
from typing import Callable, Optional

_TORCHRUN = "torch.distributed.run"
_OWN_MODULES = ("fastcredit.", "bench.", "tools.")
_REPLY_TIMEOUT_S = 120.0
_ZYGOTE: Optional["Zygote"] = None


def target(args, cwd: str) -> Optional[dict]:
    """What a zygote (or the fork server) can run for ``[sys.executable, (-u,) ...]``: a module of the checkout's
    (``-m fastcredit.*``, ``bench.*``, ``tools.*``) or a torchrun, or a script (``PATH.py``, relative to ``cwd``); None
    for anything else."""
    args = [os.fspath(a) if isinstance(a, os.PathLike) else a for a in args]
    if not all(isinstance(a, str) for a in args) or len(args) < 2 or args[0] != sys.executable:
        return None
    unbuffered = args[1] == "-u"
    rest = args[2:] if unbuffered else args[1:]
    if len(rest) >= 2 and rest[0] == "-m" and (rest[1].startswith(_OWN_MODULES) or rest[1] == _TORCHRUN):
        return {"module": rest[1], "args": rest[2:], "unbuffered": unbuffered}
    if rest and rest[0].endswith(".py") and os.path.isfile(os.path.join(cwd, rest[0])):
        return {"script": os.path.abspath(os.path.join(cwd, rest[0])), "args": rest[1:], "unbuffered": unbuffered}
    return None


class Zygote:
    """The parent's end: one socket to the zygote (message boundaries kept), read under a lock by whichever thread
    asks; ``status`` holds the wait status of every child that ended."""

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid, self.status, self._lock = sock, pid, {}, threading.Lock()
        self._pids: list = []
        self.alive = True

    def _read(self, timeout: Optional[float]) -> None:
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return
        msg = self.sock.recv(1 << 16)
        if not msg:
            self.alive = False
            raise RuntimeError("the zygote exited; its children's exit status is lost")
        msg = json.loads(msg)
        if "exit" in msg:
            self.status[msg["exit"]] = msg["status"]
        else:
            self._pids.append(msg["pid"])

    def spawn(self, req: dict, fds: list) -> int:
        """Fork ``req`` (tests/forkserver.py's ``become``) with ``fds`` as its stdin, stdout, stderr; its pid."""
        with self._lock:
            socket.send_fds(self.sock, [json.dumps(req).encode()], fds)
            end = time.monotonic() + _REPLY_TIMEOUT_S
            while not self._pids:
                if time.monotonic() > end:
                    raise RuntimeError("the zygote did not answer")
                self._read(0.05)
            return self._pids.pop(0)

    def wait_status(self, pid: int, block: bool) -> Optional[int]:
        """``pid``'s wait status once it has ended; None while it runs (at once unless ``block``). Should the zygote
        be gone (killed with its group), a child that is gone too counts as SIGKILLed: its status is lost."""
        while True:
            with self._lock:
                if pid not in self.status and self.alive:
                    try:
                        self._read(0.05 if block else 0.0)
                    except RuntimeError:
                        pass
                if pid not in self.status and not self.alive and not running(pid):
                    self.status[pid] = signal.SIGKILL
                if pid in self.status:
                    return self.status[pid]
            if not block:
                return None
            if not self.alive:
                time.sleep(0.05)


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class WarmPopen(subprocess.Popen):
    """``subprocess.Popen`` whose python commands (:func:`target`) the process's zygote forks."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, *more):
        def cold():
            return super(WarmPopen, self)._execute_child(
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, shell,
                p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask,
                start_new_session, *more)

        cwd_s = os.path.abspath(os.fspath(cwd)) if cwd is not None else os.getcwd()
        plain = (_ZYGOTE is not None and _ZYGOTE.alive and not shell and executable is None and preexec_fn is None
                 and not pass_fds and gid is None and gids is None and uid is None and umask < 0
                 and all(m in (None, -1) for m in more) and isinstance(args, (list, tuple))
                 and (env is None or all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())))
        spec = target(args, cwd_s) if plain else None
        if spec is None:
            return cold()
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        req = {**spec, "env": dict(os.environ if env is None else env), "cwd": cwd_s,
               "session": bool(start_new_session)}
        try:
            self.pid = _ZYGOTE.spawn(req, fds)
        except (OSError, RuntimeError):  # the zygote is gone (killed with its group): Popen starts it cold
            _ZYGOTE.alive = False
            return cold()
        self._zygote = _ZYGOTE
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _internal_poll(self, _deadstate=None, **_):
        zygote = getattr(self, "_zygote", None)
        if zygote is None:
            return super()._internal_poll(_deadstate=_deadstate)
        if self.returncode is None:
            status = zygote.wait_status(self.pid, block=False)
            if status is not None:
                self._handle_exitstatus(status)
        return self.returncode

    def _try_wait(self, wait_flags):
        zygote = getattr(self, "_zygote", None)
        if zygote is None:
            return super()._try_wait(wait_flags)
        status = zygote.wait_status(self.pid, block=not wait_flags & os.WNOHANG)
        return (0, 0) if status is None else (self.pid, status)


class RankProc:
    """What torchrun's agent keeps of a rank: a Popen's pid, returncode, poll, wait and signals."""

    def __init__(self, zygote: Zygote, pid: int, args):
        self._zygote, self.pid, self.args, self.returncode = zygote, pid, args, None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            status = self._zygote.wait_status(self.pid, block=False)
            if status is not None:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


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
    """The zygote: fork a child per request, report its pid, reap it and report its wait status; never returns."""
    _die_with(parent)
    me, live = os.getpid(), set()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the group; the command's children decide
    while True:
        ready, _, _ = select.select([sock], [], [], 0.05)
        if ready:
            try:
                msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
            except OSError:
                os._exit(0)
            if not msg:
                os._exit(0)
            req = json.loads(msg)
            pid = os.fork()
            if pid == 0:
                sock.close()
                if req.get("session"):
                    os.setsid()  # Popen(start_new_session=True): signalled as a process group of its own
                if req.get("rank"):
                    _die_with(me)
                for target_fd, fd in enumerate(fds):
                    os.dup2(fd, target_fd)
                for fd in set(fds) - {0, 1, 2}:
                    os.close(fd)
                become(req)
            for fd in fds:
                os.close(fd)
            live.add(pid)
            sock.send(json.dumps({"pid": pid}).encode())
        while live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                live.clear()
                break
            if pid == 0:
                break
            live.discard(pid)
            sock.send(json.dumps({"exit": pid, "status": status}).encode())


def _reap(sock: socket.socket, pid: int) -> None:
    """At the command's exit: the zygote sees its socket close and exits; it is reaped here (not left a zombie)."""
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


def _route_torchrun_ranks(zygote: Zygote) -> None:
    """torchrun's agent asks the zygote for its ranks, where this torch's handler has the shape written against."""
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as sh
    except ImportError:
        return
    handler = getattr(sh, "SubprocessHandler", None)
    popen = getattr(handler, "_popen", None)
    if popen is None or popen.__code__.co_varnames[:3] != ("self", "args", "env"):
        return

    def _popen(self, args, env):
        spec = target(args, os.getcwd())
        if spec is None or self._stdout is not None or self._stderr is not None or not zygote.alive:
            return popen(self, args, env)
        req = {**spec, "env": env, "cwd": os.getcwd(), "session": True, "rank": True}
        return RankProc(zygote, zygote.spawn(req, [0, 1, 2]), list(args))

    handler._popen = _popen


def install(become: Callable[[dict], None], module: Optional[str]) -> None:
    """In a command the fork server forked, before it runs (one thread): fork its zygote, route its python
    commands there (``subprocess.Popen``; a torchrun's ranks)."""
    global _ZYGOTE
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        mine.close()
        _zygote_loop(theirs, parent, become)
    theirs.close()
    _ZYGOTE = Zygote(mine, pid)
    atexit.register(_reap, mine, pid)
    subprocess.Popen = WarmPopen
    if module == _TORCHRUN:
        _route_torchrun_ranks(_ZYGOTE)
