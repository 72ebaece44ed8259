"""A checkpoint's manifest and how a checkpoint folder is verified (``fastcredit.distributed.checkpoint`` saves,
loads and resumes with them), plus the few collective helpers both use.

``manifest.json`` lists every file of a finished checkpoint with its size and sha256, written last by rank 0
after the ranks have hashed their shares (:func:`write_manifest`; each rank hashes the files it wrote first, the
rest largest first onto the least loaded, 8 MiB at a time). :func:`verify_checkpoint` checks a folder against its
manifest, or, for a checkpoint without one (an older fastcredit's), what can be checked without it. Every
collective here returns the same result on every rank, so all ranks decide alike.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch.distributed as dist

ENGINE_DIR = "engine"
MODEL_DIR = "model"
MANIFEST = "manifest.json"
TRAINER = "trainer.json"
FORMAT = 1
CHUNK = 8 << 20  # bytes read per hash update
THREADS = 4  # files one rank hashes at once (hashlib and file reads release the GIL)
RNG_FILE = re.compile(r"rng_rank(\d+)\.pt")
OWNER = re.compile(r"(?:^__|pp_rank_|^rng_rank)(\d+)(?:_|\.pt$)")  # a rank's DCP shard, ZeRO partition, RNG


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names each file that is wrong and how."""


# The ranks that save and load checkpoints together: the whole job (None), or a split placement's training ranks
# (fastcredit.distributed.split sets it with use_group); ranks and sizes below count inside it.
_GROUP = None


def use_group(group) -> None:
    """Checkpoints are written and verified by the ranks of ``group`` (None: every rank of the job)."""
    global _GROUP
    _GROUP = group


def checkpoint_group():
    """The group :func:`use_group` set (None: the whole job)."""
    return _GROUP


def this_rank() -> int:
    return dist.get_rank(_GROUP) if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size(_GROUP) if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    if world_size() > 1:
        dist.barrier(group=_GROUP)


def gather(obj) -> list:
    """``obj`` of every rank, in rank order (collective)."""
    out = [obj] + [None] * (world_size() - 1)
    if world_size() > 1:
        dist.all_gather_object(out, obj, group=_GROUP)
    return out


def agreed(problems: list[str]) -> list[str]:
    """Every rank's problems, the same list on every rank (collective)."""
    return list(dict.fromkeys(p for part in gather(problems) for p in part))


def short_error(exc: BaseException) -> str:
    """``Type: first line`` of ``exc``; DCP's CheckpointException gives its first rank's own error."""
    for rank, (inner, _) in getattr(exc, "failures", {}).items():
        return f"rank {rank}: {short_error(inner)}"
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def file_sha256(path: str) -> tuple[int, str]:
    """``(bytes read, sha256 hex digest)`` of the file ``path``, read in chunks."""
    h, size, buf = hashlib.sha256(), 0, bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def hash_shares(sizes: dict, n: int) -> list[list[str]]:
    """``sizes`` (``{relative path: bytes}``) split over ``n`` ranks: a file named after the rank that wrote it
    to that rank (its page cache may still hold it), the others largest first onto the least loaded."""
    owner = {rel: int(m.group(1)) for rel in sizes if (m := OWNER.search(rel.rsplit("/", 1)[-1]))
             and int(m.group(1)) < n}
    loads, shares = [0] * n, [[] for _ in range(n)]
    for rel in sorted(sizes, key=lambda r: (r not in owner, -sizes[r], r)):
        k = owner[rel] if rel in owner else loads.index(min(loads))
        shares[k].append(rel)
        loads[k] += sizes[rel]
    return shares


def hash_files(folder: str, sizes: dict) -> dict:
    """``{relative path: {"size", "sha256"} or {"error"}}`` of the files ``sizes`` lists under ``folder``, each
    rank hashing a share (collective: every rank calls it, with the same ``sizes``, and gets the whole dict)."""
    def one(rel):
        try:
            return rel, dict(zip(("size", "sha256"), file_sha256(os.path.join(folder, rel))))
        except OSError as exc:
            why = "missing" if isinstance(exc, FileNotFoundError) else f"unreadable ({short_error(exc)})"
            return rel, {"error": why}

    mine = hash_shares(sizes, world_size())[this_rank()]
    with ThreadPoolExecutor(min(THREADS, max(len(mine), 1))) as pool:
        local = dict(pool.map(one, mine))
    return {rel: entry for part in gather(local) for rel, entry in part.items()}


def list_files(folder: str) -> dict:
    """``{relative path: bytes}`` of every file under ``folder`` but the manifest, ``/``-separated."""
    out = {}
    for base, _, names in os.walk(folder):
        for name in names:
            full = os.path.join(base, name)
            rel = os.path.relpath(full, folder).replace(os.sep, "/")
            if rel != MANIFEST:
                out[rel] = os.path.getsize(full)
    return out


def write_manifest(folder: str, step: int) -> None:
    """Hash every file of ``folder`` (collective) and write its manifest on rank 0."""
    files = hash_files(folder, gather(list_files(folder) if this_rank() == 0 else None)[0])  # rank 0's listing
    bad = [f"{os.path.join(folder, rel)}: {e['error']}" for rel, e in sorted(files.items()) if "error" in e]
    if bad:  # the same dict on every rank: all raise together
        raise CheckpointError("cannot hash the checkpoint just written: " + "; ".join(bad))
    if this_rank() == 0:
        manifest = {"format": FORMAT, "step": step, "world_size": world_size(), "hash": "sha256",
                    "files": dict(sorted(files.items()))}
        write_synced(os.path.join(folder, MANIFEST), json.dumps(manifest, indent=1))


def write_synced(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def read_manifest(path: str) -> tuple[Optional[dict], list[str]]:
    """``(manifest or None when absent, problems)``."""
    full = os.path.join(path, MANIFEST)
    if not os.path.exists(full):
        return None, []
    try:
        with open(full) as f:
            m = json.load(f)
        files = m["files"]
        ok = isinstance(m.get("world_size", 1), int) and all(
            isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str) for e in files.values())
        if not ok or any(rel.startswith("/") or ".." in rel.split("/") for rel in files):
            raise ValueError("malformed file entries")
        return m, []
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        return None, [f"{full}: unreadable ({short_error(exc)})"]


def manifest_problems(path: str, manifest: dict, rank: Optional[int]) -> list[str]:
    files, out = manifest["files"], []
    need = [TRAINER, "rng_rank0.pt"] + ([f"{MODEL_DIR}/.metadata"] if any(r.startswith(MODEL_DIR + "/")
                                                                         for r in files) else [])
    if rank is not None and rank < manifest.get("world_size", 1):
        need.append(f"rng_rank{rank}.pt")
    out += [f"{os.path.join(path, rel)}: not listed in {MANIFEST}" for rel in need if rel not in files]
    read = [rel for rel in sorted(list_files(path)) if rel.split("/")[0] in (MODEL_DIR, ENGINE_DIR) or rel == TRAINER
            or RNG_FILE.fullmatch(rel)]  # what the loaders read, by name or by pattern
    out += [f"{os.path.join(path, rel)}: not listed in {MANIFEST} (added after the save)" for rel in read
            if rel not in files]
    return out


def compare_hashes(path: str, files: dict, hashed: dict) -> list[str]:
    out = []
    for rel in sorted(files):
        want, got, full = files[rel], hashed.get(rel, {"error": "not hashed"}), os.path.join(path, rel)
        if "error" in got:
            out.append(f"{full}: {got['error']} (listed in {MANIFEST})")
        elif got["size"] != want["size"]:
            out.append(f"{full}: {got['size']} bytes, {MANIFEST} says {want['size']} (truncated or rewritten)")
        elif got["sha256"] != want["sha256"]:
            out.append(f"{full}: contents differ from {MANIFEST} (same size, sha256 {got['sha256'][:12]}… "
                       f"instead of {want['sha256'][:12]}…): damaged in place")
    return out


def legacy_problems(path: str, rank: Optional[int]) -> list[str]:
    """What can be checked without a manifest."""
    out, listing = attempt(lambda: read_trainer(path))[1], list_files(path)
    out += [f"{os.path.join(path, rel)}: empty file" for rel, n in sorted(listing.items()) if n == 0]
    ranks = [int(m.group(1)) for rel in listing if (m := RNG_FILE.fullmatch(rel))]
    for r in {0, rank} if rank is not None else ():
        if r not in ranks and r <= max(ranks, default=0):  # rank 0 always writes one; a larger world may be new
            out.append(f"{os.path.join(path, f'rng_rank{r}.pt')}: missing")
    if os.path.isdir(os.path.join(path, MODEL_DIR)):
        out += dcp_problems(os.path.join(path, MODEL_DIR))
    return out


def dcp_problems(folder: str) -> list[str]:
    """DCP ``.metadata`` readable and every shard it names at least as long as its last item's end."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        md = FileSystemReader(folder).read_metadata()
    except Exception as exc:  # noqa: BLE001 (any unpickling error)
        return [f"{os.path.join(folder, '.metadata')}: unreadable ({short_error(exc)})"]
    ends: dict = {}
    for info in (getattr(md, "storage_data", None) or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    sizes = {rel: os.path.getsize(os.path.join(folder, rel)) if os.path.exists(os.path.join(folder, rel)) else None
             for rel in ends}
    return [f"{os.path.join(folder, rel)}: " + ("missing" if sizes[rel] is None else
                                                f"{sizes[rel]} bytes, .metadata needs {end} (truncated)")
            for rel, end in sorted(ends.items()) if sizes[rel] is None or sizes[rel] < end]


def verify_checkpoint(path: str, rank: Optional[int] = None) -> list[str]:
    """What is wrong with the checkpoint folder ``path``, one line per file (empty: it verifies). With
    ``manifest.json``: every listed file present with its size and sha256; ``trainer.json``, rank 0's and
    (``rank`` given) that rank's RNG file listed; no unlisted file where the loaders read. Without one: the
    checks of :func:`legacy_problems`. Collective (each rank hashes a share); the same list on every rank."""
    manifest, problems = read_manifest(path)
    files = manifest["files"] if manifest else {}
    hashed = hash_files(path, {rel: e["size"] for rel, e in files.items()})
    if manifest is not None:
        problems += manifest_problems(path, manifest, rank) + compare_hashes(path, files, hashed)
    elif not problems:
        problems += legacy_problems(path, rank)
    return agreed(problems)


def read_trainer(path: str) -> dict:
    full = os.path.join(path, TRAINER)
    try:
        with open(full) as f:
            state = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{full}: unreadable ({short_error(exc)})") from exc
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{full}: holds no integer 'step'")
    return state


def attempt(fn) -> tuple[object, list[str]]:
    """``(fn(), [])``, or ``(None, [what went wrong])`` for any error (a load's errors name their file)."""
    try:
        return fn(), []
    except Exception as exc:  # noqa: BLE001
        return None, [str(exc) if isinstance(exc, (CheckpointError, FileNotFoundError)) else short_error(exc)]
