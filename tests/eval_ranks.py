"""``python -m fastcredit.eval`` as torchrun starts it, with the scripted oracle policy of tests/test_eval.py in
place of the model's engine (so every rank's answers, and the table, are known), and a chosen rank stopped at a
point every rank has provably reached.

    ORACLE_DATA=test.parquet STARTED_DIR=/tmp/s [FAIL_RANK=1 FAIL_AFTER=2 PEER_RECORDS=8 HOLD_AFTER=2 \\
        FAIL_MODE=kill|raise] torchrun --nproc_per_node=2 tests/eval_ranks.py --model M --data test.parquet ...

Each rank writes how many questions its engine started to ``STARTED_DIR/rank<r>`` when the engine closes, and how
many records it has saved to ``STARTED_DIR/saved<r>`` after each chunk. The handshake, through those files, not
through timing:

- ``FAIL_RANK``, right after saving its ``FAIL_AFTER``-th chunk, waits until every other rank has saved at least
  ``PEER_RECORDS`` records, then SIGKILLs itself (``FAIL_MODE=kill``: a crash or a pre-emption; torchrun then stops
  the other ranks) or raises (``raise``: a bug on one rank, while the others wait for it);
- every other rank, with ``HOLD_AFTER`` set, stops after saving that many chunks and waits there to be stopped.

A wait that lasts past ``DEADLINE_S`` (default 120) ends the process with status 97, so a broken handshake fails the
test instead of hanging it.
"""
import os
import signal
import sys
import time

from test_eval import OracleEngine  # this file's folder, tests/, is sys.path[0]: torchrun runs it as a script

from fastcredit import eval as E
from fastcredit.distributed.process_group import exit_process
from fastcredit.data.loaders import load_qa
from fastcredit.trainer import heldout

RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
DIR = os.environ["STARTED_DIR"]
DEADLINE_S = float(os.environ.get("DEADLINE_S", "120"))


class CountingOracle(OracleEngine):
    def close(self):
        with open(os.path.join(DIR, f"rank{RANK}"), "w") as f:
            f.write(str(self.started))


def make(kind, folder, tokenizer, cfg, device):
    return CountingOracle(tokenizer, load_qa(os.environ["ORACLE_DATA"], split="test"))


def saved(rank: int) -> int:
    try:
        with open(os.path.join(DIR, f"saved{rank}")) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return 0


def wait_until(ready, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not ready():
        if time.monotonic() > end:
            print(f"eval_ranks: rank {RANK} waited {DEADLINE_S:.0f} s for {what}", file=sys.stderr, flush=True)
            os._exit(97)
        time.sleep(0.05)


_add, chunks, records = heldout.PredictionCache.add, [], []


def add(self, new):
    _add(self, new)
    chunks.append(len(new))
    tmp = os.path.join(DIR, f".saved{RANK}")
    with open(tmp, "w") as f:
        f.write(str(sum(chunks)))
    os.replace(tmp, os.path.join(DIR, f"saved{RANK}"))
    fail_rank = int(os.environ.get("FAIL_RANK", "-1"))
    if RANK == fail_rank and len(chunks) == int(os.environ["FAIL_AFTER"]):
        need = int(os.environ.get("PEER_RECORDS", "0"))
        wait_until(lambda: all(saved(r) >= need for r in range(WORLD) if r != RANK),
                   f"the other ranks to save {need} records")
        if os.environ.get("FAIL_MODE", "kill") == "raise":
            raise RuntimeError(f"rank {RANK} fails on purpose after {len(chunks)} chunks")
        os.kill(os.getpid(), signal.SIGKILL)
    if RANK != fail_rank and os.environ.get("HOLD_AFTER") and len(chunks) == int(os.environ["HOLD_AFTER"]):
        wait_until(lambda: False, "torchrun to stop this rank")


E.engine_factory = make
heldout.PredictionCache.add = add

if __name__ == "__main__":
    exit_process(E.main(sys.argv[1:]))
