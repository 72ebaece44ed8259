"""The one registry of benchmark shapes: the real ones first.

Qwen2.5-3B and -7B hidden sizes (2,048 and 3,584), their vocabulary (151,936 rows in the
LM head), and 4K-token trajectories of a few turns, as the papers' settings use.
"""
from __future__ import annotations

from dataclasses import dataclass

MODES = ("fwd", "bwd", "fwd+bwd")
QWEN_VOCAB = 151_936
QWEN_HIDDEN = {"qwen2.5-3b": 2048, "qwen2.5-7b": 3584}


@dataclass(frozen=True)
class LossShape:
    """A packed batch for the policy loss: ``tokens`` in trajectories of ``context`` tokens and ``turns`` turns."""

    name: str
    tokens: int
    context: int = 4096
    turns: int = 4

    @property
    def trajectories(self) -> int:
        return self.tokens // self.context


@dataclass(frozen=True)
class LogprobShape:
    """Hidden states [tokens, hidden] times an LM head [vocab, hidden]."""

    name: str
    model: str
    tokens: int
    hidden: int
    vocab: int = QWEN_VOCAB
    context: int = 4096  # sequence length of the [B, L] layouts that peers such as liger-kernel need


LOSS_SHAPES = [LossShape("N64k", 1 << 16), LossShape("N1M", 1 << 20), LossShape("N8M", 1 << 23)]

LOGPROB_SHAPES = [
    LogprobShape(f"{model}-N{tokens // 1024}k", model, tokens, hidden)
    for model, hidden in QWEN_HIDDEN.items()
    for tokens in (8192, 32768)
]
