"""The Trainer: one run's models, rollout engine, retriever, judges and optimizer state, and its loop.

Legend (shape suffixes): B trajectories, S turns, N packed response tokens.

One step, each phase timed and inside an NVTX range:
rollout (async agent loop; ProCeed rewinds) → outcome rewards → judges (critic / judge /
PRM) → dynamic sampling (DAPO) → old log-probs, reference log-probs, values (three phases) → estimator by name
→ PPO epochs over mini- and micro-batches (loss through the kernel dispatch) → weight sync
into the rollout engine at the next rollout → metrics, checkpoint, collapse guard.
The policy and value model train through the engine ``distributed.engine`` names (FSDP2,
or DeepSpeed ZeRO stage ``distributed.zero_stage``; ``fastcredit.distributed.build``).
Each rank rolls out its own share of the prompts; the update's denominators are global.
The entry point is ``fastcredit.train``.
"""
from __future__ import annotations

import math
import os
import random
import time
from typing import Optional

import numpy as np
import torch

from fastcredit.trainer import parts as C
from fastcredit.config import TrainConfig, save_config, to_dict
from fastcredit.credit.registry import estimator_needs
from fastcredit.data.prompts import example_prompt_ids
from fastcredit.data.sampler import PromptSampler
from fastcredit.distributed.process_group import DistInfo, all_reduce_sum, max_over_ranks, mean_over_ranks
from fastcredit.runtime.profiling import PhaseTimer, nvtx_range, profiler_start, profiler_stop
from fastcredit.rollout.proceed import proceed_flags
from fastcredit.runtime.tracking import MetricLogger, archive_previous_run, write_line


class CollapseError(RuntimeError):
    """The collapse guard tripped and the configured action is to stop."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Owns the models, engine, retriever, judges and optimizer state of one run."""

    def __init__(self, cfg: TrainConfig, info: DistInfo, resume: bool = False, profile: bool = False):
        self.cfg, self.info, self.profile = cfg, info, profile
        self.profile_start = min(2, max(cfg.optim.total_steps - 1, 0))  # nsys captures steps 2-4
        self.out_dir = cfg.logging.output_dir
        self.ckpt_dir = os.path.join(self.out_dir, "checkpoints")
        if info.is_main:
            os.makedirs(self.out_dir, exist_ok=True)
            moved = None if resume else archive_previous_run(self.out_dir)
            if moved:
                print(f"{self.out_dir} held an earlier run (no --resume): its metrics and checkpoints moved to {moved}",
                      flush=True)
            save_config(cfg, os.path.join(self.out_dir, "config.yaml"))
        seed_everything(cfg.seed)
        self.timer = PhaseTimer()
        self.logger = MetricLogger(self.out_dir, cfg.logging.jsonl, cfg.logging.tensorboard, cfg.logging.wandb,
                                   cfg.run_name, to_dict(cfg), enabled=info.is_main)
        self.say(f"fastcredit.train: {cfg.run_name} · estimator {cfg.credit.estimator} · {info.world_size} process(es) "
                  f"on {info.device.type} → {self.out_dir}")
        self.data = C.load_data(cfg, info.rank)
        self.tokenizer = C.load_tokenizer(cfg, self.data, self.out_dir, info.rank)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.searcher, self.retriever = C.make_searcher(cfg, self.tokenizer, self.data.corpus,
                                                        progress=cfg.logging.progress and info.is_main,
                                                        device=info.device, info=info)
        self.memory: dict = {}  # GPU memory at each phase boundary of the step, logged with it
        self._build_models()
        self._build_rollout()
        self.step, self.opt_steps, self.rollbacks = 0, 0, 0
        self.sampler = PromptSampler(len(self.data.train), cfg.seed)
        if resume:
            self._resume()

    def say(self, text: str) -> None:
        """A line on rank 0's console, above the progress bar when one is showing."""
        if self.info.is_main:
            write_line(text)

    def _build_models(self) -> None:
        """Policy (and value model) as fp32 master weights sharded by the training engine; the reference policy
        as a frozen copy in the compute dtype, sharded the same way and on the device only while it is used."""
        from fastcredit.trainer.update import PolicyModel, ValueModel
        from fastcredit.distributed.build import build_train_engine, compute_dtype
        from fastcredit.distributed.engine import adamw
        from fastcredit.distributed.fsdp import FrozenModel

        cfg, o = self.cfg, self.cfg.optim
        lm = C.load_policy(cfg, self.tokenizer, self.info)  # meta on ranks other than 0 (C.loads_on_rank0)
        if cfg.warmstart.enabled:
            self._warm_start(lm)
            lm.cpu()
        self.compute_dtype = compute_dtype(cfg.distributed, self.info, cfg.model.dtype)
        impl = cfg.loss.impl
        # The rollout engine's weights: the HF engine's own copy in the compute dtype; vLLM loads a folder.
        self.engine_lm = C.hf_engine_copy(cfg, lm, self.compute_dtype, self.info) if cfg.rollout.engine == "hf" \
            else None
        self.ref = FrozenModel(PolicyModel(C.frozen_copy(lm, self.compute_dtype), impl), self.info) \
            if cfg.loss.kl_coef or cfg.credit.kl_in_reward else None
        if self.ref is not None and cfg.distributed.colocate and self.info.device.type == "cuda":
            self.ref.offload()  # on the GPU only for its passes (PhaseManager.using)
        # copied before the policy's engine shards lm (ZeRO-3 leaves empty placeholders behind)
        value_lm = C.frozen_copy(lm).requires_grad_(True).train() if estimator_needs(cfg.credit.estimator).value_model \
            else None
        self.vllm_folder, self.vllm_load = C.vllm_start_folder(
            cfg, lm, self.tokenizer, self.out_dir, self.info.rank, cfg.warmstart.enabled) \
            if cfg.rollout.engine == "vllm" else (None, None)
        # self.policy / self.value: TrainEngines (callable like the models they wrap)
        self.policy = build_train_engine(PolicyModel(lm, impl), self.info, cfg.distributed,
                                         adamw(lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay), o.grad_clip,
                                         self.compute_dtype)
        self.value = None if value_lm is None else build_train_engine(
            ValueModel(value_lm), self.info, cfg.distributed, adamw(lr=o.critic_lr, weight_decay=o.weight_decay),
            o.grad_clip, self.compute_dtype)

    def _warm_start(self, lm) -> None:
        """SFT on oracle trajectories; observations come from the run's own searcher, as in rollouts. With
        ``warmstart.cache_dir`` a warm start of the same config is loaded instead of redone (``sft.cached_warm_start``)."""
        from fastcredit.trainer.sft import cached_warm_start, sft_sequences, sft_train, warm_start_fingerprint

        w = self.cfg.warmstart
        seed = w.seed_for(self.cfg.seed)

        def run() -> str:
            examples = [ex for ex in self.data.train if ex.metadata.get("hops")]
            examples = examples[: w.questions] if w.questions else examples
            queries = sorted({h["query"] for ex in examples for h in ex.metadata["hops"]})
            t0 = time.time()
            obs = dict(zip(queries, (o for o, _ in self.searcher(queries))))
            seqs = sft_sequences(examples, self._prompt_ids(examples), self.tokenizer,
                                 obs.__getitem__, seed=seed)
            bar = self.cfg.logging.progress and self.info.is_main
            losses = sft_train(lm, seqs, self.pad_id, w.epochs, w.lr, w.batch_size, seed, str(self.info.device),
                               progress=bar, on_epoch=None if bar else lambda k, loss: self.say(
                                   f"warm start: epoch {k}/{w.epochs}, loss {loss:.3f} ({time.time() - t0:.0f} s)"))
            return (f"warm start: {len(seqs)} oracle trajectories x {w.epochs} epochs in {time.time() - t0:.0f} s, "
                    f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")

        cached_warm_start(lm, w.cache_dir, warm_start_fingerprint(self.cfg), run, self.say)
        lm.requires_grad_(True).train()

    def _build_rollout(self) -> None:
        from fastcredit.distributed.colocate import PhaseManager
        from fastcredit.judges.phase import build_judge_phase, build_proceed_hook, make_backend
        from fastcredit.rollout.engines import make_engine

        cfg, dev = self.cfg, self.info.device
        train_state = [self.policy] + ([self.value] if self.value is not None else [])
        kw, offloaded = {}, False  # measuring what a rollout has free offloads the training state first
        if cfg.rollout.engine == "vllm":
            util, offloaded = C.vllm_memory_share(cfg, dev, self.vllm_folder, train_state, self.say)
            kw = {"model_path": self.vllm_folder, "memory_utilization": util, "load_format": self.vllm_load}
        self.engine = make_engine(cfg.rollout.engine, self.engine_lm, self.tokenizer, cfg.rollout, device=dev, **kw)
        self.engine_lm = None  # the engine owns its weights now
        backend = make_backend(cfg, self.engine, dev, policy_config=self.policy.module.lm.config)
        self.proceed_hook = build_proceed_hook(cfg, backend, self.engine, self.tokenizer)
        self.judges = build_judge_phase(cfg, backend, self.engine, dev)
        self.phases = PhaseManager(self.engine, getattr(self.judges, "engine", None), train_state,
                                   self.info.device, cfg.rollout.sleep_level, cfg.judges.sleep_level,
                                   cfg.distributed.colocate, sync_fn=self._sync_weights, log=self._log_memory,
                                   judge_weights=getattr(backend, "weights", None),
                                   train_on_device=not offloaded)
        if self.vllm_load == "dummy":
            self.phases.mark_updated()  # the engine started without weights: the first rollout streams them in

    def _sync_weights(self, policy) -> None:
        self.engine.update_weights(policy.full_state(self.engine.weight_dtype))

    def _log_memory(self, boundary: str, mem: dict) -> None:
        if mem and self.info.is_main:
            self.memory.update({f"memory/{boundary}/{k}": v for k, v in mem.items()})

    def _max_over_ranks(self, n: int) -> int:
        return max_over_ranks(n, self.info)

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(t, self.info)

    def rollout(self, idx: list[int], examples_from: list, greedy: bool = False, group_size: int = 1, hook=None,
                seed_base: int = 0, group_base: int = 0):
        """Roll out ``group_size`` trajectories for each of ``examples_from[idx]``; returns (result, examples).

        Group ids are ``group_base + prompt index``: a refill round passes its own base, so a
        prompt drawn again in the same step forms a separate group.
        """
        examples = [examples_from[i] for i in idx for _ in range(group_size)]
        prompts = self._prompt_ids(examples)
        groups = [group_base + i for i in idx for _ in range(group_size)]
        flags = proceed_flags(groups, self.cfg.rollout.proceed.fraction) if hook is not None else [False] * len(groups)
        metas = [{"question": ex.question, "golds": ex.golden_answers, "example": ex, "proceed": f,
                  "seed": None if greedy else seed_base + j} for j, (ex, f) in enumerate(zip(examples, flags))]
        with self.phases.rollout(weights=self.policy):
            result = C.agent_loop(self.cfg, self.engine, self.searcher, greedy, hook).run(prompts, group_id=groups,
                                                                                       metas=metas)
        return result, examples

    def _prompt_ids(self, examples: list) -> list[list[int]]:
        d = self.cfg.data
        return example_prompt_ids(self.tokenizer, examples, d.prompt_source, d.prompt_template, self.cfg.model.chat_template)

    def outcome_rewards(self, result, examples) -> tuple[torch.Tensor, dict]:
        """Outcome rewards (``credit.reward``) of the batch, EM / F1 / format written into it; ``(reward_B, metrics)``."""
        from fastcredit.credit.rewards import score_trajectory
        from fastcredit.rollout.trajectory import replace

        c = self.cfg.credit
        outs = [score_trajectory(e.action_texts, ex.golden_answers, kind=c.reward, lambda_f=c.lambda_f,
                                 format_bonus=c.format_bonus) for e, ex in zip(result.episodes, examples)]
        result.batch = replace(result.batch, em_B=torch.tensor([o.em for o in outs], dtype=torch.float32),
                               f1_B=torch.tensor([o.f1 for o in outs], dtype=torch.float32),
                               format_ok_B=torch.tensor([o.format_ok for o in outs]),
                               predictions=[o.prediction for o in outs])
        reward = torch.tensor([o.reward for o in outs], dtype=torch.float32)
        return reward, {"reward": float(reward.mean()), "em": float(result.batch.em_B.mean()),
                        "f1": float(result.batch.f1_B.mean()),
                        "format_ok": float(result.batch.format_ok_B.float().mean())}

    def _step_batch(self):
        """Rollout + rewards (+ DAPO dynamic sampling): ``(result, examples, reward_B, metrics)``."""
        from fastcredit.credit.dapo import dynamic_sampling_step, take_groups
        from fastcredit.rollout.agent import RolloutResult
        from fastcredit.rollout.trajectory import concat, select

        cfg, info = self.cfg, self.info
        per_rank = cfg.optim.batch_prompts // info.world_size
        G = cfg.rollout.n_samples
        ds = cfg.credit.dynamic_sampling
        parts, round_metrics, kept, seen = [], [], 0, 0
        want, rounds = per_rank, 0
        while True:
            idx_all = self.sampler.take(want * info.world_size)  # the same draw on every rank
            idx = idx_all[info.rank * want:(info.rank + 1) * want]
            seed = cfg.seed * 1_000_003 + self.step * 10_007 + rounds * 101 + info.rank * 7_000_001
            with self.timer.phase("rollout"):
                result, examples = self.rollout(idx, self.data.train, group_size=G, hook=self.proceed_hook,
                                                seed_base=seed, group_base=rounds * len(self.data.train))
            with self.timer.phase("reward"):
                reward, m = self.outcome_rewards(result, examples)
            round_metrics.append({**m, **result.stats})
            decision = dynamic_sampling_step(reward, result.batch.group_id_B, ds, target_groups=per_rank,
                                             kept_before=kept, seen_before=seen, refill_round=rounds)
            parts.append((result, examples, reward, decision.keep_B))
            kept, seen, rounds = kept + decision.kept_groups, seen + decision.kept_groups + decision.dropped_groups, rounds + 1
            # Every rank refills the same number of prompts, so the shared prompt order stays in step.
            want = self._max_over_ranks(0 if decision.done else decision.refill_prompts)
            if want == 0:
                break
        metrics = {k: sum(r[k] for r in round_metrics) / rounds for k in round_metrics[0]}
        if ds.enabled:
            metrics.update({f"dapo/{k}": v for k, v in decision.metrics.items()})
        if self.proceed_hook is not None:
            metrics.update({f"proceed/{k}": float(v) for k, v in self.proceed_hook.take_stats().items()})
        if len(parts) == 1 and not ds.enabled:
            return result, examples, reward, metrics
        batch = concat([p[0].batch for p in parts])
        keep = take_groups(torch.cat([p[3] for p in parts]), batch.group_id_B, per_rank)
        if not bool(keep.any()):  # nothing to learn from: train on every trajectory sampled (all advantages 0)
            keep = torch.ones_like(keep)
        index = torch.nonzero(keep).flatten()
        episodes = [e for p in parts for e in p[0].episodes]
        ex_all = [ex for p in parts for ex in p[1]]
        merged = RolloutResult(select(batch, index), [episodes[i].prompt_ids for i in index],
                               [episodes[i] for i in index], sum(p[0].seconds for p in parts), result.stats)
        return merged, [ex_all[i] for i in index], torch.cat([p[2] for p in parts])[index], metrics

    def train_step(self) -> dict:
        """One full step (an NVTX range ``step`` around its phases); returns its metrics (rank-averaged)."""
        with nvtx_range("step"):
            return self._train_step()

    def _train_step(self) -> dict:
        from fastcredit.trainer.update import UpdateData, forward_logprobs, forward_values, ppo_update
        from fastcredit.credit import CreditInputs, compute_advantages

        cfg, info = self.cfg, self.info
        t0 = time.perf_counter()
        result, examples, reward, metrics = self._step_batch()
        batch, prompts = result.batch, result.prompt_ids
        with self.timer.phase("judge"), self.phases.judge():
            extras, jm = self.judges.score(result, examples, reward) if self.judges is not None else ({}, {})
        metrics.update(jm)
        mt = cfg.optim.micro_batch_tokens
        with self.phases.train():  # its moves (engines to sleep, training state back) are timed by the phases
            with self.timer.phase("old_logprobs"):
                old, ent = forward_logprobs(self.policy, prompts, batch, self.pad_id, info.device, mt,
                                            cfg.rollout.temperature, self._max_over_ranks)
            ref = values = None
            if self.ref is not None:
                with self.timer.phase("ref_logprobs"), self.phases.using(self.ref):
                    ref = forward_logprobs(self.ref, prompts, batch, self.pad_id, info.device, mt,
                                           cfg.rollout.temperature, self._max_over_ranks)[0]
            if self.value is not None:
                with self.timer.phase("values"):
                    values = forward_values(self.value, prompts, batch, self.pad_id, info.device, mt,
                                            self._max_over_ranks)
        with self.timer.phase("advantage"):
            inputs = CreditInputs.from_batch(batch, reward, values_N=values, old_logp_N=old, ref_logp_N=ref,
                                             sum_over_ranks=self._reduce if info.distributed else None, **extras)
            credit = compute_advantages(cfg.credit.estimator, inputs, cfg.credit)
        metrics.update({f"credit/{k}": v for k, v in credit.metrics.items()})
        with self.timer.phase("update"), self.phases.train():
            per_mini = max(cfg.optim.mini_batch_prompts // info.world_size, 1)
            um = ppo_update(self.policy, UpdateData(prompts, batch, credit, old, ref, values),
                            cfg.loss, cfg.optim, info.device, self.pad_id, temperature=cfg.rollout.temperature,
                            dp_size=info.world_size, reduce=self._reduce, max_over_ranks=self._max_over_ranks,
                            value=self.value, groups_per_mini=per_mini,
                            on_step=self._set_lr)
        self.phases.mark_updated()
        metrics.update(um)
        tokens = float(batch.num_tokens + sum(len(p) for p in prompts))
        metrics = self._average(metrics)
        seconds = self.timer.reset()
        metrics.update({f"time/{k}": v for k, v in seconds.items()})
        metrics.update({f"time/colocate/{k}": v for k, v in self.phases.take_timings().items()})
        metrics["time/step"] = time.perf_counter() - t0
        metrics["tokens_per_s"] = float(self._reduce(torch.tensor([tokens], dtype=torch.float64))) / metrics["time/step"]
        metrics.update(self.memory)
        self.memory = {}
        return metrics

    def _average(self, metrics: dict) -> dict:
        """Rank means of every metric (the actor's summed ones are already global)."""
        local = {k: v for k, v in metrics.items() if not k.startswith("actor/") and not k.startswith("critic/")}
        return {**metrics, **mean_over_ranks(local, self.info)}

    def _set_lr(self) -> None:
        o = self.cfg.optim
        factor = lr_factor(self.opt_steps, self._total_opt_steps(), o.warmup_ratio, o.schedule)
        self.policy.set_lr(o.lr * factor)
        if self.value is not None:
            warm = o.warmup_ratio if o.critic_warmup_ratio is None else o.critic_warmup_ratio
            self.value.set_lr(o.critic_lr * lr_factor(self.opt_steps, self._total_opt_steps(), warm, o.schedule))
        self.opt_steps += 1

    def _total_opt_steps(self) -> int:
        o = self.cfg.optim
        return o.total_steps * o.ppo_epochs * max(o.batch_prompts // o.mini_batch_prompts, 1)

    def evaluate(self) -> dict:
        """Held-out scores of greedy rollouts over ``eval.questions`` test questions spread evenly over the data
        sources (``fastcredit.eval``; split over ranks): ``{"eval/em", "eval/f1", "eval/em/<source>", …}``,
        empty when evaluation is off. ``eval/em`` is the mean over sources, as the papers average."""
        from fastcredit.trainer.heldout import eval_metrics, sample_per_source, score_records, summarize

        n = min(self.cfg.eval.questions, len(self.data.test))
        if n == 0:
            return {}
        chosen = sample_per_source(self.data.test, n, self.cfg.eval.seed_for(self.cfg.seed))  # same on every rank
        mine = chosen[self.info.rank::self.info.world_size]
        with self.timer.phase("eval"):
            result, examples = self.rollout(mine, self.data.test, greedy=True)
        sources = sorted({self.data.test[i].data_source for i in chosen})
        sums = torch.zeros(len(sources), 3, dtype=torch.float64)  # EM, F1, count per source
        for r in score_records(result.episodes, examples, mine):
            sums[sources.index(r["data_source"])] += torch.tensor([r["em"], r["f1"], 1.0], dtype=torch.float64)
        sums = self._reduce(sums)
        seconds = self.timer.reset().get("eval", 0.0)
        return {**eval_metrics(summarize({s: sums[k].tolist() for k, s in enumerate(sources)}, sources)),
                "time/eval": seconds}

    def _checkpointed(self) -> tuple[dict, dict, dict]:
        """What a checkpoint holds, by name: DCP models and optimizers, and engines that save themselves."""
        models, optims, engines = {}, {}, {}
        for name, engine in (("policy", self.policy), ("value", self.value)):
            if engine is None:
                continue
            dcp_state = engine.dcp_state()
            if dcp_state is None:
                engines[name] = engine
            else:
                models[name], optims[name] = dcp_state
        return models, optims, engines

    def save(self) -> None:
        from fastcredit.distributed.checkpoint import save_checkpoint

        models, optims, engines = self._checkpointed()
        with self.timer.phase("checkpoint"):
            save_checkpoint(self.ckpt_dir, self.step, models, optims,
                            {"data": self.sampler.state(), "opt_steps": self.opt_steps, "rollbacks": self.rollbacks},
                            keep=self.cfg.logging.keep_checkpoints, engines=engines)

    def _resume(self) -> Optional[str]:
        """Load the newest checkpoint that verifies (earlier ones when the latest is damaged); returns its path."""
        from fastcredit.distributed.checkpoint import resume_checkpoint

        models, optims, engines = self._checkpointed()
        with self.phases.train():  # loaded where the training state lives while it trains
            found = resume_checkpoint(self.ckpt_dir, models, optims, engines=engines, say=self.say)
        if found is None:
            self.say(f"--resume: no checkpoint in {self.ckpt_dir}; starting from step 0")
            return None
        path, state = found
        self.step, self.opt_steps = state["step"], state["opt_steps"]
        self.rollbacks = state.get("rollbacks", 0)
        self.sampler = PromptSampler(len(self.data.train), self.cfg.seed, **state["data"])
        self.phases.mark_updated()  # the engine still holds the pre-checkpoint weights
        self.logger.truncate_after(self.step)
        self.say(f"resumed from {path} (step {self.step})")
        return path

    def _guard(self, m: dict) -> Optional[str]:
        """The collapse guard: a reason when a bound is crossed, else None."""
        g = self.cfg.guard
        if self.step < g.after_step:
            return None
        checks = [("actor/kl_ref", g.max_kl, 1), ("actor/grad_norm", g.max_grad_norm, 1), ("reward", g.min_reward, -1)]
        for key, bound, sign in checks:
            v = m.get(key)
            if v is not None and (not math.isfinite(v) or sign * (v - bound) > 0):
                return f"{key} = {v:.4g} crossed the bound {bound:g}"
        return None

    def fit(self) -> dict:
        from tqdm import tqdm

        cfg = self.cfg
        summary = {}
        if self.step == 0:
            before = self.evaluate()
            summary["em_before"] = before.get("eval/em")
            if before:
                self.say(f"held-out EM before training: {self._eval_line(before)}")
                self.logger.log(0, before, console=False)
        bar = tqdm(total=cfg.optim.total_steps, initial=self.step, desc="train", disable=not (
            cfg.logging.progress and self.info.is_main), leave=False)
        while self.step < cfg.optim.total_steps:
            if self.profile and self.step == self.profile_start:
                profiler_start()
            m = self.train_step()
            self.step += 1
            if self.profile and self.step == self.profile_start + 3:
                profiler_stop()
            reason = self._guard(m)
            if reason is not None:
                self._handle_collapse(reason)
                continue
            if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.optim.total_steps:
                scores = self.evaluate()
                m.update(scores)
                if scores:
                    self.say(f"held-out EM after {self.step} steps: {self._eval_line(scores)}")
            bar.update(1)
            bar.set_postfix(reward=f"{m.get('reward', 0):.3f}", em=f"{m.get('em', 0):.3f}")
            self.logger.log(self.step, m, console=self.step % cfg.logging.log_every == 0)
            every = cfg.logging.checkpoint_every
            if (every and self.step % every == 0) or self.step == cfg.optim.total_steps:
                # after the step's line (a crash while saving resumes to redo the step, its line cut back); the
                # save's own seconds go on a line of their own for the same step
                self.save()
                self.logger.log(self.step, {f"time/{k}": v for k, v in self.timer.reset().items()}, console=False)
        bar.close()
        after = self.evaluate()
        summary["em_after"] = after.get("eval/em")
        if after:
            self.logger.log(self.step, after, console=False)
        return summary

    @staticmethod
    def _eval_line(scores: dict) -> str:
        """``0.412 (nq 0.45, hotpotqa 0.37)``: the mean over sources, then each source's EM."""
        per = [(k.split("/", 2)[2], v) for k, v in scores.items() if k.startswith("eval/em/")]
        return f"{scores['eval/em']:.3f}" + (f" ({', '.join(f'{s} {v:.3f}' for s, v in per)})" if per else "")

    def _handle_collapse(self, reason: str) -> None:
        from fastcredit.distributed.checkpoint import checkpoint_candidates

        g = self.cfg.guard
        path = next(iter(checkpoint_candidates(self.ckpt_dir)[0]), None)  # the first tried; _resume says if not used
        if g.action == "stop" or path is None or self.rollbacks >= g.max_rollbacks:
            raise CollapseError(f"collapse guard at step {self.step}: {reason}; stopping "
                                f"({'no checkpoint to roll back to' if path is None else g.action})")
        rollbacks = self.rollbacks + 1
        self.say(f"collapse guard at step {self.step}: {reason}; rolling back to {path} ({rollbacks}/{g.max_rollbacks})")
        self._resume()
        self.rollbacks = rollbacks
        # Other prompts after the rollback, or the same collapse would repeat.
        self.sampler.reseed(self.sampler.seed + 7_777 * rollbacks)


def lr_factor(step: int, total: int, warmup_ratio: float, schedule: str) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` of ``total``."""
    warm = int(total * warmup_ratio)
    if step < warm:
        return (step + 1) / warm
    frac = (step - warm) / max(total - warm, 1)
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
    if schedule == "linear":
        return max(0.0, 1.0 - frac)
    return 1.0
