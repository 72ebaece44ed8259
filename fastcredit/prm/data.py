"""PiCA's PRM data: labelled trajectories on disk, and the PRM's packed input with its placeholders.

    rows = read_labelled("runs/prm_data/train.parquet")          # [LabelledTrajectory]
    enc = PRMEncoder(tokenizer, "<|vision_start|>", max_tokens=4096)
    seq = enc.encode(row.question, row.turn_texts())              # ids with a placeholder after the question
    x, spans = pack([seq, ...], device)                           # one padding-free row; x.pred_N = placeholders

A labelled trajectory (one parquet row) is what PiCA's Eq. 8–10 train on:

    question        str
    data_source     str
    golden_answers  list[str]
    turns           list[{"action": str, "observation": str}]   the policy's turns, observations as it read them
    outcome         int 0/1     the final answer's exact match (the outcome label l)
    pivots          list[int]   one 0/1 per turn: the turn yields a gold sub-answer with its sub-query
    prediction      str         the extracted answer ('' when none)
    sample          int         which of a question's samples
    labeller        str         who labelled the pivots ('rule' on the toy world, or the judge's name)

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

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from fastcredit.data.loaders import DataError, atomic_output

COLUMNS = ("question", "data_source", "golden_answers", "turns", "outcome", "pivots", "prediction", "sample",
           "labeller")


@dataclass
class LabelledTrajectory:
    """One row of a PRM dataset (see the module docstring)."""

    question: str
    turns: list  # [{"action": str, "observation": str}]
    outcome: int
    pivots: list  # [0/1] per turn
    data_source: str = ""
    golden_answers: list = field(default_factory=list)
    prediction: str = ""
    sample: int = 0
    labeller: str = ""

    def turn_texts(self) -> list[str]:
        return [t["action"] + t.get("observation", "") for t in self.turns]

    def to_row(self) -> dict:
        return {"question": self.question, "data_source": self.data_source, "golden_answers": list(self.golden_answers),
                "turns": [{"action": t["action"], "observation": t.get("observation", "")} for t in self.turns],
                "outcome": int(self.outcome), "pivots": [int(p) for p in self.pivots], "prediction": self.prediction,
                "sample": int(self.sample), "labeller": self.labeller}


def _schema():
    import pyarrow as pa

    turn = pa.struct([("action", pa.string()), ("observation", pa.string())])
    return pa.schema([("question", pa.string()), ("data_source", pa.string()),
                      ("golden_answers", pa.list_(pa.string())), ("turns", pa.list_(turn)), ("outcome", pa.int8()),
                      ("pivots", pa.list_(pa.int8())), ("prediction", pa.string()), ("sample", pa.int32()),
                      ("labeller", pa.string())])


def write_labelled(rows: Sequence[LabelledTrajectory], path: str) -> str:
    """Write ``rows`` as parquet (atomically: a crash leaves the old file or none)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([r.to_row() for r in rows], schema=_schema())
    with atomic_output(path) as tmp:
        pq.write_table(table, tmp)
    return path


def _row(raw: dict, where: str) -> LabelledTrajectory:
    missing = [c for c in ("question", "turns", "outcome", "pivots") if raw.get(c) is None]
    if missing:
        raise DataError(f"{where}: missing field {missing[0]!r} (a PRM row needs question, turns, outcome, pivots)")
    turns = list(raw["turns"])
    for j, t in enumerate(turns):
        if not isinstance(t, dict) or not isinstance(t.get("action"), str):
            raise DataError(f"{where}: field 'turns'[{j}] must be {{'action': str, 'observation': str}}, got {t!r:.80}")
    pivots = [int(p) for p in raw["pivots"]]
    if len(pivots) != len(turns):
        raise DataError(f"{where}: field 'pivots' has {len(pivots)} labels for {len(turns)} turns")
    if any(p not in (0, 1) for p in pivots) or int(raw["outcome"]) not in (0, 1):
        raise DataError(f"{where}: fields 'outcome' and 'pivots' must be 0 or 1")
    if not turns:
        raise DataError(f"{where}: field 'turns' is empty (a trajectory has at least one turn)")
    return LabelledTrajectory(str(raw["question"]), [{"action": t["action"], "observation": t.get("observation") or ""}
                                                     for t in turns], int(raw["outcome"]), pivots,
                              str(raw.get("data_source") or ""), [str(a) for a in raw.get("golden_answers") or []],
                              str(raw.get("prediction") or ""), int(raw.get("sample") or 0), str(raw.get("labeller") or ""))


def read_labelled(path: str) -> list[LabelledTrajectory]:
    """The rows of a PRM dataset; every problem is a DataError naming the file, the row and the field."""
    import os

    if not os.path.isfile(path):
        raise DataError(f"PRM dataset {path} does not exist (write one with python -m fastcredit.prm.label)")
    try:
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # noqa: BLE001 -- pyarrow raises several types for a damaged file
        raise DataError(f"{path}: not a readable parquet file ({type(exc).__name__}: {exc})") from exc
    if not rows:
        raise DataError(f"{path}: the PRM dataset has no rows")
    return [_row(r, f"{path} row {i}") for i, r in enumerate(rows)]


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
    from fastcredit.trainer.update import ModelInputs
    from fastcredit.models.varlen import packed_positions

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
    from fastcredit.trainer.update import micro_batches

    return micro_batches(torch.tensor([len(s.ids) for s in seqs]), max_tokens)


def require_placeholder(tokenizer, placeholder: str) -> Optional[int]:
    """The placeholder's id when the tokenizer holds it as one token, else None."""
    pid = tokenizer.convert_tokens_to_ids(placeholder)
    ok = pid is not None and pid != tokenizer.unk_token_id and \
        tokenizer.encode(placeholder, add_special_tokens=False) == [pid]
    return int(pid) if ok else None
