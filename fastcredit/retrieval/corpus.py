"""A memory-mapped corpus store built once, streaming, from a Search-R1 corpus jsonl.

Search-R1's corpus has one JSON object per line, ``{"id": str, "contents": "\\"Title\\"\\ntext"}``
(the toy world writes the same). Holding 21M such rows as Python objects costs tens of GB,
so the store keeps them in flat files and reads rows through ``numpy.memmap``:

    contents.bin        UTF-8 bytes of every ``contents``, back to back
    contents.idx.npy    int64 [N+1]  byte offsets into contents.bin
    split.npy           int32 [N]    byte position of the first newline in a row's contents
                                     (= its length when there is none): title | text boundary
    ids.bin, ids.idx.npy             the string ids, the same way
    id_hash.npy, id_rows.npy         uint64 [N] sorted id hashes and their rows (absent when
                                     every id is its row number, as in Search-R1's wiki-18)
    meta.json                        row count, source file, its size and mtime

Row ``i`` is line ``i`` of the jsonl, which is also row ``i`` of a FAISS index built from it
(Search-R1's ``e5_Flat.index`` included).
"""
from __future__ import annotations

import array
import hashlib
import json
import os
import shutil
import time
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np

STORE_VERSION = 1
_FILES = ("contents.bin", "contents.idx.npy", "split.npy", "ids.bin", "ids.idx.npy", "meta.json")


class CorpusError(ValueError):
    """The corpus file or store is missing, malformed or stale; the message says where."""


def _id_hash(ids: Iterable[bytes]) -> np.ndarray:
    """64-bit blake2b of each id (uint64), for the sorted id lookup table."""
    return np.fromiter(
        (int.from_bytes(hashlib.blake2b(b, digest_size=8).digest(), "little") for b in ids), dtype=np.uint64
    )


def _row_contents(row: dict, where: str) -> str:
    if isinstance(row.get("contents"), str):
        return row["contents"]
    # FlashRAG-style rows carry title/text separately; join them the way Search-R1's corpus does.
    if isinstance(row.get("text"), str):
        return f'"{row.get("title", "")}"\n{row["text"]}'
    raise CorpusError(f"{where}: missing string field 'contents' (or 'text')")


def _iter_rows(path: str) -> Iterator[tuple[int, int, str, str]]:
    """Yield ``(line_number, bytes_read_so_far, id, contents)`` from a corpus jsonl."""
    consumed = 0
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            consumed += len(line)
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise CorpusError(f"{where}: invalid JSON ({exc})") from None
            if not isinstance(row, dict):
                raise CorpusError(f"{where}: expected a JSON object")
            if "id" not in row or row["id"] is None:
                raise CorpusError(f"{where}: missing field 'id'")
            yield lineno, consumed, str(row["id"]), _row_contents(row, where)


def _source_stamp(path: str) -> dict:
    st = os.stat(path)
    return {"source": os.path.abspath(path), "source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns}


def build_corpus_store(jsonl_path: str, out_dir: str, progress: bool = True) -> "CorpusStore":
    """Stream ``jsonl_path`` into a store at ``out_dir`` (written beside, then renamed into place)."""
    from fastcredit.runtime.progress import progress_bar

    if not os.path.exists(jsonl_path):
        raise CorpusError(f"{jsonl_path}: no such corpus file")
    partial = out_dir.rstrip("/") + f".partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    c_off, i_off, split = array.array("q", [0]), array.array("q", [0]), array.array("i")
    ids_are_rows = True
    bar = progress_bar(total=os.path.getsize(jsonl_path), unit="B", unit_scale=True, desc="corpus store",
                       disable=not progress)
    with open(os.path.join(partial, "contents.bin"), "wb") as cf, open(os.path.join(partial, "ids.bin"), "wb") as idf:
        done = 0
        for lineno, consumed, pid, contents in _iter_rows(jsonl_path):
            raw, pid_b = contents.encode("utf-8"), pid.encode("utf-8")
            nl = raw.find(b"\n")
            split.append(nl if nl >= 0 else len(raw))
            cf.write(raw)
            idf.write(pid_b)
            c_off.append(c_off[-1] + len(raw))
            i_off.append(i_off[-1] + len(pid_b))
            ids_are_rows = ids_are_rows and pid == str(len(split) - 1)
            if len(split) % 8192 == 0:
                bar.update(consumed - done)
                done = consumed
        bar.update(bar.total - done)
    bar.close()
    if not split:
        shutil.rmtree(partial, ignore_errors=True)
        raise CorpusError(f"{jsonl_path}: the corpus has no passages")
    np.save(os.path.join(partial, "contents.idx.npy"), np.frombuffer(c_off, dtype=np.int64))
    np.save(os.path.join(partial, "ids.idx.npy"), np.frombuffer(i_off, dtype=np.int64))
    np.save(os.path.join(partial, "split.npy"), np.frombuffer(split, dtype=np.int32))
    if not ids_are_rows:
        _write_id_table(partial, len(split))
    meta = {"version": STORE_VERSION, "num_passages": len(split), "ids_are_rows": ids_are_rows,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **_source_stamp(jsonl_path)}
    with open(os.path.join(partial, "meta.json"), "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=1)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(partial, out_dir)
    return CorpusStore(out_dir)


def _write_id_table(root: str, n: int) -> None:
    """Sorted (hash, row) pairs: id lookup by binary search, no dict of N Python strings."""
    blob = np.fromfile(os.path.join(root, "ids.bin"), dtype=np.uint8)
    off = np.load(os.path.join(root, "ids.idx.npy"))
    hashes = np.empty(n, dtype=np.uint64)
    step = 1 << 20
    for s in range(0, n, step):
        e = min(n, s + step)
        hashes[s:e] = _id_hash(blob[off[i]:off[i + 1]].tobytes() for i in range(s, e))
    order = np.argsort(hashes, kind="stable")
    np.save(os.path.join(root, "id_hash.npy"), hashes[order])
    np.save(os.path.join(root, "id_rows.npy"), order.astype(np.int64))


def open_corpus_store(jsonl_path: Optional[str], store_dir: str, progress: bool = True) -> "CorpusStore":
    """Open the store at ``store_dir``; (re)build it from ``jsonl_path`` when absent or stale.

    Stale means the jsonl's size or mtime differs from the one the store was built from.
    With ``jsonl_path=None`` the store must already exist.
    """
    meta_path = os.path.join(store_dir, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path, encoding="utf-8") as fh:
            meta = json.load(fh)
        if jsonl_path is None or not os.path.exists(jsonl_path):
            return CorpusStore(store_dir)
        stamp = _source_stamp(jsonl_path)
        if meta.get("version") == STORE_VERSION and all(meta.get(k) == stamp[k]
                                                        for k in ("source_size", "source_mtime_ns")):
            return CorpusStore(store_dir)
    if jsonl_path is None:
        raise CorpusError(f"{store_dir}: no corpus store here and no corpus jsonl given to build one")
    return build_corpus_store(jsonl_path, store_dir, progress=progress)


class CorpusStore:
    """Random access to passages by row or id, straight from memory-mapped files."""

    def __init__(self, root: str):
        missing = [f for f in _FILES if not os.path.exists(os.path.join(root, f))]
        if missing:
            raise CorpusError(f"{root}: not a corpus store (missing {', '.join(missing)})")
        with open(os.path.join(root, "meta.json"), encoding="utf-8") as fh:
            self.meta = json.load(fh)
        if self.meta.get("version") != STORE_VERSION:
            raise CorpusError(f"{root}/meta.json: store version {self.meta.get('version')} != {STORE_VERSION}; "
                              "rebuild it")
        self.root = root
        self._contents = np.memmap(os.path.join(root, "contents.bin"), dtype=np.uint8, mode="r")
        self._c_off = np.load(os.path.join(root, "contents.idx.npy"), mmap_mode="r")
        self._split = np.load(os.path.join(root, "split.npy"), mmap_mode="r")
        self._ids = np.memmap(os.path.join(root, "ids.bin"), dtype=np.uint8, mode="r") \
            if os.path.getsize(os.path.join(root, "ids.bin")) else np.zeros(0, np.uint8)
        self._i_off = np.load(os.path.join(root, "ids.idx.npy"), mmap_mode="r")
        self._ids_are_rows = bool(self.meta["ids_are_rows"])
        if not self._ids_are_rows:
            self._hash = np.load(os.path.join(root, "id_hash.npy"), mmap_mode="r")
            self._hash_rows = np.load(os.path.join(root, "id_rows.npy"), mmap_mode="r")
        self.num_passages = int(self.meta["num_passages"])

    def __len__(self) -> int:
        return self.num_passages

    def _check(self, row: int) -> int:
        row = int(row)
        if not 0 <= row < self.num_passages:
            raise IndexError(f"{self.root}: row {row} out of range [0, {self.num_passages})")
        return row

    def contents_bytes(self, row: int) -> bytes:
        row = self._check(row)
        return self._contents[self._c_off[row]:self._c_off[row + 1]].tobytes()

    def contents(self, row: int) -> str:
        """The row's ``contents`` exactly as in the jsonl (``"Title"\\ntext``)."""
        return self.contents_bytes(row).decode("utf-8")

    def title_and_text(self, row: int) -> tuple[str, str]:
        """Search-R1's split: the first line (quotes kept) and everything after it."""
        raw = self.contents_bytes(row)
        cut = int(self._split[row])
        return raw[:cut].decode("utf-8"), raw[cut + 1:].decode("utf-8")

    def title(self, row: int) -> str:
        """The title without its surrounding quotes."""
        return self.title_and_text(row)[0].strip().strip('"')

    def text(self, row: int) -> str:
        return self.title_and_text(row)[1]

    def id(self, row: int) -> str:
        row = self._check(row)
        if self._ids_are_rows:
            return str(row)
        return self._ids[self._i_off[row]:self._i_off[row + 1]].tobytes().decode("utf-8")

    def document(self, row: int) -> dict:
        """The row as Search-R1's server returns it: ``{"id", "contents"}``."""
        return {"id": self.id(row), "contents": self.contents(row)}

    def row_of(self, pid: str) -> int:
        """Row of passage id ``pid``; KeyError naming the id and the store when absent."""
        pid = str(pid)
        if self._ids_are_rows:
            if pid.isdigit() and str(int(pid)) == pid and int(pid) < self.num_passages:
                return int(pid)
            raise KeyError(f"{self.root}: no passage with id {pid!r}")
        h = _id_hash([pid.encode("utf-8")])[0]
        lo, hi = np.searchsorted(self._hash, h, "left"), np.searchsorted(self._hash, h, "right")
        for row in self._hash_rows[lo:hi]:
            if self.id(int(row)) == pid:
                return int(row)
        raise KeyError(f"{self.root}: no passage with id {pid!r}")

    def rows_of(self, ids: Sequence[str]) -> np.ndarray:
        return np.array([self.row_of(p) for p in ids], dtype=np.int64)

    def observation_piece(self, row: int) -> str:
        """``(Title: <first line>) <text>``: the part of Search-R1's ``Doc i(...) text`` after ``Doc i``."""
        title, text = self.title_and_text(row)
        return f"(Title: {title}) {text}"

    def iter_observation_pieces(self, start: int = 0, stop: Optional[int] = None) -> Iterator[str]:
        stop = self.num_passages if stop is None else stop
        for row in range(start, stop):
            yield self.observation_piece(row)

    def iter_contents(self, start: int = 0, stop: Optional[int] = None) -> Iterator[str]:
        stop = self.num_passages if stop is None else stop
        for row in range(start, stop):
            yield self.contents(row)
