"""The Trainer's collaborators without a process group or a model: the split placement's batch source (a mailbox
fake standing in for the rollout ranks) and weights sink (a policy fake), and the colocated source's evaluation
switch. The loop that calls them runs end to end in tests/test_train.py and tests/test_split_train.py."""
import json
import types

import pytest
import torch

from fastcredit.config import load_config
from fastcredit.data.sampler import PromptSampler
from fastcredit.distributed.process_group import DistInfo
from fastcredit.distributed.split import SplitError
from fastcredit.rollout.trajectory import Turn, from_turns
from fastcredit.runtime.profiling import PhaseTimer
from fastcredit.trainer.placement import BatchSource, EngineSync, LocalCollect, WeightsSink
from fastcredit.trainer.run import Run
from fastcredit.trainer.split import LEDGER, MailboxCollect, RolloutStream
from fastcredit.trainer.step import Collected

N_TRAIN = 10  # training questions


class Mailbox:
    """The rollout ranks' messages, one round per take()."""

    def __init__(self, *rounds):
        self.rounds = list(rounds)

    def take(self) -> list:
        return self.rounds.pop(0)


class Logger:
    def __init__(self):
        self.logged = []

    def log(self, step, metrics, console=True):
        self.logged.append((step, metrics))


def _cfg(*overrides):
    return load_config(None, ["distributed.placement=split", "optim.total_steps=2", *overrides])


def _layout():
    return types.SimpleNamespace(info=DistInfo(), trainers=[0], rollouts=[1], control_group=None, weights_group=None,
                                 sources=lambda: [])


def _run(tmp_path) -> Run:
    return Run(DistInfo(), str(tmp_path), Logger(), PhaseTimer())


def _collected(groups: list) -> Collected:
    batch = from_turns([[Turn([1, 2], "answer", ())] for _ in groups], group_id=groups)
    return Collected([[7]] * len(groups), batch, torch.zeros(len(groups)), {}, None, {"reward": 0.5}, 12.0)


def _batch(step, groups, evals=None, cursor=4):
    return {"step": step, "collected": _collected(groups), "sampler": {"epoch": 0, "cursor": cursor},
            "evals": evals or {}, "busy_s": 2.0, "waited_s": 0.5}


def test_the_split_source_trains_what_the_rollout_ranks_sent_and_keeps_the_ledger(tmp_path, capsys):
    run = _run(tmp_path)
    (tmp_path / LEDGER).write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "pro')  # a resumed run, a torn line
    mailbox = Mailbox([_batch(1, [3, 13, 3], evals={0: {"eval/em": 0.25}})],
                      [{"final": True, "evals": {2: {"eval/em": 0.5}}}])
    source = MailboxCollect(_cfg("rollout.max_staleness=1"), _layout(), run, N_TRAIN, mailbox=mailbox)
    assert isinstance(source, BatchSource) and source.bound == 1 and "colocated" in source.no_rollback
    source.start(1, PromptSampler(N_TRAIN, 0), resume=True)
    assert [json.loads(line)["step"] for line in open(tmp_path / LEDGER)] == [0]  # cut back to the checkpoint's
    got, sampler = source.take(1, PromptSampler(N_TRAIN, 0))
    assert got.batch.group_id_B.tolist() == [3, 13, 3] and sampler.state() == {"epoch": 0, "cursor": 4}
    # the scores before training came with the batch: logged at their own step, and kept for the summary
    assert run.logger.logged == [(0, {"eval/em": 0.25})] and source.late_scores(0) == {"eval/em": 0.25}
    metrics = {"offpolicy/version_lag_max": 1.0}
    source.learned(got, metrics)
    assert metrics == {"offpolicy/version_lag_max": 1.0, "split/rollout_busy_s": 2.0, "split/rollout_wait_s": 0.5}
    logged = {**metrics, "time/step": 2.0, "time/wait_rollout": 0.5}
    source.finish(1, got, logged)
    assert logged["split/train_idle_frac"] == 0.25 and logged["offpolicy/version_lag_max"] == 1.0
    row = json.loads(open(tmp_path / LEDGER).read().splitlines()[-1])
    assert row == {"step": 1, "prompts": [3], "trajectories": 3, "version_lag_max": 1}  # group 13 is prompt 3
    assert source.evaluate(1) == {}  # before the last step the scores come later, with a batch
    assert source.evaluate(2) == {"eval/em": 0.5} and len(run.logger.logged) == 1  # the last: the Trainer logs it
    out = capsys.readouterr().out
    assert "split placement: rank(s) 0 train, 1 roll out; rollout.max_staleness=1" in out
    assert "held-out EM before training (rollout ranks): 0.250" in out


def test_the_split_source_refuses_a_batch_of_another_step(tmp_path):
    source = MailboxCollect(_cfg(), _layout(), _run(tmp_path), N_TRAIN,
                            mailbox=Mailbox([_batch(2, [0])], [_batch(1, [0])]))
    source.start(0, PromptSampler(N_TRAIN, 0), resume=False)
    with pytest.raises(SplitError, match=r"training step 1 got the rollout ranks' batches of step\(s\) \[2\]"):
        source.take(1, PromptSampler(N_TRAIN, 0))
    with pytest.raises(SplitError, match="after the last step the rollout ranks sent step"):
        source.evaluate(2)


def test_the_split_sink_gathers_every_shard_and_times_the_send():
    read = []

    class Policy:
        def full_state(self, dtype):
            for name in ("a", "b"):
                read.append((name, dtype))
                yield name, torch.zeros(2)

    timer = PhaseTimer()
    sink = RolloutStream(_cfg(), _layout(), Policy(), timer)
    assert isinstance(sink, WeightsSink)
    sink.send(3)  # not the sending rank (no weights group): the gathers still run, every one
    assert read == [("a", None), ("b", None)] and "send_weights" in timer.reset()  # a CPU: the fp32 masters


def test_the_colocated_collaborators():
    parts = types.SimpleNamespace(shared=types.SimpleNamespace(data=types.SimpleNamespace(test=[object()] * 5)))
    source = LocalCollect(parts, load_config(None, ["eval.questions=0"]), DistInfo(), PhaseTimer())
    assert source.bound == 0 and source.no_rollback is None  # the collapse guard may roll back
    assert source.evaluate(3) == {} and source.late_scores(0) == {}  # evaluation off: nothing rolls out
    assert EngineSync().send(1) is None  # the phase manager syncs the engine at its next rollout
