"""``fastcredit.trainer.schedule``: warm-up then constant / cosine / linear decay, counted in optimizer steps."""
import math
import types

import pytest

from fastcredit.config import OptimConfig
from fastcredit.trainer.schedule import LRSchedule, lr_factor, total_opt_steps


def test_warm_up_is_linear_and_reaches_the_base_rate():
    assert [lr_factor(s, 100, 0.1, "constant") for s in (0, 4, 9, 10, 99)] == [0.1, 0.5, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("schedule, halfway, end", [("constant", 1.0, 1.0),
                                                     ("cosine", 0.5, 0.5 * (1 + math.cos(math.pi * 0.99))),
                                                     ("linear", 0.5, 0.01)])
def test_decay_after_the_warm_up(schedule, halfway, end):
    assert lr_factor(50, 100, 0.0, schedule) == pytest.approx(halfway)
    assert lr_factor(99, 100, 0.0, schedule) == pytest.approx(end)
    assert lr_factor(150, 100, 0.0, schedule) >= 0.0  # past the end: never negative


def test_total_counts_epochs_and_mini_batches():
    o = OptimConfig(total_steps=10, ppo_epochs=3, batch_prompts=8, mini_batch_prompts=2)
    assert total_opt_steps(o) == 10 * 3 * 4
    assert total_opt_steps(OptimConfig(total_steps=10, batch_prompts=2, mini_batch_prompts=8)) == 10  # at least one


def test_the_schedule_counts_steps_and_sets_both_rates():
    o = OptimConfig(lr=1.0, critic_lr=2.0, total_steps=10, batch_prompts=4, mini_batch_prompts=4, warmup_ratio=0.5,
                    critic_warmup_ratio=0.2)
    lrs = {"policy": [], "value": []}
    policy, value = (types.SimpleNamespace(set_lr=lrs[k].append) for k in ("policy", "value"))
    schedule = LRSchedule(o, opt_steps=1)  # resumed after one optimizer step
    schedule.before_step(policy, value)
    schedule.before_step(policy)  # no value model
    assert schedule.opt_steps == 3
    assert lrs["policy"] == [pytest.approx(0.4), pytest.approx(0.6)]  # warm-up over 5 of 10 steps
    assert lrs["value"] == [pytest.approx(2.0)]  # its own warm-up (2 steps) is over
