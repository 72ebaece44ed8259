"""The order in which training prompts are drawn: epoch-wise shuffles, the same on every rank, resumable."""
from __future__ import annotations

import torch


class PromptSampler:
    """Epoch-wise shuffled prompts, the same order on every rank; each rank takes its slice of a step's prompts."""

    def __init__(self, n: int, seed: int, epoch: int = 0, cursor: int = 0):
        self.n, self.seed, self.epoch, self.cursor = n, seed, epoch, cursor
        self._order = self._perm()

    def _perm(self) -> list[int]:
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.cursor >= self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._perm()
            out.append(self._order[self.cursor])
            self.cursor += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def reseed(self, seed: int) -> None:
        """A new order for the rest of this epoch and the epochs after it (the cursor stays)."""
        self.seed = seed
        self._order = self._perm()
