"""The Trainer: one run's loop: fit, held-out evaluation, checkpoints and resume, the collapse guard.

    run = open_run(cfg, info, resume)                          # fastcredit.trainer.run
    trainer = Trainer(cfg, run, training_parts, source, sink, resume=resume)
    summary = trainer.fit()

The Trainer holds the training side of its rank (:class:`~fastcredit.trainer.parts.TrainingParts`: the policy, value
model and reference and their training engines) and is given, by its placement, where its batches come from and
where its weights go (``fastcredit.trainer.placement``: colocated, this rank's own rollouts and engine; split, the
rollout ranks over the mailbox). Its loop is the same for both: a batch, the update
(:func:`fastcredit.trainer.step.learn`, which takes the parts and plain values, never the Trainer), the weights
out, the step's metrics. The policy and value model train through the engine ``distributed.engine`` names (FSDP2,
or DeepSpeed ZeRO stage ``distributed.zero_stage``; ``fastcredit.distributed.build``). The entry point, which
builds the Trainer for the placement, is ``fastcredit.train``.
"""
from __future__ import annotations

import math
import os
import time
from typing import Optional

from fastcredit.config import TrainConfig
from fastcredit.data.sampler import PromptSampler
from fastcredit.runtime.profiling import nvtx_range, profiler_start, profiler_stop
from fastcredit.trainer.parts import TrainingParts
from fastcredit.trainer.placement import BatchSource, WeightsSink
from fastcredit.trainer.run import Run
from fastcredit.trainer.schedule import LRSchedule


class CollapseError(RuntimeError):
    """The collapse guard tripped and the configured action is to stop."""


class Trainer:
    """One run's loop over its batches: fit, evaluate, save, resume.

    ``step``: training steps done; ``lr.opt_steps``: optimizer steps done; ``rollbacks``: collapse-guard
    rollbacks so far; ``sampler``: the order training prompts are drawn in. All four are checkpointed."""

    def __init__(self, cfg: TrainConfig, run: Run, parts: TrainingParts, source: BatchSource, sink: WeightsSink,
                 resume: bool = False, profile: bool = False):
        """``cfg`` as :func:`check_run` passed it (the training command runs the checks once, before the process
        group starts); ``run``: its folder, metric log and timer (:func:`~fastcredit.trainer.run.open_run`);
        ``parts``: what trains on this rank; ``source`` and ``sink``: the placement's batches and weights
        (``fastcredit.trainer.placement``). With ``resume`` the newest checkpoint is loaded; then the source starts
        and the sink gets the weights the run starts from."""
        self.cfg, self.run, self.parts, self.source, self.sink = cfg, run, parts, source, sink
        self.info, self.out_dir, self.ckpt_dir = run.info, run.out_dir, run.ckpt_dir
        self.logger, self.timer, self.profile = run.logger, run.timer, profile
        self.profile_start = min(2, max(cfg.optim.total_steps - 1, 0))  # nsys captures steps 2-4
        self.step, self.rollbacks, self.lr = 0, 0, LRSchedule(cfg.optim)
        self.sampler = PromptSampler(len(parts.shared.data.train), cfg.seed)
        if resume:
            self._resume()
        source.start(self.step, self.sampler, resume)
        sink.send(self.step)

    def say(self, text: str) -> None:
        """A line on rank 0's console, above the progress bar when one is showing."""
        self.run.say(text)

    def train_step(self) -> dict:
        """One training step on the source's next batch (``fastcredit.trainer.step.learn``), the new weights to the
        sink; returns the step's metrics (rank-averaged)."""
        from fastcredit.trainer.step import learn, step_metrics

        cfg, info, timer = self.cfg, self.info, self.timer
        with nvtx_range("step"):
            t0 = time.perf_counter()
            got, self.sampler = self.source.take(self.step, self.sampler)
            metrics = learn(self.parts, cfg, info, timer, got, self.step, self.lr, bound=self.source.bound)
            self.source.learned(got, metrics)
            self.sink.send(self.step + 1)
            m = step_metrics(self.parts, info, timer, metrics, got.tokens, t0)
            self.source.finish(self.step, got, m)
            return m

    def evaluate(self) -> dict:
        """Held-out scores of the policy now (the source's: where the engine is); empty when evaluation is off."""
        return self.source.evaluate(self.step)

    def _checkpointed(self) -> tuple[dict, dict, dict]:
        """What a checkpoint holds, by name: DCP models and optimizers, and engines that save themselves."""
        models, optims, engines = {}, {}, {}
        for name, engine in (("policy", self.parts.training.policy), ("value", self.parts.training.value)):
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
        state = {"data": self.sampler.state(), "opt_steps": self.lr.opt_steps, "rollbacks": self.rollbacks}
        with self.timer.phase("checkpoint"):
            save_checkpoint(self.ckpt_dir, self.step, models, optims, state, keep=self.cfg.logging.keep_checkpoints,
                            engines=engines)

    def _resume(self) -> Optional[str]:
        """Load the newest checkpoint that verifies (earlier ones when the latest is damaged); returns its path."""
        from fastcredit.distributed.checkpoint import resume_checkpoint

        models, optims, engines = self._checkpointed()
        with self.parts.phases.train():  # loaded where the training state lives while it trains
            found = resume_checkpoint(self.ckpt_dir, models, optims, engines=engines, say=self.say)
        if found is None:
            self.say(f"--resume: no checkpoint in {self.ckpt_dir}; starting from step 0")
            return None
        path, state = found
        self.step, self.lr.opt_steps = state["step"], state["opt_steps"]
        self.rollbacks = state.get("rollbacks", 0)
        self.sampler = PromptSampler(len(self.parts.shared.data.train), self.cfg.seed, **state["data"])
        self.parts.phases.mark_updated(self.step)  # the engine still holds the pre-checkpoint weights
        self.logger.truncate_after(self.step)
        self.say(f"resumed from {path} (step {self.step})")
        return path

    def fit(self) -> dict:
        """Train ``optim.total_steps`` steps (from the resumed step), evaluating before, every ``eval.every``
        steps and after; returns ``{"em_before", "em_after"}`` (None where evaluation is off)."""
        from fastcredit.runtime.progress import progress_bar

        cfg = self.cfg
        summary, before = {}, {}
        if self.step == 0:
            before = self.evaluate()
            summary["em_before"] = before.get("eval/em")
            if before:
                self.say(f"held-out EM before training: {eval_line(before)}")
                self.logger.log(0, before, console=False)
        elif (resumed := self.logged_em(self.step)) is not None:  # a resumed run starts from its checkpoint's figure
            summary["em_resumed"] = (self.step, resumed)
        bar = progress_bar(total=cfg.optim.total_steps, initial=self.step, desc="train", unit="step", disable=not (
            cfg.logging.progress and self.info.is_main), leave=False)
        while self.step < cfg.optim.total_steps:
            m = self._profiled_step()
            reason = collapse_reason(m, cfg.guard, self.step)
            if reason is not None:
                self._handle_collapse(reason)
                continue
            if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.optim.total_steps:
                scores = self.evaluate()
                m.update(scores)
                if scores:
                    self.say(f"held-out EM after {self.step} steps: {eval_line(scores)}")
            bar.set_postfix(loss=f"{m.get('actor/pg_loss', 0):.3g}", reward=f"{m.get('reward', 0):.3f}",
                            em=f"{m.get('em', 0):.3f}", refresh=False)
            bar.update(1)
            self.logger.log(self.step, m, console=self.step % cfg.logging.log_every == 0)
            every = cfg.logging.checkpoint_every
            if (every and self.step % every == 0) or self.step == cfg.optim.total_steps:
                # after the step's line (a crash while saving resumes to redo the step, its line cut back); the
                # save's own seconds go on a line of their own for the same step
                self.save()
                self.logger.log(self.step, {f"time/{k}": v for k, v in self.timer.reset().items()}, console=False)
        bar.close()
        # no step since the evaluation before training (optim.total_steps=0): the same weights, scored once
        after = before if self.step == 0 else self.evaluate()
        summary["em_after"] = after.get("eval/em")
        if after and self.step > 0:
            self.logger.log(self.step, after, console=False)
        if late := self.source.late_scores(0):  # split: the scores before training came with a later batch
            summary["em_before"] = late.get("eval/em")
        return summary

    def logged_em(self, step: int) -> Optional[float]:
        """The held-out EM this run's ``metrics.jsonl`` holds for ``step`` (the last one logged), None without one
        (or on a rank that writes no metrics)."""
        from fastcredit.runtime.tracking import read_metrics

        path = self.logger.path
        if not path or not os.path.exists(path):
            return None
        found = [row["eval/em"] for row in read_metrics(path) if row.get("step") == step and "eval/em" in row]
        return float(found[-1]) if found else None

    step_profile = None  # --profile's torch.profiler session while it records (fastcredit.runtime.torch_profile)

    def report(self, summary: dict) -> None:
        """Held-out EM before and after training (``summary``: what :meth:`fit` returned), and where the metrics
        and curves are."""
        from fastcredit.runtime.tracking import plot_metrics

        before, after, resumed = summary.get("em_before"), summary.get("em_after"), summary.get("em_resumed")
        if after is not None:
            if before is None and resumed is not None:
                start = f"{resumed[1]:.3f} at step {resumed[0]} (the checkpoint's)"
            else:
                start = f"{'n/a' if before is None else f'{before:.3f}'} before"
            print(f"held-out EM: {start} -> {after:.3f} after {self.step} steps")
        if self.logger.path and os.path.exists(self.logger.path):
            print(f"metrics: {self.logger.path}")
            if self.cfg.logging.curves:
                png = plot_metrics(self.logger.path, os.path.join(self.out_dir, "curves.png"), title=self.cfg.run_name)
                print(f"curves:  {png}")

    def _profiled_step(self) -> dict:
        """One step, counted; under ``--profile`` steps ``profile_start`` to +2 (fewer when the run ends first) are
        profiled: the CUDA profiler range nsys captures, and a torch.profiler trace with its per-phase table in
        ``<output_dir>/profile/``, printed when the last of them is done."""
        if self.profile and self.step == self.profile_start:
            from fastcredit.runtime.torch_profile import StepProfile

            profiler_start()
            self.step_profile = StepProfile(self.out_dir, self.info.device, self.info.rank)
            self.step_profile.start()
        m = self.train_step()
        self.step += 1
        if self.step_profile is not None:
            self.step_profile.add_step(self.step, m)
            if self.step >= min(self.profile_start + 3, self.cfg.optim.total_steps):
                profiler_stop()
                trace, table = self.step_profile.stop()
                self.step_profile = None
                self.say(f"--profile: steps {self.profile_start + 1}-{self.step} in {trace}\n{table.rstrip()}")
        return m

    def _handle_collapse(self, reason: str) -> None:
        """Stop (``guard.action=stop``, no checkpoint, out of rollbacks, or a batch source that cannot roll back),
        or roll back to the newest checkpoint and go on with other prompts."""
        from fastcredit.distributed.checkpoint import checkpoint_candidates

        if self.source.no_rollback is not None:
            raise CollapseError(f"collapse guard at step {self.step}: {reason}; stopping ({self.source.no_rollback})")
        g = self.cfg.guard
        path = next(iter(checkpoint_candidates(self.ckpt_dir)[0]), None)  # the first tried; _resume says if not used
        if g.action == "stop" or path is None or self.rollbacks >= g.max_rollbacks:
            raise CollapseError(f"collapse guard at step {self.step}: {reason}; stopping "
                                f"({'no checkpoint to roll back to' if path is None else g.action})")
        rollbacks = self.rollbacks + 1
        self.say(f"collapse guard at step {self.step}: {reason}; rolling back to {path} "
                 f"({rollbacks}/{g.max_rollbacks})")
        self._resume()
        self.rollbacks = rollbacks
        # Other prompts after the rollback, or the same collapse would repeat.
        self.sampler.reseed(self.sampler.seed + 7_777 * rollbacks)


def collapse_reason(m: dict, guard, step: int) -> Optional[str]:
    """The collapse guard (``guard.*``) on step ``step``'s metrics: a reason when a bound is crossed, else None."""
    if step < guard.after_step:
        return None
    checks = [("actor/kl_ref", guard.max_kl, 1), ("actor/grad_norm", guard.max_grad_norm, 1),
              ("reward", guard.min_reward, -1)]
    for key, bound, sign in checks:
        v = m.get(key)
        if v is not None and (not math.isfinite(v) or sign * (v - bound) > 0):
            return f"{key} = {v:.4g} crossed the bound {bound:g}"
    return None


def eval_line(scores: dict) -> str:
    """``0.412 (nq 0.45, hotpotqa 0.37)``: the mean over sources, then each source's EM."""
    per = [(k.split("/", 2)[2], v) for k, v in scores.items() if k.startswith("eval/em/")]
    return f"{scores['eval/em']:.3f}" + (f" ({', '.join(f'{s} {v:.3f}' for s, v in per)})" if per else "")
