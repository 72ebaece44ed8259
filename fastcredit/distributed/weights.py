"""Reading a run's training checkpoint back as HF weights, in one process, whatever wrote it.

    path = find_checkpoint("runs/x", step=200)         # the step's folder, verified against its manifest
    what = read_policy_weights(path, lm)               # FSDP2 (DCP) or DeepSpeed ZeRO, into lm in place
    key = checkpoint_key(path)                         # {"manifest_sha256": ...}: which save of the step it is

Both kinds of checkpoint ``fastcredit.distributed.checkpoint`` writes are read without a process
group: FSDP2's DCP folder (only the policy's ``policy.model.lm.*`` tensors, each reassembled from the
ranks' shards) and DeepSpeed ZeRO-2 / 3 (the fp32 master weights consolidated from every rank's
optimizer partition). Tied weights stay one tensor; a checkpoint whose tied copies differ, or whose
weights do not match the model by name and shape, is refused with the key named (ExportError).
``fastcredit.export`` writes the HF folder; ``fastcredit.prm.train`` reads its warm starts here too.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from typing import Optional

import torch

# Where the trainer keeps its policy: DCP nests ``{name: {"model": PolicyModel state dict}}``
# (fastcredit.distributed.checkpoint._app_state, named "policy" by Trainer._checkpointed), and PolicyModel holds
# the HF model as ``.lm``; DeepSpeed saves the PolicyModel's own state dict under engine/policy.
POLICY = "policy"
DCP_PREFIX = f"{POLICY}.model.lm."
ZERO_PREFIX = "lm."
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(ValueError):
    """The run, checkpoint or output folder cannot be exported as asked; the message names the file or key."""


def name_deepspeed_accelerator() -> None:
    # NOTE: DeepSpeed picks its accelerator at first import, probing for xpu / npu / ... packages and
    # warning on a CPU. Reading a ZeRO checkpoint imports it, and so does transformers' save_pretrained
    # (through accelerate); name it as the trainer does (fastcredit.distributed.deepspeed_engine).
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")


def find_checkpoint(run_dir: str, step: Optional[int] = None) -> str:
    """The folder of ``run_dir``'s checkpoint at ``step`` (default: the one ``checkpoints/latest`` names), its files
    checked against its manifest (``fastcredit.distributed.checkpoint.verify_checkpoint``)."""
    if not os.path.isdir(run_dir):
        raise ExportError(f"run folder {run_dir} does not exist")
    from fastcredit.distributed.checkpoint import (LATEST, CheckpointError, finished_steps, latest_checkpoint,
                                                   verify_checkpoint)

    ckpt_dir = os.path.join(run_dir, "checkpoints")
    steps = sorted(finished_steps(ckpt_dir))
    if not steps:
        raise ExportError(f"{ckpt_dir} holds no finished checkpoint (step_N folders): nothing to export")
    listing = ", ".join(map(str, steps))
    if step is None:
        try:
            path = latest_checkpoint(ckpt_dir)
        except (FileNotFoundError, CheckpointError) as exc:
            raise ExportError(f"{exc} (available steps: {listing})") from exc
        if path is None:
            raise ExportError(f"{os.path.join(ckpt_dir, LATEST)} is missing; pass --step (available: {listing})")
    else:
        path = os.path.join(ckpt_dir, f"step_{step:06d}")
        if step not in steps:
            raise ExportError(f"{ckpt_dir} has no checkpoint at step {step} ({os.path.basename(path)}); "
                              f"available steps: {listing}")
    problems = verify_checkpoint(path)  # its manifest's sizes and sha256 (fastcredit.distributed.checkpoint)
    if problems:
        raise ExportError(f"{path} is damaged; pass --step with another (available: {listing}):\n  "
                          + "\n  ".join(problems))
    return path


def checkpoint_key(ckpt: str) -> dict:
    """Which save of a step the checkpoint folder ``ckpt`` is: ``{"manifest_sha256": ...}``, the sha256 of its
    manifest.json, which lists every file's sha256, so a step saved again with other weights (a collapse-guard
    rollback rewrites step N) gets another key; without a manifest (an older fastcredit's checkpoint)
    ``{"listing_sha256": ...}`` of its files' names, sizes and modification times. Cheap: nothing else is read."""
    from fastcredit.distributed.checkpoint import MANIFEST

    try:
        with open(os.path.join(ckpt, MANIFEST), "rb") as f:
            return {"manifest_sha256": hashlib.sha256(f.read()).hexdigest()}
    except FileNotFoundError:
        pass
    listing = []
    for base, _, names in os.walk(ckpt):
        for name in names:
            st = os.stat(os.path.join(base, name))
            listing.append((os.path.relpath(os.path.join(base, name), ckpt), st.st_size, st.st_mtime_ns))
    return {"listing_sha256": hashlib.sha256(json.dumps(sorted(listing)).encode()).hexdigest()}


def tie_groups(lm: torch.nn.Module) -> list[list[str]]:
    """``lm``'s state-dict names grouped by the tensor they share (tied embeddings: one group of two)."""
    groups: dict = {}
    for name, t in lm.state_dict(keep_vars=True).items():
        groups.setdefault((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()), []).append(name)
    return list(groups.values())


def check_names_and_shapes(lm: torch.nn.Module, found: dict, where: str) -> list[list[str]]:
    """Compare the checkpoint's ``{HF name: shape}`` with ``lm``; returns each tie group's names present in it.

    Raises ExportError naming the first key the model lacks, lacks in the checkpoint, or whose shape differs."""
    own = lm.state_dict()
    hint = "the run's config.yaml does not describe the model that wrote this checkpoint"
    for name, shape in found.items():
        if name not in own:
            raise ExportError(f"{where} holds {name} {list(shape)}, which the policy built from config.yaml lacks "
                              f"({hint})")
        if tuple(own[name].shape) != tuple(shape):
            raise ExportError(f"{where}: {name} has shape {list(shape)} in the checkpoint but "
                              f"{list(own[name].shape)} in the policy built from config.yaml ({hint})")
    present = []
    for group in tie_groups(lm):
        names = [n for n in group if n in found]
        if not names:
            raise ExportError(f"{where} has no {group[0]}, which the policy built from config.yaml needs ({hint})")
        present.append(names)
    return present


def check_tied(names: list[str], tensors: list[torch.Tensor], where: str) -> None:
    """Raise ExportError when a tied group's copies (``tensors``, by ``names``) differ in the checkpoint."""
    for name, t in zip(names[1:], tensors[1:]):
        if not torch.equal(t, tensors[0]):
            raise ExportError(f"{where}: {names[0]} and {name} are one tied tensor in the model but differ in the "
                              "checkpoint")


def read_dcp_policy(folder: str, lm: torch.nn.Module) -> str:
    """Load the policy's weights from the DCP checkpoint ``folder`` (``step_N/model``) into ``lm``, in place.

    One process, no process group: DCP plans the read of each full tensor from whatever shards
    the ranks wrote. Only ``policy.model.lm.*`` is read. Returns a description of what was read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from fastcredit.distributed.engine import hf_name

    reader = dcp.FileSystemReader(folder)
    meta = reader.read_metadata()
    keys = {hf_name(k[len(DCP_PREFIX):]): k for k, m in meta.state_dict_metadata.items()
            if k.startswith(DCP_PREFIX) and isinstance(m, TensorStorageMetadata)}
    if not keys:
        raise ExportError(f"{folder}/.metadata has no {DCP_PREFIX}* tensors: no policy weights in this checkpoint")
    found = {n: tuple(meta.state_dict_metadata[k].size) for n, k in keys.items()}
    groups = check_names_and_shapes(lm, found, folder)
    own = lm.state_dict()
    targets = {}
    for names in groups:  # the first copy straight into the model's tensor, a tied twin beside it for the check
        targets[keys[names[0]]] = own[names[0]]
        targets.update({keys[n]: torch.empty_like(own[n]) for n in names[1:]})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(targets, storage_reader=reader, no_dist=True)
    for names in groups:
        check_tied(names, [targets[keys[n]] for n in names], folder)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".distcp"))
    return f"{len(keys)} tensors {DCP_PREFIX}* from DCP {folder} ({len(files)} shard file(s); optimizer state not read)"


def read_zero_policy(folder: str, lm: torch.nn.Module) -> str:
    """Load the policy's fp32 master weights from the DeepSpeed ZeRO checkpoint ``folder`` (``engine/policy``)
    into ``lm``, consolidating every rank's partition in this process. Returns a description of what was read."""
    name_deepspeed_accelerator()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from fastcredit.distributed.engine import hf_name

    ranks = sorted(f for f in os.listdir(folder) if f.endswith("_optim_states.pt"))
    try:  # lazy: each full tensor is assembled from the partitions only when it is copied into the model
        state = get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(folder), tag=os.path.basename(folder),
                                                         lazy_mode=True)
    except (ValueError, FileNotFoundError) as exc:
        raise ExportError(f"DeepSpeed could not consolidate {folder}: {exc}") from exc
    keys = {hf_name(k[len(ZERO_PREFIX):]): k for k in state if k.startswith(ZERO_PREFIX)}
    if not keys:
        raise ExportError(f"{folder} has no {ZERO_PREFIX}* weights: not a fastcredit policy checkpoint")
    groups = check_names_and_shapes(lm, {n: tuple(state[k].shape) for n, k in keys.items()}, folder)
    own = lm.state_dict()
    for names in groups:
        first = state[keys[names[0]]].contiguous()
        own[names[0]].copy_(first)
        # DeepSpeed's shared_params are one object already; anything else must hold the same values
        twins = [n for n in names[1:] if state[keys[n]] is not state[keys[names[0]]]]
        check_tied([names[0], *twins], [first, *(state[keys[n]].contiguous() for n in twins)], folder)
    return f"{len(keys)} tensors {ZERO_PREFIX}* from DeepSpeed ZeRO {folder} ({len(ranks)} rank partition(s))"


def read_policy_weights(ckpt: str, lm: torch.nn.Module) -> str:
    """Load the policy's weights of the checkpoint folder ``ckpt`` (``step_N``) into ``lm``, whichever engine
    wrote it; returns what was read."""
    zero, dcp_dir = os.path.join(ckpt, "engine", POLICY), os.path.join(ckpt, "model")
    if os.path.isdir(zero):
        return read_zero_policy(zero, lm)
    if os.path.isdir(dcp_dir):
        return read_dcp_policy(dcp_dir, lm)
    raise ExportError(f"{ckpt} has neither model/ (DCP, FSDP2) nor engine/{POLICY}/ (DeepSpeed): no policy weights")
