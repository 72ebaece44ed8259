"""QA and corpus loaders: Search-R1 parquet, FlashRAG jsonl and the toy world, into one record.

    examples = load_qa("data/nq_hotpotqa_train/train.parquet")
    examples = load_qa("runs/toyworld", split="test")
    for pid, title, text in iter_corpus("wiki-18.jsonl"): ...

The formats read here:

* Search-R1 QA parquet (the ``nq_hotpotqa_train`` layout written by Search-R1's
  ``scripts/data_process/nq_search.py``): ``id``, ``question``, ``golden_answers``,
  ``data_source``, ``prompt`` (``[{"role", "content"}]``), ``ability``, ``reward_model``
  (``{"style": "rule", "ground_truth": {"target": [...]}}``), ``extra_info``
  (``{"split", "index"}``), sometimes ``metadata``. Only the question and the answers are
  required; the answers may live in ``golden_answers`` or ``reward_model.ground_truth.target``.
* FlashRAG jsonl: one object a line, ``id``, ``question``, ``golden_answers``, optional
  ``metadata`` (and ``data_source`` in the toy world's files).
* Search-R1 corpus jsonl: ``{"id": str, "contents": "\\"Title\\"\\ntext"}``.

Every problem raises :class:`DataError`, whose message names the file, the line (jsonl)
or row (parquet), and the field.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

from fastcredit.runtime.files import atomic_output

FORMATS = ("parquet", "jsonl", "toyworld")
TOY_SPLITS = ("train", "test")
# Rows per pyarrow batch: bounds memory on the 170k-row nq_hotpotqa_train file.
_PARQUET_BATCH = 8192


class DataError(ValueError):
    """A data file is missing, unreadable or malformed; the message says where and which field."""


@dataclass
class QAExample:
    """One question with its gold answers, whatever file it came from."""

    id: str
    question: str
    golden_answers: list[str]
    data_source: str = ""
    metadata: dict = field(default_factory=dict)
    # the file's own chat prompt (data.prompt_source=parquet)
    prompt: Optional[list] = field(default=None, compare=False)

    def to_record(self) -> dict:
        """The FlashRAG-style jsonl record of this example."""
        rec = {"id": self.id, "question": self.question, "golden_answers": list(self.golden_answers),
               "data_source": self.data_source, "metadata": self.metadata}
        return rec if self.prompt is None else {**rec, "prompt": self.prompt}


def _type_name(value: Any) -> str:
    return type(value).__name__


def _id(value: Any, where: str, fallback: str) -> str:
    if value is None:
        return fallback
    # NOTE: bool is an int subclass; an id of True is a bug in the file, not the number 1.
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise DataError(f"{where}: field 'id' must be a string or an integer, got {_type_name(value)}")
    return str(value)


def _as_list(value: Any) -> Any:
    """A parquet / pandas column value as plain Python (numpy arrays of structs become lists of dicts)."""
    return value.tolist() if hasattr(value, "tolist") else value


def _question_from_prompt(prompt: Any) -> Optional[str]:
    """The text after the last 'Question: ' of the last user message (files without a question column)."""
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if not isinstance(prompt, list):
        return None
    users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1], str) or "Question: " not in users[-1]:
        return None
    return users[-1].rsplit("Question: ", 1)[1].strip() or None


def _question(row: dict, where: str) -> str:
    value = row.get("question")
    if value is None:
        value = _question_from_prompt(row.get("prompt"))
    if value is None:
        raise DataError(f"{where}: missing field 'question'")
    if not isinstance(value, str):
        raise DataError(f"{where}: field 'question' must be a string, got {_type_name(value)}")
    if not value.strip():
        raise DataError(f"{where}: field 'question' must be a non-empty string")
    return value


def _answers(row: dict, where: str) -> list[str]:
    name, value = "golden_answers", row.get("golden_answers")
    if value is None:
        name = "reward_model.ground_truth.target"
        value = row.get("reward_model")
        for key in ("ground_truth", "target"):
            value = value.get(key) if isinstance(value, dict) else None
    if value is None:
        raise DataError(f"{where}: missing field 'golden_answers' (or 'reward_model.ground_truth.target')")
    if isinstance(value, str):
        value = [value]
    if hasattr(value, "tolist"):  # numpy arrays, from pandas-made rows
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{where}: field '{name}' must be a non-empty list of strings, got {value!r:.60}")
    out = []
    for a in value:
        # Numbers are a natural answer type ("1998"); anything else is a broken file.
        if isinstance(a, bool) or not isinstance(a, (str, int, float)):
            raise DataError(f"{where}: field '{name}' must hold strings, got {_type_name(a)} {a!r:.40}")
        out.append(str(a))
    return out


def _optional_str(row: dict, name: str, where: str, default: str) -> str:
    value = row.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{name}' must be a string, got {_type_name(value)}")
    return value


def _metadata(row: dict, where: str) -> dict:
    value = row.get("metadata")
    if value is None:
        return {}
    if isinstance(value, str):  # our parquet stores it as JSON text (rows' metadata differ in shape)
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise DataError(f"{where}: field 'metadata' is a string but not valid JSON") from None
    if not isinstance(value, dict):
        raise DataError(f"{where}: field 'metadata' must be a mapping, got {_type_name(value)}")
    return value


def parse_example(row: dict, where: str, index: int, default_source: str = "") -> QAExample:
    """Validate one raw row (jsonl object or parquet row) into a QAExample; ``where`` prefixes errors."""
    return QAExample(
        id=_id(row.get("id"), where, str(index)),
        question=_question(row, where),
        golden_answers=_answers(row, where),
        data_source=_optional_str(row, "data_source", where, default_source),
        metadata=_metadata(row, where),
        prompt=_as_list(row.get("prompt")),
    )


def _open_binary(path: str):
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _jsonl_rows(path: str) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for each non-blank line; decoded line by line so errors know the line."""
    with _open_binary(path) as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{path} line {lineno}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path} line {lineno}: invalid JSON ({exc.msg}, column {exc.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path} line {lineno}: expected a JSON object, got {_type_name(row)}")
            yield lineno, row


def load_flashrag_jsonl(path: str, default_source: Optional[str] = None) -> list[QAExample]:
    """FlashRAG-style jsonl → examples.

    ``data_source`` comes from the record, else ``default_source``, else the name of the
    file's folder (FlashRAG's layout is ``<dataset>/<split>.jsonl``). A missing ``id`` becomes
    the record's 0-based position.
    """
    if default_source is None:
        default_source = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return [parse_example(row, f"{path} line {lineno}", i, default_source)
            for i, (lineno, row) in enumerate(_jsonl_rows(path))]


def _parquet_rows(path: str) -> Iterator[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH):
            yield from batch.to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: cannot read as parquet ({exc})") from None


def load_searchr1_parquet(path: str, default_source: str = "") -> list[QAExample]:
    """Search-R1's QA parquet (``nq_hotpotqa_train`` layout) → examples; a missing ``id`` becomes the row index."""
    return [parse_example(row, f"{path} row {i}", i, default_source) for i, row in enumerate(_parquet_rows(path))]


def load_toyworld(world_dir: str, split: str = "train") -> list[QAExample]:
    """The toy world's ``<split>.jsonl`` (written by ``fastcredit.data.toyworld``)."""
    if split not in TOY_SPLITS:
        raise DataError(f"{world_dir}: unknown toy-world split {split!r}; valid: {', '.join(TOY_SPLITS)}")
    return load_flashrag_jsonl(os.path.join(world_dir, f"{split}.jsonl"), default_source="toyworld")


def _resolve(path: str, fmt: str, split: str) -> tuple[str, str]:
    """(format, file or folder) for ``load_qa``: folders pick ``<split>.parquet`` / ``<split>.jsonl``."""
    if os.path.isdir(path):
        if fmt in ("auto", "toyworld") and os.path.exists(os.path.join(path, "world.json")):
            return "toyworld", path
        candidates = [fmt] if fmt in ("parquet", "jsonl") else ["parquet", "jsonl"]
        for ext in candidates:
            if os.path.exists(os.path.join(path, f"{split}.{ext}")):
                return ext, os.path.join(path, f"{split}.{ext}")
        looked = ", ".join(f"{split}.{ext}" for ext in candidates)
        raise DataError(f"{path}: a folder without world.json or {looked}")
    if fmt != "auto":
        return fmt, path
    for ext in ("parquet", "jsonl"):
        if path.endswith("." + ext):
            return ext, path
    raise DataError(f"{path}: cannot tell the format from the name; use .parquet or .jsonl, or pass fmt")


def load_qa(path: str, fmt: str = "auto", split: str = "train") -> list[QAExample]:
    """Load QA examples from a file or folder.

    ``fmt``: ``auto`` (by extension; a folder with ``world.json`` is a toy world, another
    folder is searched for ``<split>.parquet`` then ``<split>.jsonl``), ``parquet``,
    ``jsonl`` or ``toyworld``.
    """
    if fmt != "auto" and fmt not in FORMATS:
        raise DataError(f"{path}: unknown format {fmt!r}; valid: auto, {', '.join(FORMATS)}")
    fmt, path = _resolve(path, fmt, split)
    if fmt == "toyworld":
        return load_toyworld(path, split)
    if fmt == "parquet":
        return load_searchr1_parquet(path)
    return load_flashrag_jsonl(path)


def load_split(source: str, path: Optional[str], world_dir: str, split: str) -> list[QAExample]:
    """The trainer's loader, by ``data.source`` (``toy``, ``searchr1`` or ``flashrag``)."""
    if source == "toy":
        return load_toyworld(world_dir, split)
    if source not in ("searchr1", "flashrag"):
        raise DataError(f"unknown data.source {source!r}; valid: toy, searchr1, flashrag")
    if path is None:
        raise DataError(f"data.{split}_path is required for data.source={source}")
    return load_qa(path, "parquet" if source == "searchr1" else "jsonl", split)


def _unquote(title: str) -> str:
    # Strip exactly one pair: wiki titles may themselves begin or end with a quote.
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        return title[1:-1]
    return title


def iter_corpus(path: str) -> Iterator[tuple[str, str, str]]:
    """Stream ``(id, title, text)`` from a Search-R1 corpus jsonl.

    ``contents`` is split on its first newline and the title's surrounding quotes are
    dropped; a ``contents`` without a newline gives title ``""`` and all of it as text.
    """
    for lineno, row in _jsonl_rows(path):
        where = f"{path} line {lineno}"
        if row.get("id") is None:
            raise DataError(f"{where}: missing field 'id'")
        pid = _id(row["id"], where, "")
        contents = row.get("contents")
        if contents is None:
            raise DataError(f"{where}: missing field 'contents'")
        if not isinstance(contents, str):
            raise DataError(f"{where}: field 'contents' must be a string, got {_type_name(contents)}")
        title, sep, text = contents.partition("\n")
        yield (pid, _unquote(title), text) if sep else (pid, "", contents)


def _parquet_schema():
    import pyarrow as pa

    text_list = pa.list_(pa.string())
    return pa.schema([
        ("id", pa.string()),
        ("question", pa.string()),
        ("golden_answers", text_list),
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.struct([("target", text_list)]))])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
        ("metadata", pa.string()),
    ])


def write_searchr1_parquet(examples: Sequence[QAExample], path: str,
                           prompt_fn: Optional[Callable[[str], str]] = None, split: str = "train") -> None:
    """Write examples in Search-R1's parquet layout (atomically).

    ``prompt_fn(question) -> str`` makes the user message (default: the Search-R1 prompt).
    ``metadata`` is stored as JSON text, so rows whose metadata differ in shape round-trip exactly.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if prompt_fn is None:
        from fastcredit.data.prompts import build_prompt as prompt_fn
    rows = [{
        "id": ex.id,
        "question": ex.question,
        "golden_answers": list(ex.golden_answers),
        "data_source": ex.data_source,
        "prompt": [{"role": "user", "content": prompt_fn(ex.question)}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": list(ex.golden_answers)}},
        "extra_info": {"split": split, "index": i},
        "metadata": json.dumps(ex.metadata, sort_keys=True, ensure_ascii=False),
    } for i, ex in enumerate(examples)]
    table = pa.Table.from_pylist(rows, schema=_parquet_schema())
    with atomic_output(path) as tmp:
        pq.write_table(table, tmp)
