"""fastcredit's side of the race against TRL (``bench/race_trl.py``): its steps timed, its step batches recorded for
TRL to replay, and the start policy written once as a Hugging Face folder that TRL loads.

    python -m bench.race_fastcredit prepare --config configs/demo.yaml --start W/start W/...overrides
    python -m bench.race_fastcredit steps --config configs/demo.yaml --work W --steps 4 --record W/replay

``prepare`` builds fastcredit's trainer for the config (its warm start made, or loaded from
``warmstart.cache_dir``), writes the policy it starts from into ``--start`` (weights and tokenizer, read back and
compared tensor by tensor) and the two digests of those weights (``digest.json``: fastcredit's over its training
engine's tensors, ``bench.bench_step.weights_digest``; TRL's over the folder's model, :func:`folder_digest`).
``steps`` trains ``--steps`` steps in this process, as ``bench/bench_step.py`` times a design, and with ``--record``
writes each step's batch (``step_<n>.json``: prompt ids, response ids, the action mask, group ids, rewards) through
:class:`RecordingCollect`, a :class:`~fastcredit.trainer.placement.BatchSource`: the Trainer's own hook for where
its batches come from.

The trainer is the training command's own (``fastcredit.trainer.build.colocated_trainer``), given the recording
source in place of ``LocalCollect``.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import time
from typing import Optional

import torch

from bench.bench_step import peak_gib, reset_peak, weights_digest
from fastcredit.trainer.placement import LocalCollect

DIGEST = "digest.json"


def fastcredit_trainer(cfg, info, record: Optional[str] = None):
    """The colocated Trainer of ``cfg`` (``fastcredit.trainer.build.colocated_trainer``), its batches recorded into
    ``record`` when given."""
    from fastcredit.trainer.build import colocated_trainer

    if record is None:
        return colocated_trainer(cfg, info)
    return colocated_trainer(cfg, info, collect=lambda *parts: RecordingCollect(*parts, record))


class RecordingCollect(LocalCollect):
    """:class:`~fastcredit.trainer.placement.LocalCollect` that also writes each step's batch into ``folder`` (one
    JSON file a step, :func:`batch_record`: what TRL's replay needs to train on the same tokens)."""

    def __init__(self, parts, cfg, info, timer, folder: str):
        super().__init__(parts, cfg, info, timer)
        self.folder = folder
        os.makedirs(folder, exist_ok=True)

    def take(self, step, sampler):
        got, sampler = super().take(step, sampler)
        with open(os.path.join(self.folder, f"step_{step:04d}.json"), "w") as f:
            json.dump(batch_record(step, got.prompt_ids, got.batch, got.reward_B), f)
        return got, sampler


def batch_record(step: int, prompt_ids: list, batch, reward_B: torch.Tensor) -> dict:
    """One step's batch as JSON: per trajectory its prompt ids, response ids (actions and observations), the
    action mask (1 on the policy's tokens), its group and reward; and a digest of the token ids."""
    cu = batch.cu_seqlens.tolist()
    tokens, action = batch.tokens_N.tolist(), batch.action_mask_N.int().tolist()
    out = {"step": step, "prompt_ids": [list(p) for p in prompt_ids],
           "tokens": [tokens[cu[b]:cu[b + 1]] for b in range(batch.num_trajectories)],
           "action_mask": [action[cu[b]:cu[b + 1]] for b in range(batch.num_trajectories)],
           "group_id": batch.group_id_B.tolist(), "reward": [float(x) for x in reward_B.tolist()]}
    out["digest"] = ids_digest(out["prompt_ids"], out["tokens"], out["action_mask"])
    return out


def ids_digest(prompts: list, tokens: list, masks: list) -> str:
    """sha256 over a batch's prompt ids, response ids and masks, trajectory by trajectory."""
    h = hashlib.sha256()
    for p, t, m in zip(prompts, tokens, masks):
        h.update(json.dumps([p, t, m]).encode())
    return h.hexdigest()


def folder_digest(model: torch.nn.Module) -> str:
    """sha256 over an HF model's parameters and buffers by name (fp32 bytes; a tied tensor once)."""
    h, seen = hashlib.sha256(), set()
    for name, t in sorted(model.state_dict().items()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        h.update(name.encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def write_start(cfg, trainer, folder: str) -> dict:
    """The trainer's policy as it starts, into ``folder`` (an HF folder with its tokenizer), read back and compared;
    its digests (:data:`DIGEST`)."""
    from transformers import AutoModelForCausalLM

    from fastcredit.data.tokenizer import load_tokenizer
    from fastcredit.models.build import load_policy

    policy, tokenizer = trainer.parts.training.policy, trainer.parts.shared.tokenizer
    weights = {name: t.detach().to("cpu", torch.float32).clone() for name, t in policy.full_state(torch.float32)}
    lm = load_policy(cfg, tokenizer)
    missing, unexpected = lm.load_state_dict(weights, strict=False)
    tied = {n for n in missing if n.endswith("lm_head.weight")} if getattr(lm.config, "tie_word_embeddings", False) \
        else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"the policy's weights do not fit its model: missing {missing}, unexpected {unexpected}")
    os.makedirs(folder, exist_ok=True)
    lm.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    back = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    for name, t in weights.items():
        if not torch.equal(back.state_dict()[name], t):
            raise RuntimeError(f"{folder}: {name} read back differs from the policy's")
    if load_tokenizer(folder)("<search>x</search>")["input_ids"] != tokenizer("<search>x</search>")["input_ids"]:
        raise RuntimeError(f"{folder}: its tokenizer splits text differently from the run's")
    digests = {"fastcredit": weights_digest(policy), "folder": folder_digest(back)}
    with open(os.path.join(folder, DIGEST), "w") as f:
        json.dump(digests, f, indent=1)
    return digests


def _trainer_for(config: str, overrides: list, out: str, steps: int, record: Optional[str] = None):
    from fastcredit.config import load_config
    from fastcredit.distributed.process_group import init_distributed
    from fastcredit.trainer.checks import check_run

    cfg = load_config([config], [*overrides, f"logging.output_dir={out}", f"optim.total_steps={steps}"])
    check_run(cfg)
    info = init_distributed(cfg.distributed.backend, cfg.distributed.shard_size)
    return cfg, info, fastcredit_trainer(cfg, info, record)


def prepare(config: str, overrides: list, work: str, start: str) -> dict:
    """The start policy of ``config`` + ``overrides`` into ``start`` (:func:`write_start`); its digests."""
    from fastcredit.distributed.process_group import shutdown

    cfg, info, trainer = _trainer_for(config, overrides, os.path.join(work, "prepare"), 0)
    try:
        return write_start(cfg, trainer, start)
    finally:
        trainer.logger.close()
        shutdown(info)


def run_steps(config: str, overrides: list, work: str, steps: int, warmup: int, record: Optional[str]) -> dict:
    """``warmup + steps`` steps of fastcredit in this process: the timed steps' metrics rows, the wall time, peak
    memory and the policy's digest before and after (``bench.bench_step.run_design``'s result)."""
    from fastcredit.distributed.process_group import shutdown

    out = os.path.join(work, "fastcredit")
    cfg, info, trainer = _trainer_for(config, overrides, out, warmup + steps, record)
    start = weights_digest(trainer.parts.training.policy)
    reset_peak()
    t0 = time.perf_counter()
    try:
        trainer.fit()
    finally:
        trainer.logger.close()
    wall, peak = time.perf_counter() - t0, peak_gib()
    end = weights_digest(trainer.parts.training.policy)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"time/step"' in line]
    del trainer
    shutdown(info)
    gc.collect()
    timed = [r for r in rows if r["step"] > warmup]
    if len(timed) != steps:
        raise SystemExit(f"[fastcredit] expected {steps} timed steps in {out}/metrics.jsonl, found {len(timed)}")
    return {"rows": timed, "wall_s": wall, "peak": peak, "start_weights": start, "end_weights": end}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("prepare", "steps"))
    p.add_argument("--config", required=True)
    p.add_argument("--work", required=True, help="the race's folder")
    p.add_argument("--start", default=None, help="prepare: the start policy's folder (default: WORK/start)")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--record", default=None, help="steps: write each step's batch into this folder")
    p.add_argument("--result", default=None, help="steps: where the result JSON goes (default: WORK/result.json)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    a = p.parse_intermixed_args(argv)
    from fastcredit.runtime.progress import quiet_library_bars

    quiet_library_bars()
    if a.what == "prepare":
        print(json.dumps(prepare(a.config, a.overrides, a.work, a.start or os.path.join(a.work, "start"))))
        return 0
    result = run_steps(a.config, a.overrides, a.work, a.steps, a.warmup, a.record)
    with open(a.result or os.path.join(a.work, "result.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    from fastcredit.distributed.process_group import exit_process

    exit_process(main())
