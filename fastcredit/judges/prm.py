"""The frozen PRM in the trainer's judge phase: every trajectory of a step scored in packed micro-batches.

    scorer = PRMScorer.load("runs/prm/export", device, micro_batch_tokens=16384)
    f0_B, f_S, hazard_S = scorer.score(examples, episodes)   # CreditInputs' prm_f0_B / prm_f_S / prm_hazard_S

Weights live in pinned host memory between judge phases: the phase manager
(``fastcredit.distributed.colocate.PhaseManager``) calls :meth:`wake_up` before the judge
phase (weights copied to the device) and :meth:`sleep` after it (the device copies
dropped), as it does for a critic with an engine of its own. On the CPU both are no-ops.
``f`` per turn is the head at the turn's placeholder (``fastcredit.models.prm_inputs``), ``f0`` at the
question's; the hazard form ``h_t = 1 − f(t)/f(t−1)`` (clamped to [0, 1]) feeds
``pica.step_reward=linear``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from fastcredit.models.prm_inputs import PRMEncoder, pack, token_budget_groups
from fastcredit.models.prm import PRMModel, hazards, load_prm


class PRMScorer:
    """A PRM folder scoring trajectories (see the module docstring)."""

    def __init__(self, model: PRMModel, tokenizer, meta: dict, device: torch.device, micro_batch_tokens: int = 16384):
        self.model, self.tokenizer, self.meta, self.device = model, tokenizer, meta, torch.device(device)
        self.encoder = PRMEncoder(tokenizer, meta["placeholder"], int(meta["max_tokens"]))
        self.micro_batch_tokens = micro_batch_tokens
        self._host: Optional[dict] = None
        self.awake = True
        if self.device.type == "cuda":  # pinned host copies: each wake is one async copy per tensor
            self._host = {n: p.detach().to("cpu").pin_memory() for n, p in self.model.named_parameters()}

    @classmethod
    def load(cls, folder: str, device, micro_batch_tokens: int = 16384) -> "PRMScorer":
        device = torch.device(device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model, tok, meta = load_prm(folder, device, dtype)
        return cls(model, tok, meta, device, micro_batch_tokens)

    # The phase manager's engine protocol.
    def wake_up(self, tags=None) -> None:
        if self._host is not None and not self.awake:
            for n, p in self.model.named_parameters():
                p.data = self._host[n].to(self.device, non_blocking=True)
        self.awake = True

    def sleep(self, level: int = 1) -> None:
        if self._host is not None and self.awake:
            for n, p in self.model.named_parameters():
                p.data = self._host[n]
            torch.cuda.empty_cache()
        self.awake = False

    @torch.no_grad()
    def score_texts(self, items: Sequence[tuple[str, Sequence[str]]]) -> list[torch.Tensor]:
        """``[(question, [turn text])]`` → per item the float32 ``f`` at its ``1 + turns`` placeholders (CPU)."""
        self.wake_up()
        seqs = self.encoder.encode_many(items)
        out: list = [None] * len(seqs)
        for group in token_budget_groups(seqs, self.micro_batch_tokens):
            x, cu = pack([seqs[i] for i in group], self.device)
            f = torch.sigmoid(self.model(x)).float().cpu()
            for j, i in enumerate(group):
                out[i] = f[int(cu[j]):int(cu[j + 1])]
        return out

    def score(self, examples, episodes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(f0_B, f_S, hazard_S)`` of rolled-out episodes (turns in the batch's order)."""
        items = [(ex.question, [s.action_text + s.obs_text for s in e.steps]) for ex, e in zip(examples, episodes)]
        return scores_to_inputs(self.score_texts(items))


def scores_to_inputs(per_traj: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-trajectory ``f`` at ``1 + turns`` placeholders → ``(f0_B, f_S, hazard_S)``."""
    f0 = torch.stack([f[0] for f in per_traj]) if per_traj else torch.zeros(0)
    f_S = torch.cat([f[1:] for f in per_traj]) if per_traj else torch.zeros(0)
    traj_S = torch.repeat_interleave(torch.arange(len(per_traj)), torch.tensor([len(f) - 1 for f in per_traj]))
    t_S = torch.cat([torch.arange(1, len(f)) for f in per_traj]) if per_traj else torch.zeros(0, dtype=torch.long)
    return f0.float(), f_S.float(), hazards(f0.float(), f_S.float(), traj_S, t_S)
