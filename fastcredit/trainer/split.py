"""The split placement: the training ranks' batch source and weights sink, and the rollout ranks' loop
(``distributed.placement=split``; the groups: ``fastcredit.distributed.split``).

    training rank: Trainer(cfg, run, training_parts, MailboxCollect(cfg, layout, run, n_train),
                           RolloutStream(cfg, layout, policy, run.timer))       # fastcredit.trainer.placement
    rollout rank:  RolloutWorker(cfg, layout).run()

    rollout rank, step t:  weights ≥ t − k (wait) → rollouts, rewards, DAPO, judges, labels → batch t to its
                           training rank → step t + 1 (no waiting for the update)
    training rank, step t: batch t (wait) → log-probs, decoupled correction, advantages, update → weights t + 1
                           to the rollout ranks (they load them on a thread of their own)

``rollout.max_staleness`` k bounds how far the rollout runs ahead: batch t is generated with weights of
version ≥ t − k, so every turn the trainer trains at step t is at most k versions old, which the
trainer checks on every turn (``fastcredit.trainer.offpolicy``); k = 0 is the colocated step, the
same trajectories and losses. New weights load between batches, or with ``rollout.partial`` between
two engine steps while trajectories are in flight (the turns keep the version they started with).

Held-out evaluation runs on the rollout ranks at the colocated points (before training, every
``eval.every`` steps, after the last), each with exactly the weights of that version (a newer version
waits until the evaluation is done); the scores reach the trainer with a later batch and are logged at
their own step. Checkpoints are the training ranks' (with the prompt order as of the last trained
batch, which each batch brings); on resume the rollout ranks start over from that step and prompt, so
no trained trajectory is lost or trained twice. ``trained.jsonl`` in the run folder lists what each
step trained (its prompts, trajectories and version lags).
"""
from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from fastcredit.data.sampler import PromptSampler
from fastcredit.distributed.process_group import max_over_ranks
from fastcredit.distributed.split import Mailbox, SplitError, WeightInbox, send_object
from fastcredit.runtime.files import seed_everything
from fastcredit.runtime.profiling import PhaseTimer
from fastcredit.trainer.loop import eval_line
from fastcredit.trainer.placement import BatchSource, WeightsSink, evaluate_heldout
from fastcredit.trainer.run import Run
from fastcredit.trainer.step import Collected, collect

LEDGER = "trained.jsonl"


def eval_points(cfg, start: int) -> list:
    """The versions held-out evaluation scores, as the colocated loop does: before training (from step 0), every
    ``eval.every`` steps, after the last; none with ``eval.questions=0``."""
    total, every = cfg.optim.total_steps, cfg.eval.every
    if cfg.eval.questions == 0:
        return []
    points = {0} if start == 0 else set()
    points |= {v for v in range(start + 1, total) if every and v % every == 0}
    if total > start:
        points.add(total)
    return sorted(points)


def merge_collected(msgs: list) -> Collected:
    """The batches of several rollout ranks as one (in rank order); per-rank metrics are averaged."""
    from fastcredit.rollout.trajectory import concat

    parts = [m["collected"] for m in msgs]
    if len(parts) == 1:
        return parts[0]
    extras = {}
    for key in parts[0].extras:
        vals = [p.extras[key] for p in parts]
        extras[key] = None if any(v is None for v in vals) else torch.cat(vals)
    labels = None
    if all(p.labels is not None for p in parts):
        labels = (torch.cat([p.labels[0] for p in parts]), parts[0].labels[1])
    keys = set().union(*(p.metrics for p in parts))
    metrics = {k: sum(p.metrics[k] for p in parts if k in p.metrics) / sum(k in p.metrics for p in parts)
               for k in keys}
    golds = None if any(p.golds is None for p in parts) else [g for p in parts for g in p.golds]
    draws, thinks = merge_answer_contexts(parts)
    return Collected([ids for p in parts for ids in p.prompt_ids], concat([p.batch for p in parts]),
                     torch.cat([p.reward_B for p in parts]), extras, labels, metrics, sum(p.tokens for p in parts),
                     golds, draws, thinks)


def merge_answer_contexts(parts: list) -> tuple:
    """IG-Search's drawn contexts of several rollout ranks' batches, their turn numbers moved past the turns of the
    batches before them (each rank drew from its own share); None where a part has none."""
    if any(p.ig_draws is None for p in parts):
        return None, None
    draws, thinks, offset = {}, ({} if all(p.ig_thinks is not None for p in parts) else None), 0
    for p in parts:
        draws.update({s + offset: [o + offset for o in obs] for s, obs in p.ig_draws.items()})
        if thinks is not None:
            thinks.update({(s + offset, o + offset): ids for (s, o), ids in p.ig_thinks.items()})
        offset += p.batch.num_turns
    return draws, thinks


class MailboxCollect(BatchSource):
    """A training rank's batches: the rollout ranks that feed it send them over the mailbox, each with the prompt
    order after it, the held-out scores made since the last one and the seconds its rollout rank worked and waited.
    Every trained step gets a line in ``trained.jsonl``. ``n_train``: the training questions. ``mailbox``: what
    receives the batches (default: a :class:`~fastcredit.distributed.split.Mailbox` on the layout's pair groups,
    opened when the source starts)."""

    no_rollback = "a rollback needs distributed.placement=colocated; resume from a checkpoint with --resume"

    def __init__(self, cfg, layout, run: Run, n_train: int, mailbox=None):
        self.cfg, self.layout, self.run, self.info, self.n_train = cfg, layout, run, layout.info, n_train
        self.bound = cfg.rollout.max_staleness
        self.mailbox = mailbox
        self.evals: dict = {}
        self.msgs: list = []  # the batch being trained: its rollout ranks' messages
        self.lag = 0  # its largest version lag over the training ranks

    def start(self, step: int, sampler: PromptSampler, resume: bool) -> None:
        """Tell the rollout ranks the step and prompt order to start from (they build their parts once this rank's
        are built: the world, tokenizer and index a warm start made here are ready, not built twice at once), open
        the mailbox and, resumed, cut the ledger back to ``step``."""
        layout, r = self.layout, self.cfg.rollout
        self.run.say(f"split placement: rank(s) {_span(layout.trainers)} train, {_span(layout.rollouts)} roll out; "
                     f"rollout.max_staleness={r.max_staleness}, rollout.partial={str(r.partial).lower()}")
        if layout.control_group is not None:
            box = [{"step": step, "sampler": sampler.state()}]
            dist.broadcast_object_list(box, src=0, group=layout.control_group)
        if self.mailbox is None:
            self.mailbox = Mailbox(layout.sources())
        if resume:
            self._cut_ledger(step)

    def take(self, step: int, sampler: PromptSampler) -> tuple[Collected, PromptSampler]:
        with self.run.timer.phase("wait_rollout"):
            msgs = self.mailbox.take()
        self._take_evals(msgs)
        steps = {m["step"] for m in msgs}
        if steps != {step}:
            raise SplitError(f"training step {step} got the rollout ranks' batches of step(s) {sorted(steps)}")
        self.msgs = msgs
        return merge_collected(msgs), PromptSampler(self.n_train, self.cfg.seed, **msgs[0]["sampler"])

    def learned(self, got: Collected, metrics: dict) -> None:
        """The batch's largest version lag over the training ranks (logged and in the ledger), and the seconds its
        rollout ranks worked and waited."""
        msgs = self.msgs
        self.lag = max_over_ranks(int(metrics.get("offpolicy/version_lag_max", 0)), self.info)
        busy = sum(m["busy_s"] for m in msgs) / len(msgs)
        waited = sum(m["waited_s"] for m in msgs) / len(msgs)
        metrics.update({"split/rollout_busy_s": busy, "split/rollout_wait_s": waited})

    def finish(self, step: int, got: Collected, metrics: dict) -> None:
        metrics["offpolicy/version_lag_max"] = float(self.lag)
        metrics["split/train_idle_frac"] = metrics.get("time/wait_rollout", 0.0) / metrics["time/step"]
        self._write_ledger(step, got, self.lag)

    def evaluate(self, step: int) -> dict:
        """The rollout ranks' scores of the policy now: after the last step, from their final message; before it,
        nothing yet (they arrive with a later batch and are logged at their own step)."""
        if step < self.cfg.optim.total_steps:
            return {}
        msgs = self.mailbox.take()
        if not all(m.get("final") for m in msgs):
            raise SplitError(f"after the last step the rollout ranks sent step(s) {[m.get('step') for m in msgs]}")
        self._take_evals(msgs)
        return self.evals.get(step, {})

    def late_scores(self, version: int) -> dict:
        return self.evals.get(version, {})

    def _take_evals(self, msgs: list) -> None:
        for version, scores in sorted(msgs[0].get("evals", {}).items()):
            self.evals[version] = scores
            if version != self.cfg.optim.total_steps and scores:  # the last: the Trainer's fit logs it
                when = "before training" if version == 0 else f"after {version} steps"
                self.run.say(f"held-out EM {when} (rollout ranks): {eval_line(scores)}")
                self.run.logger.log(version, scores, console=False)

    def _write_ledger(self, step: int, got: Collected, lag: int) -> None:
        """One line per trained step: its prompts (first-seen order), trajectories and largest version lag."""
        groups = [int(g) % self.n_train for g in got.batch.group_id_B.tolist()]
        prompts = list(dict.fromkeys(groups))
        row = {"step": step, "prompts": prompts, "trajectories": len(groups), "version_lag_max": lag}
        gathered = [None] * self.info.world_size
        if self.info.distributed:
            dist.all_gather_object(gathered, row, group=self.info.group)
        else:
            gathered = [row]
        if self.info.is_main:
            row = {"step": step, "prompts": [p for r in gathered for p in r["prompts"]],
                   "trajectories": sum(r["trajectories"] for r in gathered),
                   "version_lag_max": max(r["version_lag_max"] for r in gathered)}
            with open(os.path.join(self.run.out_dir, LEDGER), "a") as f:
                f.write(json.dumps(row) + "\n")

    def _cut_ledger(self, step: int) -> None:
        """Drop the ledger's lines of steps not in the checkpoint resumed from (they are trained again)."""
        path = os.path.join(self.run.out_dir, LEDGER)
        if not self.info.is_main or not os.path.exists(path):
            return
        with open(path) as f:
            rows = [line for line in f if (_row(line) or {}).get("step", step) < step]
        with open(path + ".tmp", "w") as f:
            f.writelines(rows)
        os.replace(path + ".tmp", path)


class RolloutStream(WeightsSink):
    """A training rank's weights sink: the policy's weights to the rollout ranks after every update (every training
    rank gathers its shards; training rank 0 sends), in the compute dtype, timed as ``send_weights``."""

    def __init__(self, cfg, layout, policy, timer: PhaseTimer):
        self.cfg, self.layout, self.info, self.policy, self.timer = cfg, layout, layout.info, policy, timer

    def send(self, version: int) -> None:
        from fastcredit.distributed.build import compute_dtype
        from fastcredit.distributed.weight_stream import send_weights

        dtype = compute_dtype(self.cfg.distributed, self.info, self.cfg.model.dtype)
        with self.timer.phase("send_weights"):
            named = self.policy.full_state(dtype)
            if self.layout.weights_group is not None:
                send_weights(named, version, src=0, group=self.layout.weights_group, device=self.info.device)
            else:
                for _ in named:  # the gathers are collective over the training ranks
                    pass


class RolloutWorker:
    """The rollout ranks' loop: batches for every step the training ranks will train, weights as they come."""

    def __init__(self, cfg, layout):
        from fastcredit.trainer.parts import build_rollout_rank

        self.cfg, self.layout, self.info = cfg, layout, layout.info
        # The training ranks' start message comes once their parts are built: the world, tokenizer and retrieval
        # index a warm start made there are ready, not built twice at once.
        box = [None]
        dist.broadcast_object_list(box, src=0, group=layout.control_group)
        self.start = box[0]["step"]
        self.inbox = WeightInbox(0, layout.weights_group, self.info.device,
                                 count=cfg.optim.total_steps - self.start + 1)
        seed_everything(cfg.seed)
        self.timer = PhaseTimer()
        self.parts = build_rollout_rank(cfg, layout, cfg.logging.output_dir, lambda text: None)
        self.sampler = PromptSampler(len(self.parts.shared.data.train), cfg.seed, **box[0]["sampler"])
        self.version = -1
        self.points = eval_points(cfg, self.start)
        self.evals: dict = {}
        self.waited_s = 0.0
        self.inflight_loads = 0  # versions loaded between two engine steps since the last batch was sent

    def _hold(self) -> float:
        """Versions up to this one may load: the next evaluation's (it must see exactly its version)."""
        return self.points[0] if self.points else float("inf")

    def _load(self, version: int, named: list) -> None:
        """A new version for the next rollout (synced into the engine when it starts)."""
        self.parts.weights.set(version, named)
        self.parts.phases.mark_updated(version)
        self.version = version

    def _load_in_flight(self) -> None:
        """``rollout.partial``: a version that has arrived goes into the engine between two of its steps."""
        got = self.inbox.take(upto=self._hold())
        if got is None:
            return
        version, named = got
        engine = self.parts.rollout.engine
        engine.load_between_steps(named)
        engine.weights_version = version
        self.parts.weights.set(version, named)
        self.parts.phases.version, self.parts.phases.stale_weights = version, False
        self.version = version
        self.inflight_loads += 1

    def advance(self, need: int) -> None:
        """Load the newest weights that have arrived (waiting while older than ``need``), evaluating on the way at
        each evaluation point. Several rollout ranks agree on each version they load and on each evaluation (two
        reductions a round), so their collectives stay in step though their weights arrive at different times."""
        t0 = time.perf_counter()
        while True:
            if self.version < need:
                self.inbox.wait_for(need)
            newest = self.inbox.newest(upto=self._hold())
            target = -max_over_ranks(-max(self.version, -1 if newest is None else newest), self.info)
            if target > self.version:
                self._load(*self.inbox.take(upto=target))
            at_point = bool(self.points) and -max_over_ranks(-int(self.version == self.points[0]), self.info) == 1
            if at_point:
                self.evals[self.points.pop(0)] = evaluate_heldout(self.parts, self.cfg, self.info, PhaseTimer())
            elif self.version >= need:
                break
        self.waited_s += time.perf_counter() - t0  # evaluations included: the rollout did not roll out

    def run(self) -> None:
        cfg, k = self.cfg, self.cfg.rollout.max_staleness
        dst, group = self.layout.feeds, self.layout.pairs[self.layout.global_rank][1]
        try:
            for step in range(self.start, cfg.optim.total_steps):
                self.advance(need=max(step - k, self.start))  # the first batch waits for the trainer's weights
                t0 = time.perf_counter()
                got = collect(self.parts, cfg, self.info, self.timer, self.sampler, step,
                              between_steps=self._load_in_flight if cfg.rollout.partial else None)
                got.metrics.update({f"time/{name}": v for name, v in self.timer.reset().items()})
                got.metrics.update({f"time/colocate/{key}": v for key, v in self.parts.phases.take_timings().items()})
                got.metrics["split/inflight_loads"] = float(self.inflight_loads)
                # host tensors only: a pickled CUDA tensor would land on the same device index on the training rank
                got.extras = {key: v.cpu() if torch.is_tensor(v) else v for key, v in got.extras.items()}
                got.reward_B = got.reward_B.cpu()
                self.inflight_loads = 0
                send_object({"step": step, "collected": got, "sampler": self.sampler.state(), "evals": self.evals,
                             "busy_s": time.perf_counter() - t0, "waited_s": self.waited_s}, dst, group)
                self.evals, self.waited_s = {}, 0.0
            self.advance(need=cfg.optim.total_steps)
            send_object({"final": True, "evals": self.evals}, dst, group)
        except Exception as exc:
            send_object({"error": f"{type(exc).__name__}: {exc}"}, dst, group)
            raise


def _span(ranks: list) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _row(line: str):
    """A ledger line's row, or None for a blank or torn line (a crash mid-write)."""
    try:
        return json.loads(line)
    except ValueError:
        return None
