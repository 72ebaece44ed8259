"""DAPO's dynamic-sampling filter: which groups to drop and how many prompts to refill."""
import torch

from fastcredit.config.credit import DynamicSamplingConfig
from fastcredit.credit.dapo import dynamic_sampling_step, keep_mask, take_groups

ON = DynamicSamplingConfig(enabled=True, max_refill_rounds=3)


def test_keep_mask_drops_groups_with_equal_rewards():
    # Groups: 4 → (1, 1) all equal; 2 → (0, 1) kept; 9 → (0.2, 0.2) all equal; 7 → one sample, dropped.
    reward = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.2, 0.2, 0.5])
    group = torch.tensor([4, 4, 2, 2, 9, 9, 7])
    assert keep_mask(reward, group).tolist() == [False, False, True, True, False, False, False]


def test_step_refills_by_the_survival_rate():
    # 8 groups of 2, 3 survive; target 8 → 5 missing; survival 3/8 → ceil(5 · 8 / 3) = 14, capped at one batch (8).
    reward = torch.tensor([0.0, 1.0] * 3 + [1.0, 1.0] * 5)
    group = torch.arange(16) // 2
    d = dynamic_sampling_step(reward, group, ON, target_groups=8)
    assert (d.kept_groups, d.dropped_groups, d.refill_prompts, d.done) == (3, 5, 8, False)
    assert d.keep_B.tolist() == [True] * 6 + [False] * 10
    assert d.metrics == {"dropped_group_frac": 5 / 8, "refill_prompts": 8.0}
    # Second round: 6 prompts seen, 4 kept; with 3 before: 7 of 8 kept, 1 missing;
    # survival (3 + 4) / (8 + 6) = 0.5 → ceil(1 / 0.5) = 2 prompts.
    reward2 = torch.tensor([0.0, 1.0] * 4 + [0.0, 0.0] * 2)
    d2 = dynamic_sampling_step(reward2, torch.arange(12) // 2, ON, target_groups=8, kept_before=3, seen_before=8,
                               refill_round=1)
    assert (d2.kept_groups, d2.refill_prompts, d2.done) == (4, 2, False)


def test_step_stops_when_full_or_out_of_rounds():
    reward = torch.tensor([0.0, 1.0, 1.0, 1.0])
    group = torch.tensor([0, 0, 1, 1])
    assert dynamic_sampling_step(reward, group, ON, target_groups=1).done
    late = dynamic_sampling_step(reward, group, ON, target_groups=5, refill_round=3)
    assert late.done and late.refill_prompts == 0 and late.keep_B.tolist() == [True, True, False, False]
    # Nothing survived yet: ask for a full batch.
    none = dynamic_sampling_step(torch.ones(4), group, ON, target_groups=2)
    assert none.refill_prompts == 2 and not none.done


def test_disabled_keeps_everything():
    d = dynamic_sampling_step(torch.ones(4), torch.tensor([0, 0, 1, 1]), DynamicSamplingConfig(enabled=False),
                              target_groups=2)
    assert d.keep_B.all() and d.done and d.refill_prompts == 0 and d.kept_groups == 2


def test_take_groups_keeps_the_first_groups_in_arrival_order():
    group = torch.tensor([5, 5, 3, 3, 8, 8, 1, 1])
    keep = torch.tensor([True, True, False, False, True, True, True, True])
    # Kept groups in arrival order: 5, 8, 1 → the first two are 5 and 8.
    assert take_groups(keep, group, 2).tolist() == [True, True, False, False, True, True, False, False]
    assert take_groups(keep, group, 10).tolist() == keep.tolist()
