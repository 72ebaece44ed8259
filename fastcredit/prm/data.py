"""PiCA's PRM data: labelled trajectories on disk (the PRM's packed input is ``fastcredit.models.prm_inputs``).

    rows = read_labelled("runs/prm_data/train.parquet")          # [LabelledTrajectory]

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
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from fastcredit.data.loaders import DataError
from fastcredit.runtime.files import atomic_output

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
    steps = [{"action": t["action"], "observation": t.get("observation") or ""} for t in turns]
    return LabelledTrajectory(str(raw["question"]), steps, int(raw["outcome"]), pivots,
                              str(raw.get("data_source") or ""), [str(a) for a in raw.get("golden_answers") or []],
                              str(raw.get("prediction") or ""), int(raw.get("sample") or 0),
                              str(raw.get("labeller") or ""))


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
