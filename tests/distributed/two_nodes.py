"""Two torchrun agents as the two nodes of one job on this machine's loopback: c10d rendezvous, one rank each.

    python tests/distributed/two_nodes.py LOGS -m fastcredit.train --config configs/debug.yaml key=value ...

Each agent runs ``torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT
--rdzv-id=ID --local-addr=127.0.0.1 --max-restarts=0`` and then the arguments given (the same on both nodes), with
``GLOO_SOCKET_IFNAME=lo``; its output goes to ``LOGS/node<n>.log``. PORT is a free port of this machine. The c10d
rendezvous numbers the nodes (``--node-rank`` is for the static one), so either node may hold rank 0.

Prints ``{"node0": status, "node1": status, "stopped": bool}`` and exits 0 when both agents exit 0, else 1. An
agent still running ``DEADLINE_S`` (default 240) after the start, or ``GRACE_S`` (20) after the other one failed,
is stopped: SIGTERM (torchrun passes it on to its rank), then SIGKILL to its process group.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

DEADLINE_S = float(os.environ.get("DEADLINE_S", "240"))
GRACE_S = 20.0
STOP_WAIT_S = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_command(port: int, rdzv_id: str, args: list) -> list:
    """One node's torchrun: both nodes run the same command."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}",
            "--rdzv-conf=join_timeout=60", "--local-addr=127.0.0.1", "--max-restarts=0", *args]


def stop(nodes: list) -> None:
    """SIGTERM to every agent still running, then SIGKILL to the process group of any that outlives STOP_WAIT_S."""
    running = [p for p in nodes if p.poll() is None]
    for p in running:
        p.send_signal(signal.SIGTERM)
    end = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < end and any(p.poll() is None for p in running):
        time.sleep(0.1)
    for p in running:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def wait_for(nodes: list) -> bool:
    """Wait for both agents; True when they had to be stopped (the deadline, or one failed and the other hung)."""
    deadline, failed_at = time.monotonic() + DEADLINE_S, None
    while any(p.poll() is None for p in nodes):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in nodes):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
            stop(nodes)
            return True
        time.sleep(0.1)
    return False


def main(argv: list) -> int:
    logs, args = argv[0], argv[1:]
    os.makedirs(logs, exist_ok=True)
    command = agent_command(free_port(), f"two-nodes-{os.getpid()}", args)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    nodes = []
    try:
        for n in (0, 1):
            with open(os.path.join(logs, f"node{n}.log"), "w") as log:
                nodes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))
        stopped = wait_for(nodes)
    finally:
        stop(nodes)  # nothing left running, whatever happened here
    print(json.dumps({"node0": nodes[0].returncode, "node1": nodes[1].returncode, "stopped": stopped}), flush=True)
    return 0 if [p.returncode for p in nodes] == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
