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

import json
import os
import random
import re
import shutil
import warnings
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

# the manifest and verification (re-exported: this module is where callers find the checkpoint API)
from fastcredit.distributed.manifest import (ENGINE_DIR, MANIFEST, MODEL_DIR, TRAINER, CheckpointError,  # noqa: F401
                                             agreed, attempt, barrier, checkpoint_group, file_sha256, read_trainer,
                                             short_error, this_rank, verify_checkpoint, write_manifest, write_synced)

LATEST = "latest"
_STEP = re.compile(r"step_(\d+)")


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


def save_checkpoint(root: str, step: int, models: dict, optimizers: dict, trainer_state: dict,
                    keep: int = 2, engines: Optional[dict] = None) -> str:
    """Write ``root/step_<step>`` atomically on every rank (collective), with its manifest; returns its path.

    ``engines``: ``{name: engine}`` whose ``save_state(folder)`` writes a model and its optimizer itself (into
    ``engine/<name>``), next to the DCP ``models`` / ``optimizers``. ``keep``: see :func:`_prune`."""
    name = f"step_{step:06d}"
    final, tmp = os.path.join(root, name), os.path.join(root, name + ".tmp")
    rank = this_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    if models:
        with warnings.catch_warnings():  # one process: DCP warns that it saves without a process group
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(_app_state(models, optimizers), checkpoint_id=os.path.join(tmp, MODEL_DIR),
                     process_group=checkpoint_group())
    for key, engine in (engines or {}).items():
        engine.save_state(os.path.join(tmp, ENGINE_DIR, key))
    torch.save(rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(tmp, TRAINER), "w") as f:
            json.dump({"step": step, **trainer_state}, f, indent=1)
    barrier()
    write_manifest(tmp, step)
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_latest(root, name)
        _prune(root, keep, name)
    barrier()
    return final


def write_latest(root: str, name: str) -> None:
    write_synced(os.path.join(root, LATEST), name + "\n")


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
        return None, None if isinstance(exc, FileNotFoundError) else f"{path} is unreadable ({short_error(exc)})"
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


def _read_small(path: str, rank: int) -> tuple[dict, Optional[dict]]:
    """``(trainer state, this rank's RNG state or None when the world that wrote it was smaller)``."""
    state, rng_path = read_trainer(path), os.path.join(path, f"rng_rank{rank}.pt")
    if not os.path.exists(rng_path):
        return state, None
    try:
        return state, torch.load(rng_path, weights_only=False)
    except Exception as exc:  # noqa: BLE001 (EOFError, zip or unpickling errors of a damaged file)
        raise CheckpointError(f"{rng_path}: unreadable ({short_error(exc)})") from exc


def _load_large(path: str, models: dict, optimizers: dict, engines: Optional[dict]) -> None:
    """Models and optimizers (DCP), then engines that load themselves (collective)."""
    if models:
        if not os.path.isdir(os.path.join(path, MODEL_DIR)):
            raise FileNotFoundError(f"{path} has no model/ (DCP): it was written by another distributed.engine")
        try:
            _load_dcp(path, models, optimizers)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 (whatever DCP's reader met)
            raise CheckpointError(f"{os.path.join(path, MODEL_DIR)} (DCP): {short_error(exc)}") from exc
    for name, engine in (engines or {}).items():
        folder = os.path.join(path, ENGINE_DIR, name)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{path} has no {ENGINE_DIR}/{name}: it was written by another distributed.engine")
        try:
            engine.load_state(folder)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{folder}: {short_error(exc)}") from exc


def load_checkpoint(path: str, models: dict, optimizers: dict, engines: Optional[dict] = None) -> dict:
    """Load models, optimizers (and ``engines``, see :func:`save_checkpoint`) and this rank's RNG state
    from ``path``; returns the trainer state. Unverified; an unreadable file raises CheckpointError naming it."""
    state, rng = _read_small(path, this_rank())
    _load_large(path, models, optimizers, engines)
    if rng is not None:
        set_rng_state(rng)
    return state


def resume_checkpoint(root: str, models: dict, optimizers: dict, engines: Optional[dict] = None,
                      say: Callable[[str], None] = print) -> Optional[tuple[str, dict]]:
    """Load the newest checkpoint under ``root`` that verifies and loads (collective: every rank the same one);
    returns ``(its path, the trainer state)``, or None when ``root`` holds none. ``say`` (rank 0's console)
    hears each checkpoint passed over with its files' problems, and which one is used instead. Raises
    CheckpointError listing every checkpoint's problems when none can be used."""
    say = say if this_rank() == 0 else (lambda text: None)
    paths, notes = checkpoint_candidates(root)
    for note in notes:
        say(note)
    failed = []
    for path in paths:
        problems = verify_checkpoint(path, rank=this_rank())
        if not problems and not os.path.exists(os.path.join(path, MANIFEST)):
            say(f"warning: {path} has no {MANIFEST} (written by an older fastcredit): its files' contents "
                "cannot be verified")
        if not problems:  # the reads that are not collective first, so a rank never waits alone in one
            small, errs = attempt(lambda: _read_small(path, this_rank()))
            problems = agreed(errs)
        if not problems:
            problems = agreed(attempt(lambda: _load_large(path, models, optimizers, engines))[1])
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
        dcp.load(state, checkpoint_id=os.path.join(path, MODEL_DIR), process_group=checkpoint_group())
    for name, model in models.items():
        opt = optimizers.get(name)
        set_state_dict(model, opt if opt is not None else [], model_state_dict=state[name]["model"],
                       optim_state_dict=state[name].get("optim", {}))
