"""``python -m fastcredit.train`` that SIGKILLs itself at a chosen point, as a crash or a pre-emption would.

    KILL_AT=update:2 python tests/killed_run.py --config configs/debug.yaml ...   # in step 2's PPO update
    KILL_AT=latest:2 python tests/killed_run.py ...   # in step 2's checkpoint, before `latest` moves to it
    KILL_RANK=1 KILL_ONCE_EXISTS=run/checkpoints/step_000002 torchrun ... tests/killed_run.py ...

``phase:n`` kills on the n-th entry into the trainer's timed phase ``phase`` (one per step);
``latest:n`` on the n-th checkpoint, just before ``latest`` would name it. ``KILL_ONCE_EXISTS=PATH`` kills at the
first phase entry or checkpoint once PATH exists. ``KILL_RANK=r``: only the process whose ``RANK`` is r (under
torchrun, which then stops the job). SIGKILL runs no handler and flushes nothing, so the run directory is left
exactly as a crash leaves it; one line on stdout says where it happened.
"""
import os
import signal
import sys
from collections import Counter

import fastcredit.distributed.checkpoint as checkpoint
import fastcredit.runtime.profiling as profiling
from fastcredit.distributed.process_group import exit_process
from fastcredit.train import main

WHERE, NTH = os.environ.get("KILL_AT", ":0").split(":")
NTH = int(NTH)
ONCE = os.environ.get("KILL_ONCE_EXISTS")
RANK = os.environ.get("RANK", "0")
MINE = os.environ.get("KILL_RANK", RANK) == RANK
seen = Counter()


def _maybe_die(name):
    if not MINE:
        return
    seen[name] += 1
    if (name == WHERE and seen[name] == NTH) or (ONCE and os.path.exists(ONCE)):
        print(f"killed_run: rank {RANK} SIGKILLed at {name} ({seen[name]})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


_phase = profiling.PhaseTimer.phase


def phase(self, name):
    _maybe_die(name)
    return _phase(self, name)


_write_latest = checkpoint.write_latest


def write_latest(root, name):
    _maybe_die("latest")
    return _write_latest(root, name)


profiling.PhaseTimer.phase = phase
checkpoint.write_latest = write_latest

if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
