"""Export a run's training checkpoint as a Hugging Face model folder that transformers and vLLM load.

    python -m fastcredit.export --run runs/demo --out exports/demo                  # the run's latest checkpoint
    python -m fastcredit.export --run runs/x --step 200 --out exports/x-200 --dtype bfloat16
    python -m fastcredit.export --run runs/x --out exports/x --force                # replace an earlier export

The folder holds config.json, model.safetensors (sharded with an index above --max-shard-size),
the tokenizer's files and generation_config.json. The architecture comes from the run itself:
its config.yaml (the merged TrainConfig) builds the policy as the trainer does
(``fastcredit.trainer.parts.load_policy``; the tiny policy's tokenizer is the one in the run
folder), then the checkpoint's policy weights replace the built ones. Both kinds of checkpoint
``fastcredit.distributed.checkpoint`` writes are read in this one process, without a process group, whatever
number of ranks wrote them:

* FSDP2 (``step_N/model/``, DCP): only the keys ``policy.model.lm.<HF name>`` are read (no
  optimizer state); DCP reassembles each full tensor from the ranks' shards, in place in the model.
* DeepSpeed ZeRO-2 / 3 (``step_N/engine/policy/``, one ``zero_pp_rank_*`` pair per rank):
  DeepSpeed's ``zero_to_fp32`` consolidates the fp32 master weights (keys ``lm.<HF name>``) from
  the optimizer partitions, dropping the Adam moments as it reads them.

NOTE: transformers 5 makes ``AutoTokenizer`` build the model type's own tokenizer class for some
types (qwen2 among them) whatever tokenizer_config.json names; ``Qwen2Tokenizer`` then re-splits
text with Qwen's pattern, which the tiny policy's tokenizer was not trained with. The export says
so when it happens; :func:`load_tokenizer` loads the class the folder names, as the run tokenized.
Token ids given directly (vLLM's ``TokensPrompt``, ``generate(input_ids)``) are unaffected.

Tied weights (LM head and embeddings) stay one tensor; a checkpoint whose two copies differ,
or whose weights do not match the model by name and shape, is refused with the key named.
Exit status: 0 done, 2 bad input (missing run, checkpoint or step; occupied --out; weights that
do not fit the run's model).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from typing import Callable, Optional

import torch

# Where the trainer keeps its policy: DCP nests ``{name: {"model": PolicyModel state dict}}``
# (fastcredit.distributed.checkpoint._app_state, named "policy" by Trainer._checkpointed), and PolicyModel holds
# the HF model as ``.lm``; DeepSpeed saves the PolicyModel's own state dict under engine/policy.
POLICY = "policy"
DCP_PREFIX = f"{POLICY}.model.lm."
ZERO_PREFIX = "lm."
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_SHARD = "5GB"


class ExportError(ValueError):
    """The run, checkpoint or output folder cannot be exported as asked; the message names the file or key."""


def _say(text: str) -> None:
    print(f"export: {text}", flush=True)


def _name_deepspeed_accelerator() -> None:
    # NOTE: DeepSpeed picks its accelerator at first import, probing for xpu / npu / ... packages and
    # warning on a CPU. Reading a ZeRO checkpoint imports it, and so does transformers' save_pretrained
    # (through accelerate); name it as the trainer does (fastcredit.distributed.deepspeed_engine).
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")


def find_checkpoint(run_dir: str, step: Optional[int] = None) -> str:
    """The folder of ``run_dir``'s checkpoint at ``step`` (default: the one ``checkpoints/latest`` names), its files
    checked against its manifest (``fastcredit.distributed.checkpoint.verify_checkpoint``)."""
    if not os.path.isdir(run_dir):
        raise ExportError(f"run folder {run_dir} does not exist")
    from fastcredit.distributed.checkpoint import LATEST, CheckpointError, finished_steps, latest_checkpoint, verify_checkpoint

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


def _check_out(out_dir: str, run_dir: str, force: bool) -> None:
    """Refuse an occupied ``out_dir`` unless ``force`` (then only an earlier export: a folder with config.json)."""
    out, run = os.path.realpath(out_dir), os.path.realpath(run_dir)
    if out == run or run.startswith(out + os.sep):
        raise ExportError(f"--out {out_dir} would replace the run folder {run_dir}: choose another folder")
    if os.path.isfile(out_dir):
        raise ExportError(f"--out {out_dir} is a file")
    if not os.path.isdir(out_dir) or not os.listdir(out_dir):
        return
    if not force:
        raise ExportError(f"--out {out_dir} exists and is not empty; pass --force to replace it")
    if not os.path.exists(os.path.join(out_dir, "config.json")):
        raise ExportError(f"--out {out_dir} is not empty and holds no config.json: --force replaces an earlier "
                          "export only; empty or remove the folder yourself")


def build_policy(run_dir: str):
    """``(cfg, lm, tokenizer)``: the run's policy as its config.yaml builds it (float32, untrained weights)."""
    from fastcredit.trainer import parts as C
    from fastcredit.config import load_config

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        raise ExportError(f"{path} is missing: the run's merged config says which model to build")
    cfg = load_config(path)
    if cfg.model.policy == "tiny" and not cfg.model.tokenizer:
        # generated by the run (components.load_tokenizer) into its output folder, wherever that is now
        folder = os.path.join(run_dir, "tokenizer")
        if not os.path.exists(os.path.join(folder, "tokenizer.json")):
            raise ExportError(f"{folder}/tokenizer.json is missing: the tiny policy's tokenizer is generated into "
                              "the run folder by the trainer")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        return cfg, C.load_policy(cfg, tokenizer), tokenizer
    try:  # a local or packaged model: its path in config.yaml is read as the trainer read it
        tokenizer = C.load_tokenizer(cfg, None, run_dir)  # no data needed beyond the tiny policy
        return cfg, C.load_policy(cfg, tokenizer), tokenizer
    except OSError as exc:
        raise ExportError(f"{path}: model.policy={cfg.model.policy!r} (model.tokenizer={cfg.model.tokenizer!r}) "
                          f"cannot be loaded from {os.getcwd()}, and the export builds the model from it: {exc}") \
            from exc


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


def _check_tied(names: list[str], tensors: list[torch.Tensor], where: str) -> None:
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
        _check_tied(names, [targets[keys[n]] for n in names], folder)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".distcp"))
    return f"{len(keys)} tensors {DCP_PREFIX}* from DCP {folder} ({len(files)} shard file(s); optimizer state not read)"


def read_zero_policy(folder: str, lm: torch.nn.Module) -> str:
    """Load the policy's fp32 master weights from the DeepSpeed ZeRO checkpoint ``folder`` (``engine/policy``)
    into ``lm``, consolidating every rank's partition in this process. Returns a description of what was read."""
    _name_deepspeed_accelerator()
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
        _check_tied([names[0], *twins], [first, *(state[keys[n]].contiguous() for n in twins)], folder)
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


# Text that tells tokenizers apart: digits after a space, tags, quotes, non-ASCII letters, blank lines.
PROBE = 'Doc 1(Title: "Zoë Ödön") was born in 1987.\n\n<search> who founded it? </search> <answer>x</answer>'


def load_tokenizer(folder: str):
    """The tokenizer of an exported ``folder`` as the run used it: the class its tokenizer_config.json names
    (``AutoTokenizer`` may substitute the model type's class; see the module docstring)."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    path, name = os.path.join(folder, "tokenizer_config.json"), None
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    cls = tokenizer_class_from_name(name) if name else None
    return (cls or AutoTokenizer).from_pretrained(folder)


def _tokenizer_check(folder: str, tokenizer, out_dir: str) -> Optional[str]:
    """None when ``AutoTokenizer`` reads ``folder`` (written for ``out_dir``) as the run tokenized; else a note
    saying how to load it. Raises ExportError when even :func:`load_tokenizer` does not."""
    from transformers import AutoTokenizer

    want = tokenizer(PROBE)["input_ids"]
    saved = load_tokenizer(folder)
    if saved(PROBE)["input_ids"] != want:
        raise ExportError(f"the tokenizer saved for {out_dir} ({type(saved).__name__}) splits text differently from "
                          f"the run's ({type(tokenizer).__name__})")
    auto = AutoTokenizer.from_pretrained(folder)
    if auto(PROBE)["input_ids"] == want:
        return None
    return (f"NOTE: AutoTokenizer.from_pretrained({out_dir}) builds {type(auto).__name__}, which splits text "
            f"differently from the run's {type(tokenizer).__name__}; load it with "
            f"fastcredit.export.load_tokenizer or {type(saved).__name__}.from_pretrained (token ids are unaffected)")


def _write(lm, tokenizer, out_dir: str, dtype: torch.dtype, max_shard_size: str) -> tuple[list[str], Optional[str]]:
    """Save into a sibling folder, check its tokenizer, then move it into place: an interrupted or refused export
    leaves no half-written ``out_dir``. Returns the files and the tokenizer's note (:func:`_tokenizer_check`)."""
    out = os.path.normpath(out_dir)
    tmp = f"{out}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    try:
        lm.to(dtype).save_pretrained(tmp, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(tmp)
        note = _tokenizer_check(tmp, tokenizer, out)
        if os.path.isdir(out):  # empty, or an earlier export that _check_out let --force replace
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(os.listdir(out)), note


def export_checkpoint(run_dir: str, out_dir: str, step: Optional[int] = None, dtype: str = "float32",
                      force: bool = False, max_shard_size: str = DEFAULT_SHARD,
                      say: Callable[[str], None] = _say) -> str:
    """Write ``run_dir``'s checkpoint at ``step`` (default: the latest) to ``out_dir`` as a Hugging Face folder
    in ``dtype`` (float32, bfloat16, float16); returns ``out_dir``. See the module docstring."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    _name_deepspeed_accelerator()
    ckpt = find_checkpoint(run_dir, step)
    _check_out(out_dir, run_dir, force)
    cfg, lm, tokenizer = build_policy(run_dir)
    n_params = sum(p.numel() for p in lm.parameters())
    say(f"{run_dir}: {os.path.basename(ckpt)}, policy {cfg.model.policy} ({type(lm).__name__}, "
        f"{n_params:,} parameters, {len(tokenizer)} tokens)")
    say("read " + read_policy_weights(ckpt, lm))
    files, note = _write(lm, tokenizer, out_dir, DTYPES[dtype], max_shard_size)
    say(f"wrote {out_dir} ({dtype}): {', '.join(files)}")
    if note:
        say(note)
    return out_dir


def main(argv: Optional[list] = None) -> int:
    from fastcredit.config.help import argparser
    from fastcredit.config import ConfigError

    p = argparser("python -m fastcredit.export", __doc__)
    p.add_argument("--run", required=True, metavar="RUN", help="the run folder (logging.output_dir of the training)")
    p.add_argument("--out", required=True, metavar="DIR", help="the Hugging Face folder to write")
    p.add_argument("--step", type=int, metavar="N", help="the checkpoint step (default: checkpoints/latest)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="the weights' dtype")
    p.add_argument("--max-shard-size", default=DEFAULT_SHARD, metavar="SIZE",
                   help="the largest safetensors file; bigger models are sharded with an index")
    p.add_argument("--force", action="store_true", help="replace --out when it holds an earlier export")
    args = p.parse_args(argv)
    try:
        export_checkpoint(args.run, args.out, args.step, args.dtype, args.force, args.max_shard_size)
    except (ExportError, ConfigError) as exc:
        print(f"export error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
