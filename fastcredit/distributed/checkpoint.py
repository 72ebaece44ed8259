"""Atomic, verified checkpoints: model(s), optimizer(s), scheduler(s), RNG states, data position, step.

Layout under ``<output_dir>/checkpoints/``::

    step_000040/            one finished checkpoint
        model/              torch.distributed.checkpoint (DCP) shards of models + optimizers (FSDP2)
        engine/<name>/      models + optimizers of engines that save themselves (DeepSpeed's
                            save_checkpoint: ZeRO partitions of every rank)
        trainer.json        step, data position, schedulers, anything JSON the trainer adds
        rng_rank<r>.pt      python / numpy / torch (/ cuda) generator states of rank r
        manifest.json       {"format": 1, "step": 40, "world_size": 2, "hash": "sha256",
                             "files": {"model/.metadata": {"size": 6163, "sha256": "9f2c…"}, …}}
    latest                  the name of the newest finished checkpoint

A checkpoint is written into ``step_N.tmp``; when every rank has finished its files the ranks
hash them (each a share, largest first, in 8 MiB chunks), rank 0 writes ``manifest.json`` last
and renames the folder; ``latest`` is replaced atomically afterwards. A crash at any point
leaves the previous checkpoint intact and ``latest`` pointing at it. DCP reloads FSDP2 shards
under any world size; DeepSpeed's ZeRO checkpoints under the same one.

:func:`resume_checkpoint` tries the checkpoint ``latest`` names, then the earlier ones, newest
first, and takes the first that verifies (:func:`verify_checkpoint`) and loads without error;
every rank takes the same one, and each problem is reported with its file. A checkpoint without
a manifest (an older fastcredit's) is accepted with a warning after the checks that need none.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

LATEST = "latest"
ENGINE_DIR = "engine"
MODEL_DIR = "model"
MANIFEST = "manifest.json"
TRAINER = "trainer.json"
FORMAT = 1
_CHUNK = 8 << 20  # bytes read per hash update
_THREADS = 4  # files one rank hashes at once (hashlib and file reads release the GIL)
_STEP = re.compile(r"step_(\d+)")
_RNG = re.compile(r"rng_rank(\d+)\.pt")
_OWNER = re.compile(r"(?:^__|pp_rank_|^rng_rank)(\d+)(?:_|\.pt$)")  # a rank's DCP shard, ZeRO partition, RNG


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names each file that is wrong and how."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


def _gather(obj) -> list:
    """``obj`` of every rank, in rank order (collective)."""
    out = [obj] + [None] * (_world() - 1)
    if _world() > 1:
        dist.all_gather_object(out, obj)
    return out


def _agreed(problems: list[str]) -> list[str]:
    """Every rank's problems, the same list on every rank (collective)."""
    return list(dict.fromkeys(p for part in _gather(problems) for p in part))


def _short(exc: BaseException) -> str:
    """``Type: first line`` of ``exc``; DCP's CheckpointException gives its first rank's own error."""
    for rank, (inner, _) in getattr(exc, "failures", {}).items():
        return f"rank {rank}: {_short(inner)}"
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _app_state(models: dict, optimizers: dict) -> dict:
    """``{name: {"model": ..., "optim": ...}}`` state dicts in DCP's sharded form."""
    out = {}
    for name, model in models.items():
        opt = optimizers.get(name)
        msd, osd = get_state_dict(model, opt if opt is not None else [])
        out[name] = {"model": msd, **({"optim": osd} if opt is not None else {})}
    return out


def file_sha256(path: str) -> tuple[int, str]:
    """``(bytes read, sha256 hex digest)`` of the file ``path``, read in chunks."""
    h, size, buf = hashlib.sha256(), 0, bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def _shares(sizes: dict, n: int) -> list[list[str]]:
    """``sizes`` (``{relative path: bytes}``) split over ``n`` ranks: a file named after the rank that wrote it
    to that rank (its page cache may still hold it), the others largest first onto the least loaded."""
    owner = {rel: int(m.group(1)) for rel in sizes if (m := _OWNER.search(rel.rsplit("/", 1)[-1]))
             and int(m.group(1)) < n}
    loads, shares = [0] * n, [[] for _ in range(n)]
    for rel in sorted(sizes, key=lambda r: (r not in owner, -sizes[r], r)):
        k = owner[rel] if rel in owner else loads.index(min(loads))
        shares[k].append(rel)
        loads[k] += sizes[rel]
    return shares


def _hash_all(folder: str, sizes: dict) -> dict:
    """``{relative path: {"size", "sha256"} or {"error"}}`` of the files ``sizes`` lists under ``folder``, each
    rank hashing a share (collective: every rank calls it, with the same ``sizes``, and gets the whole dict)."""
    def one(rel):
        try:
            return rel, dict(zip(("size", "sha256"), file_sha256(os.path.join(folder, rel))))
        except OSError as exc:
            return rel, {"error": "missing" if isinstance(exc, FileNotFoundError) else f"unreadable ({_short(exc)})"}

    mine = _shares(sizes, _world())[_rank()]
    with ThreadPoolExecutor(min(_THREADS, max(len(mine), 1))) as pool:
        local = dict(pool.map(one, mine))
    return {rel: entry for part in _gather(local) for rel, entry in part.items()}


def _listing(folder: str) -> dict:
    """``{relative path: bytes}`` of every file under ``folder`` but the manifest, ``/``-separated."""
    out = {}
    for base, _, names in os.walk(folder):
        for name in names:
            full = os.path.join(base, name)
            rel = os.path.relpath(full, folder).replace(os.sep, "/")
            if rel != MANIFEST:
                out[rel] = os.path.getsize(full)
    return out


def _write_manifest(folder: str, step: int) -> None:
    """Hash every file of ``folder`` (collective) and write its manifest on rank 0."""
    files = _hash_all(folder, _gather(_listing(folder) if _rank() == 0 else None)[0])  # rank 0's listing
    bad = [f"{os.path.join(folder, rel)}: {e['error']}" for rel, e in sorted(files.items()) if "error" in e]
    if bad:  # the same dict on every rank: all raise together
        raise CheckpointError("cannot hash the checkpoint just written: " + "; ".join(bad))
    if _rank() == 0:
        manifest = {"format": FORMAT, "step": step, "world_size": _world(), "hash": "sha256",
                    "files": dict(sorted(files.items()))}
        _write_synced(os.path.join(folder, MANIFEST), json.dumps(manifest, indent=1))


def save_checkpoint(root: str, step: int, models: dict, optimizers: dict, trainer_state: dict,
                    keep: int = 2, engines: Optional[dict] = None) -> str:
    """Write ``root/step_<step>`` atomically on every rank (collective), with its manifest; returns its path.

    ``engines``: ``{name: engine}`` whose ``save_state(folder)`` writes a model and its optimizer itself (into
    ``engine/<name>``), next to the DCP ``models`` / ``optimizers``. ``keep``: see :func:`_prune`."""
    name = f"step_{step:06d}"
    final, tmp = os.path.join(root, name), os.path.join(root, name + ".tmp")
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    if models:
        with warnings.catch_warnings():  # one process: DCP warns that it saves without a process group
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(_app_state(models, optimizers), checkpoint_id=os.path.join(tmp, MODEL_DIR))
    for key, engine in (engines or {}).items():
        engine.save_state(os.path.join(tmp, ENGINE_DIR, key))
    torch.save(rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(tmp, TRAINER), "w") as f:
            json.dump({"step": step, **trainer_state}, f, indent=1)
    _barrier()
    _write_manifest(tmp, step)
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_latest(root, name)
        _prune(root, keep, name)
    _barrier()
    return final


def _write_synced(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _write_latest(root: str, name: str) -> None:
    _write_synced(os.path.join(root, LATEST), name + "\n")


def finished_steps(root: str) -> dict:
    """``{step: folder name}`` of the finished checkpoints under ``root``."""
    if not os.path.isdir(root):
        return {}
    return {int(m.group(1)): d for d in os.listdir(root)
            if (m := _STEP.fullmatch(d)) and os.path.isdir(os.path.join(root, d))}


def _prune(root: str, keep: int, newest: str) -> None:
    """Keep ``newest`` (just written and hashed: it verifies) and the ``keep - 1`` checkpoints before it; delete
    older ones, and later-numbered ones (a timeline a fall-back or rollback abandoned). ``keep`` <= 0: none."""
    if keep <= 0:
        return
    top, steps = int(_STEP.fullmatch(newest).group(1)), finished_steps(root)
    older = sorted(s for s in steps if s < top)
    for s in older[:max(len(older) - (keep - 1), 0)] + [s for s in steps if s > top]:
        shutil.rmtree(os.path.join(root, steps[s]), ignore_errors=True)


def _read_latest(root: str) -> tuple[Optional[str], Optional[str]]:
    """``(name, None)`` from ``root/latest``, or ``(None, what is wrong)``; ``(None, None)`` when it is absent."""
    path = os.path.join(root, LATEST)
    try:
        with open(path, "rb") as f:
            raw = f.read(256)
    except OSError as exc:
        return None, None if isinstance(exc, FileNotFoundError) else f"{path} is unreadable ({_short(exc)})"
    name = raw.decode("utf-8", errors="replace").strip()
    if not name:
        return None, f"{path} is empty"
    if not _STEP.fullmatch(name):
        return None, f"{path} holds {name[:60]!r}, not a checkpoint name (step_N)"
    return name, None


def latest_checkpoint(root: str) -> Optional[str]:
    """The checkpoint ``root/latest`` names, or None without one; not verified (see :func:`resume_checkpoint`)."""
    name, problem = _read_latest(root)
    if problem:
        raise CheckpointError(problem)
    if name and not os.path.isdir(os.path.join(root, name)):
        raise FileNotFoundError(f"{os.path.join(root, LATEST)} names {name!r}, which is not in {root}: the "
                                "checkpoint folder was removed")
    return os.path.join(root, name) if name else None


def checkpoint_candidates(root: str) -> tuple[list[str], list[str]]:
    """``(paths, notes)``: the checkpoint ``latest`` names, then the earlier ones, newest first; the notes say
    what is wrong with ``latest`` (then every finished checkpoint is a candidate, or those before the one it
    names when that one is gone). Checkpoints after the one ``latest`` names (a save killed before ``latest``
    moved) are left out."""
    steps = finished_steps(root)
    name, problem = _read_latest(root)
    if name is None and problem is None and steps:
        problem = f"{os.path.join(root, LATEST)} is missing"
    top = int(_STEP.fullmatch(name).group(1)) if name else max(steps, default=0) + 1
    if name and top not in steps:
        problem = f"{os.path.join(root, LATEST)} names {name}, which is not in {root}"
    elif name:
        top += 1
    paths = [os.path.join(root, steps[s]) for s in sorted((s for s in steps if s < top), reverse=True)]
    if problem:
        problem += f"; trying {', '.join(map(os.path.basename, paths)) or 'nothing'} (newest first)"
    return paths, [problem] if problem else []


def _read_manifest(path: str) -> tuple[Optional[dict], list[str]]:
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
        return None, [f"{full}: unreadable ({_short(exc)})"]


def _manifest_problems(path: str, manifest: dict, rank: Optional[int]) -> list[str]:
    files, out = manifest["files"], []
    need = [TRAINER, "rng_rank0.pt"] + ([f"{MODEL_DIR}/.metadata"] if any(r.startswith(MODEL_DIR + "/")
                                                                         for r in files) else [])
    if rank is not None and rank < manifest.get("world_size", 1):
        need.append(f"rng_rank{rank}.pt")
    out += [f"{os.path.join(path, rel)}: not listed in {MANIFEST}" for rel in need if rel not in files]
    read = [rel for rel in sorted(_listing(path)) if rel.split("/")[0] in (MODEL_DIR, ENGINE_DIR) or rel == TRAINER
            or _RNG.fullmatch(rel)]  # what the loaders read, by name or by pattern
    out += [f"{os.path.join(path, rel)}: not listed in {MANIFEST} (added after the save)" for rel in read
            if rel not in files]
    return out


def _compare(path: str, files: dict, hashed: dict) -> list[str]:
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


def _legacy_problems(path: str, rank: Optional[int]) -> list[str]:
    """What can be checked without a manifest."""
    out, listing = _attempt(lambda: _read_trainer(path))[1], _listing(path)
    out += [f"{os.path.join(path, rel)}: empty file" for rel, n in sorted(listing.items()) if n == 0]
    ranks = [int(m.group(1)) for rel in listing if (m := _RNG.fullmatch(rel))]
    for r in {0, rank} if rank is not None else ():
        if r not in ranks and r <= max(ranks, default=0):  # rank 0 always writes one; a larger world may be new
            out.append(f"{os.path.join(path, f'rng_rank{r}.pt')}: missing")
    if os.path.isdir(os.path.join(path, MODEL_DIR)):
        out += _dcp_problems(os.path.join(path, MODEL_DIR))
    return out


def _dcp_problems(folder: str) -> list[str]:
    """DCP ``.metadata`` readable and every shard it names at least as long as its last item's end."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        md = FileSystemReader(folder).read_metadata()
    except Exception as exc:  # noqa: BLE001 (any unpickling error)
        return [f"{os.path.join(folder, '.metadata')}: unreadable ({_short(exc)})"]
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
    checks of :func:`_legacy_problems`. Collective (each rank hashes a share); the same list on every rank."""
    manifest, problems = _read_manifest(path)
    files = manifest["files"] if manifest else {}
    hashed = _hash_all(path, {rel: e["size"] for rel, e in files.items()})
    if manifest is not None:
        problems += _manifest_problems(path, manifest, rank) + _compare(path, files, hashed)
    elif not problems:
        problems += _legacy_problems(path, rank)
    return _agreed(problems)


def _read_trainer(path: str) -> dict:
    full = os.path.join(path, TRAINER)
    try:
        with open(full) as f:
            state = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{full}: unreadable ({_short(exc)})") from exc
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{full}: holds no integer 'step'")
    return state


def _read_small(path: str, rank: int) -> tuple[dict, Optional[dict]]:
    """``(trainer state, this rank's RNG state or None when the world that wrote it was smaller)``."""
    state, rng_path = _read_trainer(path), os.path.join(path, f"rng_rank{rank}.pt")
    if not os.path.exists(rng_path):
        return state, None
    try:
        return state, torch.load(rng_path, weights_only=False)
    except Exception as exc:  # noqa: BLE001 (EOFError, zip or unpickling errors of a damaged file)
        raise CheckpointError(f"{rng_path}: unreadable ({_short(exc)})") from exc


def _load_large(path: str, models: dict, optimizers: dict, engines: Optional[dict]) -> None:
    """Models and optimizers (DCP), then engines that load themselves (collective)."""
    if models:
        if not os.path.isdir(os.path.join(path, MODEL_DIR)):
            raise FileNotFoundError(f"{path} has no model/ (DCP): it was written by another distributed.engine")
        try:
            _load_dcp(path, models, optimizers)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 (whatever DCP's reader met)
            raise CheckpointError(f"{os.path.join(path, MODEL_DIR)} (DCP): {_short(exc)}") from exc
    for name, engine in (engines or {}).items():
        folder = os.path.join(path, ENGINE_DIR, name)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{path} has no {ENGINE_DIR}/{name}: it was written by another distributed.engine")
        try:
            engine.load_state(folder)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{folder}: {_short(exc)}") from exc


def load_checkpoint(path: str, models: dict, optimizers: dict, engines: Optional[dict] = None) -> dict:
    """Load models, optimizers (and ``engines``, see :func:`save_checkpoint`) and this rank's RNG state
    from ``path``; returns the trainer state. Unverified; an unreadable file raises CheckpointError naming it."""
    state, rng = _read_small(path, _rank())
    _load_large(path, models, optimizers, engines)
    if rng is not None:
        set_rng_state(rng)
    return state


def _attempt(fn) -> tuple[object, list[str]]:
    """``(fn(), [])``, or ``(None, [what went wrong])`` for any error (a load's errors name their file)."""
    try:
        return fn(), []
    except Exception as exc:  # noqa: BLE001
        return None, [str(exc) if isinstance(exc, (CheckpointError, FileNotFoundError)) else _short(exc)]


def resume_checkpoint(root: str, models: dict, optimizers: dict, engines: Optional[dict] = None,
                      say: Callable[[str], None] = print) -> Optional[tuple[str, dict]]:
    """Load the newest checkpoint under ``root`` that verifies and loads (collective: every rank the same one);
    returns ``(its path, the trainer state)``, or None when ``root`` holds none. ``say`` (rank 0's console)
    hears each checkpoint passed over with its files' problems, and which one is used instead. Raises
    CheckpointError listing every checkpoint's problems when none can be used."""
    say = say if _rank() == 0 else (lambda text: None)
    paths, notes = checkpoint_candidates(root)
    for note in notes:
        say(note)
    failed = []
    for path in paths:
        problems = verify_checkpoint(path, rank=_rank())
        if not problems and not os.path.exists(os.path.join(path, MANIFEST)):
            say(f"warning: {path} has no {MANIFEST} (written by an older fastcredit): its files' contents "
                "cannot be verified")
        if not problems:  # the reads that are not collective first, so a rank never waits alone in one
            small, errs = _attempt(lambda: _read_small(path, _rank()))
            problems = _agreed(errs)
        if not problems:
            problems = _agreed(_attempt(lambda: _load_large(path, models, optimizers, engines))[1])
        if not problems:
            state, rng = small
            if rng is not None:
                set_rng_state(rng)
            if failed or notes:
                say(f"{'falling back to' if failed else 'using'} {path}, the newest checkpoint that verifies")
            return path, state
        say(f"checkpoint {path} cannot be used:\n  " + "\n  ".join(problems))
        failed.append((path, problems))
    if not failed:
        return None
    raise CheckpointError(f"no checkpoint under {root} can be resumed:\n" + "\n".join(
        f"  {os.path.basename(p)}: " + "; ".join(pr) for p, pr in failed))


def _load_dcp(path: str, models: dict, optimizers: dict) -> None:
    # NOTE: DCP builds a fresh optimizer's state template with a zero-gradient step, which it
    # skips when any parameter still holds a gradient; the template is then empty and the
    # optimizer state silently stays unloaded. Clear the gradients first.
    for model in models.values():
        model.zero_grad(set_to_none=True)
    state = _app_state(models, optimizers)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=os.path.join(path, MODEL_DIR))
    for name, model in models.items():
        opt = optimizers.get(name)
        set_state_dict(model, opt if opt is not None else [], model_state_dict=state[name]["model"],
                       optim_state_dict=state[name].get("optim", {}))
