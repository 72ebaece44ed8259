"""The PRM's input: a question and its turns as one token row with a placeholder after each segment.

    enc = PRMEncoder(tokenizer, "<|vision_start|>", max_tokens=4096)
    seq = enc.encode(question, turn_texts)                        # ids with a placeholder after the question
    x, spans = pack([seq, ...], device)                           # one padding-free row; x.pred_N = placeholders

The PRM reads ``question ⟨P⟩ turn_1 ⟨P⟩ … turn_T ⟨P⟩`` where ``⟨P⟩`` is the placeholder
token (PiCA uses Qwen's ``<|vision_start|>``) and ``turn_t`` is the turn's action followed by
its observation. The head read at the k-th placeholder is ``f(k)``: ``f(0)`` from the
question alone, ``f(t)`` after turn ``t``. The placeholder is inserted as a token id, never
as text: a turn whose text spells the placeholder is tokenized with that string split
into ordinary tokens, so a trajectory cannot add or move a placeholder. A segment longer
than the budget keeps its head: every segment is cut to the same cap, the largest that
fits ``max_tokens`` (turns are usually short next to their observations).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from fastcredit.models.packed import ModelInputs, micro_batches
from fastcredit.models.varlen import packed_positions


@dataclass
class PRMSequence:
    """One trajectory's PRM input: token ids and the index of each placeholder in them (``1 + turns``)."""

    ids: list
    placeholders: list


class PRMEncoder:
    """Builds PRM inputs with a tokenizer and its placeholder token (see the module docstring)."""

    def __init__(self, tokenizer, placeholder: str, max_tokens: int = 4096):
        self.tokenizer, self.placeholder, self.max_tokens = tokenizer, placeholder, max_tokens
        pid = require_placeholder(tokenizer, placeholder)
        if pid is None:
            raise ValueError(f"the PRM tokenizer has no single token {placeholder!r} (prm.placeholder); "
                             "fastcredit.models.prm.add_placeholder adds it")
        self.placeholder_id = pid
        self.spelled = list(tokenizer(placeholder, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        self.forged = 0  # segments whose text spelled the placeholder (counted, and split into plain tokens)

    def _segments(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        out = [list(x) for x in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        for i, ids in enumerate(out):
            if self.placeholder_id in ids:
                self.forged += 1
                parts = texts[i].split(self.placeholder)
                enc = self.tokenizer(parts, add_special_tokens=False)["input_ids"]
                out[i] = [t for k, p in enumerate(enc) for t in (self.spelled if k else []) + list(p)]
        return out

    def encode_many(self, items: Sequence[tuple[str, Sequence[str]]]) -> list[PRMSequence]:
        """``[(question, [turn text])]`` → one :class:`PRMSequence` each (one tokenizer call for all segments)."""
        flat = [t for q, turns in items for t in (q, *turns)]
        segs = self._segments(flat)
        out, i = [], 0
        for q, turns in items:
            n = 1 + len(turns)
            out.append(self._join(segs[i:i + n]))
            i += n
        return out

    def encode(self, question: str, turns: Sequence[str]) -> PRMSequence:
        return self.encode_many([(question, turns)])[0]

    def _join(self, segs: list[list[int]]) -> PRMSequence:
        n = len(segs)
        if n > self.max_tokens:
            raise ValueError(f"a trajectory of {n - 1} turns needs {n} placeholders, more than prm.max_tokens="
                             f"{self.max_tokens}")
        cap = max(map(len, segs))
        if sum(map(len, segs)) + n > self.max_tokens:  # the largest common cap that fits
            lo, hi = 0, cap
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if sum(min(len(s), mid) for s in segs) + n <= self.max_tokens else (lo, mid - 1)
            cap = lo
        ids, where = [], []
        for s in segs:
            ids += s[:cap]
            where.append(len(ids))
            ids.append(self.placeholder_id)
        return PRMSequence(ids, where)


def pack(seqs: Sequence[PRMSequence], device="cpu"):
    """``(ModelInputs, cu_placeholders)``: the sequences back to back in one padding-free row, ``pred_N`` the
    flat index of every placeholder (sequence by sequence), ``cu_placeholders[b]:cu_placeholders[b+1]`` the
    slice of ``pred_N`` that is sequence ``b``'s."""
    lens = [len(s.ids) for s in seqs]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    ids = torch.tensor([t for s in seqs for t in s.ids], dtype=torch.int64)
    pred = torch.tensor([starts[b] + p for b, s in enumerate(seqs) for p in s.placeholders], dtype=torch.int64)
    cu_p = [0]
    for s in seqs:
        cu_p.append(cu_p[-1] + len(s.placeholders))
    x = ModelInputs(ids[None].to(device), packed_positions(lens)[None].to(device),
                    torch.tensor(starts, dtype=torch.int32), max(lens) if lens else 0, pred.to(device),
                    torch.zeros_like(pred).to(device))
    return x, torch.tensor(cu_p, dtype=torch.int64)


def token_budget_groups(seqs: Sequence[PRMSequence], max_tokens: int) -> list[list[int]]:
    """Consecutive groups of sequence indices with at most ``max_tokens`` tokens each (one alone may exceed it)."""
    return micro_batches(torch.tensor([len(s.ids) for s in seqs]), max_tokens)


def require_placeholder(tokenizer, placeholder: str) -> Optional[int]:
    """The placeholder's id when the tokenizer holds it as one token, else None."""
    pid = tokenizer.convert_tokens_to_ids(placeholder)
    ok = pid is not None and pid != tokenizer.unk_token_id and \
        tokenizer.encode(placeholder, add_special_tokens=False) == [pid]
    return int(pid) if ok else None
