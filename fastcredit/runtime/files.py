"""Files a run writes and the seed it runs under: atomic writes, built-from stamps, seeding.

A file is written whole or not at all (:func:`atomic_output`). A generated folder (the toy
world, the tiny tokenizer, a PRM's tokenizer) records what it was built from
(:func:`mark_built`); a config that asks for something else rebuilds it instead of silently
reusing a stale one (:func:`built_from`), and under torchrun the other ranks wait for rank 0
to finish building it (:func:`wait_for_built`).
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import tempfile
import time
from typing import Iterator

BUILT_FROM = "fastcredit_built_from.json"  # the stamp's file name inside a generated folder


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """Yield a temporary path next to ``path``; on success move it over ``path`` in one step.

    Readers never see a half-written file, and a failed write leaves no temporary behind.
    """
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; data files are meant to be shared
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def built_from(folder: str, key: dict) -> bool:
    """Whether ``folder`` holds what ``key`` (JSON-able) describes: its stamp says it was built from ``key``."""
    try:
        with open(os.path.join(folder, BUILT_FROM)) as f:
            return json.load(f) == json.loads(json.dumps(key))
    except (OSError, ValueError):
        return False


def mark_built(folder: str, key: dict) -> None:
    """Stamp ``folder`` as built from ``key``; written last, once everything else in the folder is in place."""
    with atomic_output(os.path.join(folder, BUILT_FROM)) as tmp, open(tmp, "w") as f:
        json.dump(key, f, sort_keys=True)


def wait_for_built(folder: str, key: dict, timeout_s: float = 600.0) -> None:
    """Wait until ``folder`` is stamped as built from ``key`` (other ranks, while rank 0 builds it)."""
    t0 = time.time()
    while not built_from(folder, key):
        if time.time() - t0 > timeout_s:
            raise TimeoutError(f"rank 0 did not build {folder} (from {key}) within {timeout_s:.0f} s")
        time.sleep(0.2)


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (torch's seeds every device too)."""
    import numpy as np  # here, not above: the data files' writers import this module and never need torch
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
