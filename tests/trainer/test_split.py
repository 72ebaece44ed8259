"""The split placement's pieces without a process group: the rank split, evaluation points, merging the batches
of several rollout ranks, the weight inbox's bound and hold, the rollout side's weight mirror, the config rules."""
import threading
import time

import pytest
import torch

from fastcredit.config import ConfigError, load_config
from fastcredit.distributed.split import SplitError, WeightInbox, split_sizes
from fastcredit.rollout.trajectory import Turn, from_turns
from fastcredit.trainer.split import eval_points, merge_collected
from fastcredit.trainer.parts import WeightMirror
from fastcredit.trainer.step import Collected


def test_the_split_of_the_ranks():
    assert split_sizes(2, 0) == (1, 1)
    assert split_sizes(8, 0) == (4, 4)
    assert split_sizes(8, 6) == (2, 6)
    with pytest.raises(SplitError, match="at least 2 ranks"):
        split_sizes(1, 0)
    with pytest.raises(SplitError, match="at least one training rank"):
        split_sizes(4, 4)
    with pytest.raises(SplitError, match="multiple of the 3 training ranks"):
        split_sizes(8, 5)


def _cfg(*overrides):
    return load_config(None, list(overrides))


def test_evaluation_points_are_the_colocated_ones():
    cfg = _cfg("optim.total_steps=10", "eval.every=4", "eval.questions=8")
    assert eval_points(cfg, 0) == [0, 4, 8, 10]
    assert eval_points(cfg, 4) == [8, 10]  # resumed at 4: no second score of version 4
    assert eval_points(cfg, 10) == []
    assert eval_points(_cfg("optim.total_steps=10", "eval.every=0", "eval.questions=8"), 0) == [0, 10]
    assert eval_points(_cfg("optim.total_steps=10", "eval.questions=0"), 0) == []


def test_staleness_and_partial_rollouts_need_the_split_placement():
    with pytest.raises(ConfigError, match="rollout.max_staleness=1 needs distributed.placement=split"):
        _cfg("rollout.max_staleness=1")
    with pytest.raises(ConfigError, match="rollout.partial=true needs distributed.placement=split"):
        _cfg("rollout.partial=true")
    with pytest.raises(ConfigError, match="trains with distributed.engine=fsdp2"):
        _cfg("distributed.placement=split", "distributed.engine=deepspeed")
    cfg = _cfg("distributed.placement=split", "rollout.max_staleness=2", "rollout.partial=true")
    assert cfg.rollout.max_staleness == 2


def _collected(groups: list, turns: list, offset: float) -> Collected:
    batch = from_turns([[Turn([1] * n, "answer" if j == len(t) - 1 else "search", [2] if j < len(t) - 1 else ())
                         for j, n in enumerate(t)] for t in turns], group_id=groups)
    S = batch.num_turns
    labels = (torch.arange(S, dtype=torch.float64) + offset, "gold")
    return Collected([[7]] * len(turns), batch, torch.tensor([offset] * len(turns)),
                     {"critic_label_S": torch.full((S,), offset), "prm_f0_B": None}, labels,
                     {"reward": offset, "only_here": offset} if offset else {"reward": offset}, 10.0)


def test_the_batches_of_two_rollout_ranks_merge_in_rank_order():
    a, b = _collected([0, 0], [[2], [1, 3]], 0.0), _collected([5], [[4, 1]], 1.0)
    got = merge_collected([{"collected": a}, {"collected": b}])
    assert got.batch.num_trajectories == 3 and got.batch.group_id_B.tolist() == [0, 0, 5]
    assert got.reward_B.tolist() == [0.0, 0.0, 1.0]
    assert got.extras["critic_label_S"].tolist() == [0.0] * 3 + [1.0] * 2
    assert got.extras["prm_f0_B"] is None
    assert got.labels[0].tolist() == [0, 1, 2, 1, 2] and got.labels[1] == "gold"
    assert got.metrics == {"reward": 0.5, "only_here": 1.0}  # a metric only one rank has: its own value
    assert got.tokens == 20.0 and len(got.prompt_ids) == 3 and got.golds is None
    assert merge_collected([{"collected": a}]) is a
    # the gold answers an estimator asked for (IG-Search) follow their trajectories
    a.golds, b.golds = [["x"], ["y", "z"]], [["w"]]
    assert merge_collected([{"collected": a}, {"collected": b}]).golds == [["x"], ["y", "z"], ["w"]]


def _inbox() -> WeightInbox:
    return WeightInbox(0, None, torch.device("cpu"), count=0)  # no stream to receive: versions put by hand


def _put(inbox, version):
    with inbox._cv:
        inbox._pending.append((version, [("w", torch.full((2,), float(version)))]))
        inbox._cv.notify_all()


def test_the_inbox_hands_over_the_newest_version_up_to_the_hold():
    inbox = _inbox()
    assert inbox.take() is None
    for v in (3, 4, 5):
        _put(inbox, v)
    version, named = inbox.take(upto=4)  # an evaluation of version 4 holds 5 back
    assert version == 4 and named[0][1].tolist() == [4.0, 4.0]
    assert inbox.take(upto=4) is None  # 3 was dropped with 4's hand-over
    assert inbox.take()[0] == 5


def test_the_inbox_waits_for_the_staleness_bound():
    inbox = _inbox()
    _put(inbox, 1)
    threading.Timer(0.3, _put, args=(inbox, 2)).start()
    t0 = time.perf_counter()
    assert inbox.take(at_least=2)[0] == 2  # version 1 is too old: wait for 2
    assert time.perf_counter() - t0 >= 0.25 and inbox.waited_s >= 0.25


def test_the_mirror_gives_the_newest_weights_in_the_engines_dtype():
    mirror = WeightMirror()
    with pytest.raises(RuntimeError, match="no policy weights have arrived"):
        list(mirror.full_state())
    mirror.set(3, [("w", torch.ones(2))])
    (name, t), = mirror.full_state(torch.bfloat16)
    assert mirror.version == 3 and name == "w" and t.dtype == torch.bfloat16


def test_waiting_for_a_version_takes_nothing():
    inbox = _inbox()
    _put(inbox, 1)
    threading.Timer(0.2, _put, args=(inbox, 2)).start()
    inbox.wait_for(2)
    assert inbox.newest() == 2 and inbox.newest(upto=1) == 1
    assert inbox.take(upto=1)[0] == 1 and inbox.take()[0] == 2
