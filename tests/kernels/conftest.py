"""Shared by every kernel test: outputs are poisoned so that an unwritten element fails."""
import pytest
import torch


@pytest.fixture(autouse=True)
def poison_allocations(monkeypatch):
    """Floating torch.empty / empty_like come back NaN-filled, so an unwritten output element fails."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))
