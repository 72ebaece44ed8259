"""TRL's ``GRPOTrainer`` as a peer of fastcredit's trainer on Search-R1's loop, written as a TRL user would.

    python -m bench.peer_trl --config configs/demo.yaml --model W/start --out W/trl --retrieval-url URL --steps 3
    python -m bench.peer_trl --config configs/demo.yaml --model W/start --out W/trl_replay --replay W/replay
    python -m bench.peer_trl --settings configs/searchr1_grpo.yaml     # the settings table of docs/peer-trl.md

The policy is an HF folder (``--model``: ``bench/race_fastcredit.py prepare`` writes fastcredit's start there) and
``GRPOTrainer`` trains it with the ``GRPOConfig`` that ``bench/peer_trl_settings.py`` maps from the fastcredit
config (``--config`` and ``key=value`` overrides: clip, KL, entropy, loss aggregation, lr, batch, precision, ...).
It rolls out with ``rollout_func`` (``bench/peer_trl_rollout.py``): Search-R1's turns with ``model.generate`` and
a ``/retrieve`` server at ``--retrieval-url`` (``python -m fastcredit.retrieval.serve`` on the same corpus), or,
with ``--replay``, fastcredit's recorded batches, so that both trainers train on identical tokens. The dataset is
the config's training questions in fastcredit's draw order (``fastcredit.data.sampler.PromptSampler``), so step
``t`` of each trainer rolls out the same prompts.

Each step's seconds go to ``<out>/steps.jsonl`` under fastcredit's metric names (:class:`StepClock`): the step
(``on_step_begin`` to ``on_step_end``), the rollout and its generation and retrieval, the old log-probs (the policy's
forwards without gradients outside the rollout: TRL runs them when one rollout feeds several optimizer steps), the
reference log-probs (the reference model's forwards) and the update (from the policy's first forward with
gradients to the step's end), and what the rollout did. ``--save-every K`` writes a checkpoint every K steps
(``checkpoint-<optimizer steps>``: the policy, its tokenizer, the optimizer), ``--resume`` continues from the last
one. No TRL code is copied here; nothing in ``fastcredit/`` imports TRL.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16: said once here

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from bench.bench_step import peak_gib, reset_peak  # noqa: E402
from bench.peer_trl_rollout import (Caps, ReplayRollout, SearchR1Rollout, group_prompts, load_replay,  # noqa: E402
                                    replayed_reward, trl_reward)
from bench.peer_trl_settings import grpo_kwargs, markdown_table, settings  # noqa: E402
from bench.race_fastcredit import DIGEST, folder_digest  # noqa: E402

STEPS_LOG = "steps.jsonl"


class StepClock(TrainerCallback):
    """Times each optimizer step of a GRPOTrainer and logs it with the rollout's figures (``rollout.last_stats``)
    as one JSON line of ``path``, under fastcredit's names: ``time/step``, ``time/rollout`` (and its
    ``generating`` / ``retrieving``), ``time/ref_logprobs``, ``time/update``, ``tokens/trained``. A step is one
    rollout and the ``per_rollout`` optimizer steps on it (fastcredit's mini-batches), numbered from 1 as
    fastcredit numbers its steps."""

    def __init__(self, rollout, path: str, per_rollout: int = 1):
        self.rollout, self.path, self.per_rollout = rollout, path, per_rollout
        self.t0 = self.update_from = None
        self.ref_s = self.old_s = 0.0
        self._ref_t0 = self._old_t0 = None
        self.in_rollout = False

    def wrap(self, rollout_func):
        """``rollout_func`` as TRL is given it: the clock knows when a policy forward is the rollout's."""
        def timed(prompts, trainer):
            self.in_rollout = True
            try:
                return rollout_func(prompts, trainer)
            finally:
                self.in_rollout = False

        return timed

    def attach(self, trainer) -> None:
        """Hooks on the trainer's models: the reference's forwards are timed; so are the policy's forwards without
        gradients outside the rollout (TRL's old log-probs, which it computes when a rollout feeds several
        optimizer steps); the policy's first forward with gradients in a step starts the update."""
        def policy_forward(module, args):
            if self.t0 is None or self.update_from is not None:
                return
            if torch.is_grad_enabled():
                self.update_from = time.perf_counter()
            elif not self.in_rollout:
                self._old_t0 = time.perf_counter()

        def policy_done(module, args, output):
            if self._old_t0 is not None:
                self.old_s += time.perf_counter() - self._old_t0
                self._old_t0 = None

        def ref_begin(module, args):
            self._ref_t0 = time.perf_counter()

        def ref_end(module, args, output):
            self.ref_s += time.perf_counter() - self._ref_t0

        trainer.model.register_forward_pre_hook(policy_forward)
        trainer.model.register_forward_hook(policy_done)
        if getattr(trainer, "ref_model", None) is not None:
            trainer.ref_model.register_forward_pre_hook(ref_begin)
            trainer.ref_model.register_forward_hook(ref_end)

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step % self.per_rollout == 0:  # the optimizer step that rolls out first
            self.t0, self.update_from, self.ref_s, self.old_s = time.perf_counter(), None, 0.0, 0.0

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.per_rollout:
            return
        now = time.perf_counter()
        row = {"step": state.global_step // self.per_rollout, "time/step": now - self.t0,
               "time/old_logprobs": self.old_s, "time/ref_logprobs": self.ref_s,
               "time/update": now - (self.update_from or now),
               **self.rollout.last_stats}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.t0 = None


def read_steps(out: str, upto=None) -> list:
    """The rows :class:`StepClock` logged in ``out`` (``upto``: those of steps up to it, the rest dropped)."""
    path = os.path.join(out, STEPS_LOG)
    if not os.path.exists(path):
        return []
    rows = [json.loads(line) for line in open(path) if line.strip()]
    if upto is not None:
        rows = [r for r in rows if r["step"] <= upto]
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def training_rows(cfg, tokenizer, steps: int) -> tuple[list, dict]:
    """``(dataset rows, {prompt text: ids})``: ``steps`` x ``optim.batch_prompts`` training questions in the order
    fastcredit's trainer draws them, each with its prompt text (the ids fastcredit rolls out from, decoded) and
    gold answers."""
    from fastcredit.data.build import load_data
    from fastcredit.data.sampler import PromptSampler
    from fastcredit.rollout.build import prompt_ids

    train = load_data(cfg).train
    sampler = PromptSampler(len(train), cfg.seed)
    order = [i for _ in range(steps) for i in sampler.take(cfg.optim.batch_prompts)]
    examples = [train[i] for i in order]
    ids = prompt_ids(cfg, tokenizer, examples)
    texts = [tokenizer.decode(p, skip_special_tokens=False) for p in ids]
    rows = [{"prompt": t, "golden_answers": list(ex.golden_answers), "qid": str(ex.id)}
            for t, ex in zip(texts, examples)]
    return rows, dict(zip(texts, ids))


def replay_rows(steps: list, decode) -> list:
    """Dataset rows of a replay: each recorded step's prompts, one per group, in the batch's order."""
    return [{"prompt": decode(p)} for step in steps for p in group_prompts(step)]


def build(a, cfg):
    """``(trainer, rollout, clock)`` for the command line ``a`` over the fastcredit config ``cfg``."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from fastcredit.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(a.model)

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=False)

    if a.replay:
        recorded = load_replay(a.replay)
        if len(recorded) < a.steps:
            raise SystemExit(f"--replay {a.replay} holds {len(recorded)} steps; --steps is {a.steps}")
        rows, reward = replay_rows(recorded[: a.steps], decode), replayed_reward
        rollout = ReplayRollout(recorded, decode, per_rollout(cfg))
    else:
        if not a.retrieval_url:
            raise SystemExit("--retrieval-url is needed to roll out (or --replay a recording)")
        from fastcredit.retrieval.client import RetrievalClient

        rows, ids = training_rows(cfg, tokenizer, a.steps)
        rollout = SearchR1Rollout(tokenizer, ids, Caps.from_config(cfg.rollout), RetrievalClient(a.retrieval_url),
                                  cfg.retrieval.topk)
        reward = trl_reward(cfg)
    kwargs = grpo_kwargs(settings(cfg, a.micro_batch))
    kwargs["model_init_kwargs"] = {**kwargs["model_init_kwargs"], "attn_implementation": cfg.model.attn_impl}
    k = per_rollout(cfg)
    save = {"save_strategy": "steps", "save_steps": a.save_every * k} if a.save_every else {"save_strategy": "no"}
    args = GRPOConfig(output_dir=a.out, max_steps=a.steps * k, logging_steps=1, report_to="none", disable_tqdm=True,
                      dataloader_num_workers=0, use_cpu=not torch.cuda.is_available(), **save, **kwargs)
    clock = StepClock(rollout, os.path.join(a.out, STEPS_LOG), k)
    trainer = GRPOTrainer(model=a.model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, rollout_func=clock.wrap(rollout))
    clock.attach(trainer)
    trainer.add_callback(clock)
    return trainer, rollout, clock


def per_rollout(cfg) -> int:
    """TRL's optimizer steps a rollout: fastcredit's mini-batches a step."""
    return max(cfg.optim.batch_prompts // cfg.optim.mini_batch_prompts, 1)


def last_checkpoint(out: str):
    """``(folder, optimizer step)`` of the newest ``checkpoint-<step>`` in ``out``, or ``(None, 0)``."""
    found = sorted(((int(p.rsplit("-", 1)[1]), p) for p in glob.glob(os.path.join(out, "checkpoint-*"))
                    if p.rsplit("-", 1)[1].isdigit()))
    return (found[-1][1], found[-1][0]) if found else (None, 0)


def run(a) -> dict:
    """Train ``--steps`` steps; the timed rows (steps after ``--warmup``), wall time, peak memory, digests."""
    from fastcredit.config import load_config

    cfg = load_config([a.config], a.overrides)
    os.makedirs(a.out, exist_ok=True)
    checkpoint, done = last_checkpoint(a.out) if a.resume else (None, 0)
    if a.resume:
        read_steps(a.out, upto=done // per_rollout(cfg))  # the steps after the checkpoint are trained again
    else:
        open(os.path.join(a.out, STEPS_LOG), "w").close()
    trainer, rollout, clock = build(a, cfg)
    start = folder_digest(trainer.model)
    expected = os.path.join(a.model, DIGEST)
    if checkpoint is None and os.path.exists(expected) and json.load(open(expected))["folder"] != start:
        raise SystemExit(f"{a.model}: the model TRL loaded is not the one its {DIGEST} names")
    reset_peak()
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=checkpoint)
    wall = time.perf_counter() - t0
    rows = read_steps(a.out)
    if a.save_every and trainer.state.global_step % (a.save_every * per_rollout(cfg)):
        trainer.save_model(os.path.join(a.out, f"checkpoint-{trainer.state.global_step}"))
    return {"rows": [r for r in rows if r["step"] > a.warmup], "wall_s": wall, "peak": peak_gib(),
            "start_weights": start, "end_weights": folder_digest(trainer.model)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", metavar="CONFIG", default=None,
                   help="print CONFIG's settings mapped onto GRPOConfig as a markdown table and exit")
    p.add_argument("--config", help="the fastcredit config the settings come from (estimator grpo)")
    p.add_argument("--model", help="the start policy: a Hugging Face folder")
    p.add_argument("--out", help="TRL's output folder (steps.jsonl, checkpoints)")
    p.add_argument("--retrieval-url", default=None, help="a /retrieve server on the config's corpus")
    p.add_argument("--replay", default=None, help="train on fastcredit's batches recorded in this folder")
    p.add_argument("--steps", type=int, default=1, help="steps (each one rollout and its optimizer steps)")
    p.add_argument("--warmup", type=int, default=0, help="the first steps left out of the result's rows")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="trajectories a forward / backward (default: rollout.n_samples, one group)")
    p.add_argument("--save-every", type=int, default=0, help="a checkpoint every this many steps (0: none)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--result", default=None, help="where the result JSON goes (default: OUT/result.json)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of --config")
    return p


def parse(argv=None) -> argparse.Namespace:
    """The command line, checked, ``--micro-batch`` defaulted to the config's group size."""
    from fastcredit.config import load_config

    p = parser()
    a = p.parse_intermixed_args(argv)
    if a.settings:
        return a
    if not (a.config and a.model and a.out):
        p.error("--config, --model and --out are needed to train")
    if a.steps < 1 or not 0 <= a.warmup < a.steps:
        p.error("--steps must be at least 1 and --warmup below it")
    if a.micro_batch is None:
        a.micro_batch = load_config([a.config], a.overrides).rollout.n_samples
    return a


def main(argv=None) -> int:
    a = parse(argv)
    if a.settings:
        from fastcredit.config import load_config

        cfg = load_config([a.settings], a.overrides)
        sys.stdout.write(markdown_table(settings(cfg, a.micro_batch or cfg.rollout.n_samples)))
        return 0
    result = run(a)
    with open(a.result or os.path.join(a.out, "result.json"), "w") as f:
        json.dump(result, f)
    print(f"TRL: {len(result['rows'])} timed steps in {a.out}/{STEPS_LOG}; wall {result['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
