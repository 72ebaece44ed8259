"""fastcredit's config mapped onto TRL's ``GRPOConfig``: one row per setting, what each side calls it and holds, and
where they cannot be the same, why. ``bench/peer_trl.py`` builds TRL's config from these rows, and
``python -m bench.peer_trl --settings configs/searchr1_grpo.yaml`` prints them as docs/peer-trl.md's table.

    rows = settings(cfg, micro_batch=4)      # [Setting]: fastcredit key and value, TRL argument and value, note
    kwargs = grpo_kwargs(rows)               # GRPOConfig(**kwargs, output_dir=..., max_steps=...)

A setting TRL 1.16 cannot express at all (a loss aggregation it lacks, DAPO's dynamic sampling, a dual clip)
raises :class:`Unmappable`: the race would otherwise train two different algorithms.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fastcredit.config.credit import outcome_reward


class Unmappable(ValueError):
    """A fastcredit setting TRL's GRPOTrainer has no counterpart for."""


@dataclass
class Setting:
    what: str
    key: str  # fastcredit's key ("" where it has none)
    ours: Any
    args: dict  # GRPOConfig arguments and values ({} where TRL has none)
    note: str = ""  # why the two differ; empty: they are the same


def _schedule(o) -> dict:
    if o.warmup_ratio == 0 and o.schedule == "constant":
        return {"lr_scheduler_type": "constant"}
    warm = int(o.total_steps * o.ppo_epochs * max(o.batch_prompts // o.mini_batch_prompts, 1) * o.warmup_ratio)
    kind = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[o.schedule]
    return {"lr_scheduler_type": kind, "warmup_steps": warm}


def _loss_type(agg: str) -> str:
    types = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}
    if agg not in types:
        raise Unmappable(f"loss.agg_mode={agg}: TRL's loss types are token means over the generation batch (dapo), "
                         "per micro-batch (bnpo), sequence means (grpo) or a constant (dr_grpo); none is "
                         f"{agg}")
    return types[agg]


def settings(cfg, micro_batch: int) -> list[Setting]:
    """The mapping for ``cfg`` (a fastcredit TrainConfig, estimator ``grpo``), TRL training ``micro_batch``
    trajectories per forward / backward."""
    r, loss, o, c, d = cfg.rollout, cfg.loss, cfg.optim, cfg.credit, cfg.distributed
    if c.estimator != "grpo":
        raise Unmappable(f"credit.estimator={c.estimator}: TRL's GRPOTrainer trains GRPO's outcome advantages only")
    if c.dynamic_sampling.enabled:
        raise Unmappable("credit.dynamic_sampling: TRL 1.16's GRPOTrainer does not refill degenerate groups")
    if loss.dual_clip is not None:
        raise Unmappable("loss.dual_clip: TRL has no dual clip (its delta caps the ratio for every advantage)")
    trajectories = o.batch_prompts * r.n_samples
    if trajectories % micro_batch:
        raise Unmappable(f"{trajectories} trajectories a step do not split into micro-batches of {micro_batch}")
    minis = max(o.batch_prompts // o.mini_batch_prompts, 1)
    accumulate = o.mini_batch_prompts * r.n_samples // micro_batch
    half = d.mixed_precision and torch.cuda.is_available()
    return [
        Setting("clip, low", "loss.clip_low", loss.clip_low, {"epsilon": loss.clip_low}),
        Setting("clip, high", "loss.clip_high", loss.clip_high, {"epsilon_high": loss.clip_high}),
        Setting("KL coefficient", "loss.kl_coef", loss.kl_coef, {"beta": loss.kl_coef}),
        Setting("KL estimator", "loss.kl_clamp", f"k3, clamped to ±{loss.kl_clamp:g}",
                {"use_bias_correction_kl": False},
                "TRL's k3 is not clamped. k3 = e^d - d - 1 (d = ref - policy log-prob) passes 10 only at "
                "d > 2.6 or d < -11 on a token; TRL's default multiplies it by the importance ratio "
                "(use_bias_correction_kl=True), Search-R1's low_var_kl does not"),
        Setting("entropy bonus", "loss.entropy_coef", loss.entropy_coef, {"entropy_coef": loss.entropy_coef},
                "fastcredit subtracts eta*H per token inside the token mean over the mini-batch; TRL subtracts "
                "eta x each micro-batch's mean entropy / gradient_accumulation_steps: the same when every "
                "micro-batch holds as many action tokens"),
        Setting("loss aggregation", "loss.agg_mode", loss.agg_mode, {"loss_type": _loss_type(loss.agg_mode)},
                "" if minis == 1 else "several mini-batches a step: TRL divides each optimizer step's sum by the "
                                      "generation batch's tokens x gradient_accumulation_steps / "
                                      "steps_per_generation, fastcredit by that mini-batch's own tokens"),
        Setting("advantage", "credit.norm_by_std", c.norm_by_std,
                {"scale_rewards": "group" if c.norm_by_std else "none", "multi_objective_aggregation":
                 "sum_then_normalize"}),
        Setting("advantage epsilon", "credit.eps", c.eps, {},
                "TRL hard-codes (std + 1e-4); with 0/1 rewards a group's std is 0 (advantage 0 either way) or at "
                "least 1/sqrt(G), where the two advantages differ by under 1e-4 sqrt(G) (0.02% at G = 4)"),
        Setting("group size", "rollout.n_samples", r.n_samples, {"num_generations": r.n_samples}),
        Setting("prompts a step", "optim.batch_prompts", o.batch_prompts,
                {"generation_batch_size": trajectories, "shuffle_dataset": False},
                "the same prompts in the same order: TRL's dataset is laid out in fastcredit's draw order"),
        Setting("optimizer steps a step", "optim.mini_batch_prompts", o.mini_batch_prompts,
                {"gradient_accumulation_steps": accumulate}),
        Setting("micro-batch", "optim.micro_batch_tokens", o.micro_batch_tokens,
                {"per_device_train_batch_size": micro_batch},
                "fastcredit packs whole trajectories up to this many tokens a forward, without padding; TRL pads "
                "a fixed number of trajectories a forward"),
        Setting("epochs over a batch", "optim.ppo_epochs", o.ppo_epochs, {"num_iterations": o.ppo_epochs}),
        Setting("old log-probs", "loss.old_logprobs", loss.old_logprobs, {},
                "neither runs a pass for them at one update a rollout (TRL: num_iterations=1 and one optimizer "
                "step a generation; fastcredit: the HF engine's own on a CPU, a pass on a GPU)"),
        Setting("learning rate", "optim.lr", o.lr, {"learning_rate": o.lr}),
        Setting("schedule", "optim.schedule, optim.warmup_ratio", f"{o.schedule}, {o.warmup_ratio:g}", _schedule(o),
                "" if o.warmup_ratio == 0 else "warm-up: transformers' starts at 0 (step/warm), fastcredit's at "
                                               "1/warm ((step+1)/warm)"),
        Setting("optimizer", "optim.betas, optim.weight_decay", f"AdamW {o.betas}, {o.weight_decay:g}",
                {"optim": "adamw_torch", "adam_beta1": o.betas[0], "adam_beta2": o.betas[1],
                 "adam_epsilon": 1e-8, "weight_decay": o.weight_decay}),
        Setting("gradient clip", "optim.grad_clip", o.grad_clip, {"max_grad_norm": o.grad_clip}),
        Setting("precision", "distributed.mixed_precision", d.mixed_precision,
                {"bf16": half, "model_init_kwargs": {"dtype": "float32"}},
                "fp32 weights both; bf16 compute only on a GPU (a CPU computes fp32 in fastcredit, and TRL's "
                "bf16=True default would autocast a CPU to bf16)"),
        Setting("activation checkpointing", "distributed.activation_checkpointing", d.activation_checkpointing,
                {"gradient_checkpointing": d.activation_checkpointing}),
        Setting("dropout", "", "none (the Qwen2 and Llama configs' dropout is 0)", {"disable_dropout": True}),
        Setting("temperature", "rollout.temperature", r.temperature, {"temperature": r.temperature},
                "sampling and the log-probs' logits / T, both sides"),
        Setting("top-p / top-k", "rollout.top_p, rollout.top_k", f"{r.top_p:g}, {r.top_k}",
                {"top_p": r.top_p, "top_k": max(r.top_k, 0)}),
        Setting("truncated trajectories", "", "trained on", {"mask_truncated_completions": False},
                "a turn loop that stops at a tag leaves no EOS, which TRL would read as truncated"),
        Setting("response cap", "rollout.max_response_tokens", r.max_response_tokens,
                {"max_completion_length": r.max_response_tokens},
                "TRL does not apply it to rollout_func's output: the rollout enforces every rollout.* cap"),
        Setting("reward", "credit.reward", outcome_reward(cfg), {},
                "not a GRPOConfig argument: TRL's reward function (reward_funcs=) is fastcredit's scorer of this "
                "reward (bench/peer_trl_rollout.py, trl_reward)"),
        Setting("seed", "seed", cfg.seed, {"seed": cfg.seed, "data_seed": cfg.seed}),
    ]


def grpo_kwargs(rows: list[Setting]) -> dict:
    """Every TRL argument the rows set, merged (``model_init_kwargs`` included)."""
    out: dict = {}
    for row in rows:
        out.update(row.args)
    return out


def _value(v) -> str:
    return f"`{v}`" if v != "" else ""


def markdown_table(rows: list[Setting]) -> str:
    """The rows as docs/peer-trl.md's table: setting, fastcredit key = value, TRL arguments, why they differ."""
    lines = ["| setting | fastcredit | TRL `GRPOConfig` | where they differ |", "|---|---|---|---|"]
    for row in rows:
        ours = f"`{row.key}` = {_value(row.ours)}" if row.key else str(row.ours)
        theirs = ", ".join(f"`{k}={v}`" for k, v in row.args.items()) or "(none)"
        lines.append(f"| {row.what} | {ours} | {theirs} | {row.note or 'the same'} |")
    return "\n".join(lines) + "\n"
