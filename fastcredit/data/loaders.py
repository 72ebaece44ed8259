"""QA and corpus loaders: Search-R1 parquet, FlashRAG jsonl and the toy world, into one record.

Every error names the file, the line (jsonl) or row (parquet), and the field.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence


class DataError(ValueError):
    """A data file is missing, unreadable, or lacks a field; the message says where."""


@dataclass
class QAExample:
    id: str
    question: str
    golden_answers: list
    data_source: str = ""
    metadata: dict = field(default_factory=dict)


def _answers(value, where: str) -> list:
    """Gold answers as a list of str; pyarrow / numpy arrays and a bare string accepted."""
    if isinstance(value, str):
        return [value]
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(a, str) for a in value):
        raise DataError(f"{where}: field 'golden_answers' must be a non-empty list of strings, got {value!r:.80}")
    return list(value)


def _example(row: dict, where: str, default_source: str = "") -> QAExample:
    for name in ("question",):
        if name not in row or row[name] is None:
            raise DataError(f"{where}: missing field '{name}'")
    if not isinstance(row["question"], str) or not row["question"].strip():
        raise DataError(f"{where}: field 'question' must be a non-empty string")
    answers = row.get("golden_answers")
    if answers is None:
        target = ((row.get("reward_model") or {}).get("ground_truth") or {}).get("target")
        if target is None:
            raise DataError(f"{where}: missing field 'golden_answers' (or reward_model.ground_truth.target)")
        answers = target
    metadata = row.get("metadata") or {}
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError:
            raise DataError(f"{where}: field 'metadata' is not valid JSON") from None
    if not isinstance(metadata, dict):
        raise DataError(f"{where}: field 'metadata' must be a mapping")
    rid = row.get("id")
    return QAExample(
        id=str(rid) if rid is not None else where,
        question=row["question"],
        golden_answers=_answers(answers, where),
        data_source=str(row.get("data_source") or default_source),
        metadata=metadata,
    )


def _open_text(path: str):
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    try:
        return open(path, encoding="utf-8")
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from None


def _jsonl_rows(path: str) -> Iterator[tuple[int, dict]]:
    with _open_text(path) as fh:
        try:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path} line {lineno}: invalid JSON ({exc.msg})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path} line {lineno}: expected a JSON object")
                yield lineno, row
        except UnicodeDecodeError:
            raise DataError(f"{path}: not UTF-8 text") from None


def load_flashrag_jsonl(path: str) -> list[QAExample]:
    """FlashRAG-style jsonl: ``id``, ``question``, ``golden_answers``, optional ``metadata``."""
    return [_example(row, f"{path} line {n}") for n, row in _jsonl_rows(path)]


def load_searchr1_parquet(path: str) -> list[QAExample]:
    """Search-R1's QA parquet (``nq_hotpotqa_train`` layout)."""
    import pyarrow.parquet as pq

    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several unrelated types for corrupt files
        raise DataError(f"{path}: cannot read as parquet ({exc})") from None
    return [_example(row, f"{path} row {i}") for i, row in enumerate(rows)]


def load_toyworld(world_dir: str, split: str = "train") -> list[QAExample]:
    if split not in ("train", "test"):
        raise DataError(f"unknown toy-world split {split!r}; valid: train, test")
    return load_flashrag_jsonl(os.path.join(world_dir, f"{split}.jsonl"))


def load_qa(path: str, fmt: str = "auto") -> list[QAExample]:
    """Load a QA file by format (``parquet``, ``jsonl``) or by its extension."""
    if fmt == "auto":
        fmt = "parquet" if path.endswith(".parquet") else "jsonl" if path.endswith((".jsonl", ".json")) else ""
    if fmt == "parquet":
        return load_searchr1_parquet(path)
    if fmt == "jsonl":
        return load_flashrag_jsonl(path)
    raise DataError(f"{path}: cannot tell the format from the extension; use .parquet or .jsonl")


def iter_corpus(path: str) -> Iterator[tuple[str, str, str]]:
    """Stream ``(id, title, text)`` from a Search-R1 corpus jsonl (``contents`` = ``"Title"\\ntext``)."""
    for lineno, row in _jsonl_rows(path):
        where = f"{path} line {lineno}"
        if "contents" not in row or not isinstance(row["contents"], str):
            raise DataError(f"{where}: missing field 'contents'")
        if "id" not in row:
            raise DataError(f"{where}: missing field 'id'")
        title, sep, text = row["contents"].partition("\n")
        if not sep:
            title, text = "", title
        yield str(row["id"]), title.strip().strip('"'), text


def write_searchr1_parquet(examples: Sequence[QAExample], path: str, split: str, prompt_fn=None) -> None:
    """Write examples in Search-R1's parquet layout (prompt, reward_model, extra_info, ...)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fastcredit.data.prompts import build_prompt

    prompt_fn = prompt_fn or build_prompt
    rows = [{
        "id": ex.id,
        "question": ex.question,
        "golden_answers": list(ex.golden_answers),
        "data_source": ex.data_source,
        "prompt": [{"role": "user", "content": prompt_fn(ex.question)}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": list(ex.golden_answers)}},
        "extra_info": {"split": split, "index": i},
        "metadata": json.dumps(ex.metadata, sort_keys=True),
    } for i, ex in enumerate(examples)]
    tmp = path + ".tmp"
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)


def load_split(source: str, path: Optional[str], world_dir: str, split: str) -> list[QAExample]:
    """The loader the trainer uses: by ``data.source``."""
    if source == "toy":
        return load_toyworld(world_dir, split)
    if path is None:
        raise DataError(f"data.{split}_path is required for data.source={source}")
    return load_qa(path, "parquet" if source == "searchr1" else "jsonl")
