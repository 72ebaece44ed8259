"""Atomic checkpoints: model(s), optimizer(s), scheduler(s), RNG states, data position, step.

Layout under ``<output_dir>/checkpoints/``::

    step_000040/            one finished checkpoint
        model/              torch.distributed.checkpoint (DCP) shards of models + optimizers (FSDP2)
        engine/<name>/      models + optimizers of engines that save themselves (DeepSpeed's
                            save_checkpoint: ZeRO partitions of every rank)
        trainer.json        step, data position, schedulers, anything JSON the trainer adds
        rng_rank<r>.pt      python / numpy / torch (/ cuda) generator states of rank r
    latest                  the name of the newest finished checkpoint

A checkpoint is written into ``step_N.tmp`` and renamed when every rank has finished its
part; ``latest`` is replaced atomically afterwards. A crash at any point leaves the
previous checkpoint intact and ``latest`` pointing at it, so ``--resume`` never reads a
half-written step. DCP saves FSDP2 shards in parallel from every rank and reloads them
under any world size; on one process it writes plain tensors the same way. DeepSpeed's
ZeRO checkpoints reload under the same world size (its ``zero_to_fp32.py``, written next
to them, consolidates one into plain weights).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

LATEST = "latest"
ENGINE_DIR = "engine"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


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
    """Write ``root/step_<step>`` atomically on every rank (collective); returns its path.

    ``engines``: ``{name: engine}`` whose ``save_state(folder)`` writes a model and its
    optimizer itself (into ``engine/<name>``), next to the DCP ``models`` / ``optimizers``.
    """
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
            dcp.save(_app_state(models, optimizers), checkpoint_id=os.path.join(tmp, "model"))
    for key, engine in (engines or {}).items():
        engine.save_state(os.path.join(tmp, ENGINE_DIR, key))
    torch.save(rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(tmp, "trainer.json"), "w") as f:
            json.dump({"step": step, **trainer_state}, f, indent=1)
    _barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_latest(root, name)
        _prune(root, keep)
    _barrier()
    return final


def _write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))


def _prune(root: str, keep: int) -> None:
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp"))
    for d in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def latest_checkpoint(root: str) -> Optional[str]:
    """The newest finished checkpoint under ``root``, or None."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        name = f.read().strip()
    full = os.path.join(root, name)
    if not os.path.isdir(full):
        raise FileNotFoundError(f"{path} names {name!r}, which is not in {root}: the checkpoint folder was removed")
    return full


def load_checkpoint(path: str, models: dict, optimizers: dict, engines: Optional[dict] = None) -> dict:
    """Load models, optimizers (and ``engines``, see :func:`save_checkpoint`) and this rank's RNG state
    from ``path``; returns the trainer state."""
    if models:
        if not os.path.isdir(os.path.join(path, "model")):
            raise FileNotFoundError(f"{path} has no model/ (DCP): it was written by another distributed.engine")
        _load_dcp(path, models, optimizers)
    for name, engine in (engines or {}).items():
        folder = os.path.join(path, ENGINE_DIR, name)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{path} has no {ENGINE_DIR}/{name}: it was written by another distributed.engine")
        engine.load_state(folder)
    rng_path = os.path.join(path, f"rng_rank{_rank()}.pt")
    if os.path.exists(rng_path):
        set_rng_state(torch.load(rng_path, weights_only=False))
    with open(os.path.join(path, "trainer.json")) as f:
        return json.load(f)


def _load_dcp(path: str, models: dict, optimizers: dict) -> None:
    # NOTE: DCP builds a fresh optimizer's state template with a zero-gradient step, which it
    # skips when any parameter still holds a gradient; the template is then empty and the
    # optimizer state silently stays unloaded. Clear the gradients first.
    for model in models.values():
        model.zero_grad(set_to_none=True)
    state = _app_state(models, optimizers)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=os.path.join(path, "model"))
    for name, model in models.items():
        opt = optimizers.get(name)
        set_state_dict(model, opt if opt is not None else [], model_state_dict=state[name]["model"],
                       optim_state_dict=state[name].get("optim", {}))
