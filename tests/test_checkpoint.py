"""Atomic checkpoints: round trip of model, optimizer, RNG and trainer state; pruning; a half-written step is ignored."""
import os
import random

import pytest
import torch

from fastcredit.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint


def _model_and_opt(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    return m, opt


def test_round_trip_restores_everything(tmp_path):
    m, opt = _model_and_opt(0)
    random.seed(5)
    save_checkpoint(str(tmp_path), 7, {"policy": m}, {"policy": opt}, {"data": {"epoch": 1, "cursor": 3}})
    expected = (random.random(), torch.rand(2))
    m2 = _model_and_opt(1)[0]  # stale gradients, and an optimizer that never stepped
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.1)
    state = load_checkpoint(latest_checkpoint(str(tmp_path)), {"policy": m2}, {"policy": opt2})
    assert state == {"step": 7, "data": {"epoch": 1, "cursor": 3}}
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    for s1, s2 in zip(opt.state.values(), opt2.state.values()):
        assert torch.equal(s1["exp_avg"], s2["exp_avg"]) and torch.equal(s1["exp_avg_sq"], s2["exp_avg_sq"])
    assert random.random() == expected[0] and torch.equal(torch.rand(2), expected[1])


def test_keeps_the_newest_and_ignores_unfinished(tmp_path):
    m, opt = _model_and_opt(0)
    for step in (1, 2, 3):
        save_checkpoint(str(tmp_path), step, {"policy": m}, {"policy": opt}, {}, keep=2)
    os.makedirs(tmp_path / "step_000004.tmp")  # a crash mid-write
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000002", "step_000003", "step_000004.tmp"]
    assert latest_checkpoint(str(tmp_path)).endswith("step_000003")


def test_missing_checkpoint_is_named(tmp_path):
    assert latest_checkpoint(str(tmp_path)) is None
    (tmp_path / "latest").write_text("step_000009\n")
    with pytest.raises(FileNotFoundError, match="step_000009"):
        latest_checkpoint(str(tmp_path))


class _SelfSavingEngine:
    """An engine that writes its own state (as DeepSpeed does), here one tensor per folder."""

    def __init__(self, value):
        self.w = torch.tensor([value])

    def save_state(self, folder):
        os.makedirs(folder)
        torch.save(self.w, os.path.join(folder, "w.pt"))

    def load_state(self, folder):
        self.w = torch.load(os.path.join(folder, "w.pt"))


def test_engines_that_save_themselves_get_their_own_folders(tmp_path):
    engines = {"policy": _SelfSavingEngine(1.0), "value": _SelfSavingEngine(2.0)}
    path = save_checkpoint(str(tmp_path), 3, {}, {}, {"opt_steps": 6}, engines=engines)
    assert latest_checkpoint(str(tmp_path)) == path and path.endswith("step_000003")
    assert sorted(os.listdir(path)) == ["engine", "rng_rank0.pt", "trainer.json"]  # no DCP folder without DCP models
    fresh = {"policy": _SelfSavingEngine(0.0), "value": _SelfSavingEngine(0.0)}
    assert load_checkpoint(path, {}, {}, engines=fresh) == {"step": 3, "opt_steps": 6}
    assert [float(e.w) for e in fresh.values()] == [1.0, 2.0]
    m, opt = _model_and_opt(0)
    with pytest.raises(FileNotFoundError, match="no model/ .*another distributed.engine"):
        load_checkpoint(path, {"policy": m}, {"policy": opt})
    with pytest.raises(FileNotFoundError, match="no engine/critic"):
        load_checkpoint(path, {}, {}, engines={"critic": _SelfSavingEngine(0.0)})
