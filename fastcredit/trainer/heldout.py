"""What evaluation shares between ``python -m fastcredit.eval`` and the trainer's periodic evaluation: questions
spread over data sources, per-trajectory scores (EM exactly as Search-R1's ``qa_em``, token F1), per-source
sums and the papers' averages, the markdown table, and the resumable predictions file.

Legend: a *record* is one scored question (``index`` into the evaluated list, ``id``, ``data_source``,
``prediction``, ``em``, ``f1``, ``format_ok``, ``turns``, ``searches``); *sums* are ``{source: [EM, F1, n]}``.
"""
from __future__ import annotations

import json
import os
import random
import re
import time
from typing import Callable, Iterable, Optional, Sequence

from fastcredit.config import ConfigError
from fastcredit.data.loaders import DataError, QAExample
from fastcredit.runtime.files import atomic_output
from fastcredit.credit.rewards import score_trajectory

# Search-R1's seven test sets in its tables' order (General QA, then multi-hop QA).
PAPER_ORDER = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
# Search-R1 trains on NQ + HotpotQA: those two are its in-domain sets.
SEARCHR1_IN_DOMAIN = ("nq", "hotpotqa")
PREDICTIONS, RESULTS_JSON, RESULTS_MD, META = "predictions.jsonl", "results.json", "results.md", "meta.json"
RANK_PREDICTIONS = "predictions.rank{}.jsonl"  # one per rank while a torchrun evaluation runs
RANK_FILE = re.compile(r"predictions\.rank(\d+)\.jsonl")

# ---------------------------------------------------------------------------------------- scoring


def sample_per_source(examples: Sequence[QAExample], n: int, seed: int = 0) -> list[int]:
    """Indices of ``n`` examples spread evenly over the data sources (round robin; a small source that runs out
    leaves its share to the others), each source's own order shuffled by ``seed``; returned in file order.

    The same ``(examples, n, seed)`` always gives the same questions, so periodic evaluations compare alike.
    ``n >= len(examples)``: all of them.
    """
    if n >= len(examples):
        return list(range(len(examples)))
    by_source: dict[str, list[int]] = {}
    for i, ex in enumerate(examples):
        by_source.setdefault(ex.data_source, []).append(i)
    queues = []
    for k, (source, idx) in enumerate(sorted(by_source.items(), key=lambda kv: source_rank(kv[0]))):
        random.Random(f"{seed}/{source}").shuffle(idx)
        queues.append(idx)
    chosen: list[int] = []
    depth = 0
    while len(chosen) < n:
        for q in queues:
            if depth < len(q) and len(chosen) < n:
                chosen.append(q[depth])
        depth += 1
    return sorted(chosen)


def source_rank(source: str) -> tuple:
    """Sort key of a data source: the papers' order first, then by name."""
    return (PAPER_ORDER.index(source), "") if source in PAPER_ORDER else (len(PAPER_ORDER), source)


def score_records(episodes: Sequence, examples: Sequence[QAExample], indices: Sequence[int]) -> list[dict]:
    """One record per trajectory: the question's index and id, its source, the prediction, EM, F1, format, turns."""
    out = []
    for e, ex, i in zip(episodes, examples, indices):
        o = score_trajectory(e.action_texts, ex.golden_answers, kind="em")
        out.append({"index": int(i), "id": ex.id, "data_source": ex.data_source, "question": ex.question,
                    "golden_answers": list(ex.golden_answers), "prediction": o.prediction, "em": o.em, "f1": o.f1,
                    "format_ok": bool(o.format_ok), "turns": len(e.turns),
                    "searches": sum(1 for s in e.steps if s.query is not None)})
    return out


def source_sums(records: Iterable[dict]) -> dict[str, list[float]]:
    """``{source: [EM sum, F1 sum, count]}``."""
    sums: dict[str, list[float]] = {}
    for r in records:
        s = sums.setdefault(r["data_source"], [0.0, 0.0, 0.0])
        s[0] += r["em"]
        s[1] += r["f1"]
        s[2] += 1
    return sums


def summarize(sums: dict, in_domain: Iterable[str]) -> dict:
    """Per source EM / F1 / n and the macro averages over in-domain, out-of-domain and all sources."""
    in_domain = set(in_domain)
    sources = [{"name": name, "n": int(s[2]), "em": s[0] / s[2], "f1": s[1] / s[2], "in_domain": name in in_domain}
               for name, s in sorted(sums.items(), key=lambda kv: source_rank(kv[0])) if s[2] > 0]

    def avg(rows):
        if not rows:
            return None
        return {"em": sum(r["em"] for r in rows) / len(rows), "f1": sum(r["f1"] for r in rows) / len(rows),
                "sources": [r["name"] for r in rows]}

    n = sum(r["n"] for r in sources)
    micro = {"em": sum(r["em"] * r["n"] for r in sources) / n, "f1": sum(r["f1"] * r["n"] for r in sources) / n,
             "n": n} if n else None
    return {"sources": sources, "in_domain": avg([r for r in sources if r["in_domain"]]),
            "out_of_domain": avg([r for r in sources if not r["in_domain"]]), "average": avg(sources),
            "questions": micro}


def eval_metrics(summary: dict, prefix: str = "eval") -> dict:
    """Flat metrics of a summary: ``eval/em`` (the macro average over sources), ``eval/f1``, ``eval/em/<source>``…"""
    if summary["average"] is None:
        return {}
    out = {f"{prefix}/em": summary["average"]["em"], f"{prefix}/f1": summary["average"]["f1"]}
    if len(summary["sources"]) > 1:
        for r in summary["sources"]:
            out[f"{prefix}/em/{r['name']}"] = r["em"]
            out[f"{prefix}/f1/{r['name']}"] = r["f1"]
    return out


def format_markdown(summary: dict, label: str = "model") -> str:
    """The papers' layout: one row per metric, in-domain († ) then out-of-domain (*) sources, then averages."""
    rows = summary["sources"]
    heads = [f"{r['name']}{'†' if r['in_domain'] else '*'}" for r in rows]
    avgs = [(k, title) for k, title in (("in_domain", "in-domain avg"), ("out_of_domain", "out-of-domain avg"),
                                        ("average", "avg")) if summary[k] is not None]
    lines = ["| " + " | ".join([label, *heads, *(t for _, t in avgs)]) + " |",
             "|" + "---|" * (1 + len(heads) + len(avgs))]
    for metric in ("em", "f1"):
        cells = [f"{r[metric]:.3f}" for r in rows] + [f"{summary[k][metric]:.3f}" for k, _ in avgs]
        lines.append("| " + " | ".join([metric.upper(), *cells]) + " |")
    lines.append("| " + " | ".join(["n", *(str(r["n"]) for r in rows), *("" for _ in avgs)]) + " |")
    lines.append("")
    lines.append("† in-domain, * out-of-domain. EM: Search-R1's qa_em; F1: token F1 over the same normalisation; "
                 "averages are means over data sources.")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------- the predictions cache


class PredictionCache:
    """``predictions.jsonl`` of an evaluation folder plus ``meta.json``, the fingerprint of what produced it.

    Lines are appended and fsynced a chunk at a time; a torn last line (a kill mid-write) is dropped on reading.
    Under torchrun (``world_size > 1``) each rank appends to its own ``predictions.rank<r>.jsonl`` and every rank
    reads every rank's file, so a rank started again skips what any rank scored; :meth:`merge` (rank 0, at the
    end) folds them into ``predictions.jsonl``. ``check``: compare ``meta`` with the folder's and apply ``fresh``
    (rank 0 does, before the other ranks open theirs with ``check=False``).
    """

    def __init__(self, folder: str, meta: dict, fresh: bool = False, rank: int = 0, world_size: int = 1,
                 check: bool = True):
        self.folder, self.meta = folder, meta
        self.merged, self.meta_path = os.path.join(folder, PREDICTIONS), os.path.join(folder, META)
        self.path = self.merged if world_size == 1 else os.path.join(folder, RANK_PREDICTIONS.format(rank))
        if check:
            self._check(fresh)
        self.done: dict[int, dict] = {}
        for path in self.files():
            for r in self._read(path, own=path == self.path):
                self.done[r["index"]] = r

    def files(self) -> list[str]:
        """Every predictions file of the folder: the merged one, then the ranks' in rank order."""
        ranks = sorted((f for f in os.listdir(self.folder) if RANK_FILE.fullmatch(f)),
                       key=lambda f: int(RANK_FILE.fullmatch(f).group(1))) if os.path.isdir(self.folder) else []
        return [p for p in [self.merged, *(os.path.join(self.folder, f) for f in ranks)] if os.path.exists(p)]

    def _check(self, fresh: bool) -> None:
        os.makedirs(self.folder, exist_ok=True)
        if fresh and self.files():
            stamp, moved = time.strftime(".%Y%m%d-%H%M%S"), self.files()
            for path in moved:
                os.replace(path, path + stamp)
            print(f"--fresh: earlier predictions moved aside: {', '.join(os.path.basename(p) + stamp for p in moved)}",
                  flush=True)
        if self.files() and os.path.exists(self.meta_path):
            with open(self.meta_path, encoding="utf-8") as f:
                old = json.load(f)
            diff = sorted(k for k in set(old) | set(self.meta) if old.get(k) != self.meta.get(k))
            if diff:
                raise ConfigError(f"{self.merged} holds predictions of another evaluation ({', '.join(diff)} differ: "
                                  f"{'; '.join(f'{k}: {old.get(k)!r} -> {self.meta.get(k)!r}' for k in diff[:3])}); "
                                  "use another --out, or --fresh to start over")
        atomic_json(self.meta_path, self.meta)

    @staticmethod
    def _read(path: str, own: bool) -> list[dict]:
        """The records of one file; a torn last line is dropped (and cut from the file, when it is this rank's:
        it appends after it)."""
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        out = []
        for k, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except ValueError:
                if k >= len(lines) - 2:  # the last line, torn by a kill: its chunk is rolled out again
                    break
                raise DataError(f"{path} line {k + 1}: not JSON; the predictions file is damaged "
                                "(--fresh starts over)") from None
        if own:
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in out)
        return out

    def add(self, records: Sequence[dict]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
            f.flush()
            os.fsync(f.fileno())
        for r in records:
            self.done[r["index"]] = r

    def merge(self, records: Iterable[dict] = ()) -> None:
        """Fold every rank's file (and ``records``, the other ranks' newest) into ``predictions.jsonl``, in index
        order, then remove the rank files. A kill in between leaves duplicates, which reading folds together."""
        for r in records:
            self.done[r["index"]] = r
        ranks = [p for p in self.files() if p != self.merged]
        if not ranks:
            return
        with atomic_output(self.merged) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(self.done[i]) + "\n" for i in sorted(self.done))
        for path in ranks:
            os.remove(path)
        self.path = self.merged


# ----------------------------------------------------------------------------- one evaluation, split over ranks


def evaluate_shard(chosen: Sequence[int], info, roll: Callable[[list], list], *,
                   cache: Optional[PredictionCache] = None, batch: int = 0,
                   progress: Optional[Callable[[int], None]] = None) -> list[dict]:
    """The one evaluation path of ``python -m fastcredit.eval`` and the trainer's periodic evaluation.

    This rank (``info``: its DistInfo) rolls out its share of ``chosen`` (every ``world_size``-th question from its
    rank: the shards stay balanced over the data sources), those ``cache`` does not hold yet, ``batch`` questions
    at a time (0: all at once) with ``roll(indices) -> records``; each chunk goes into ``cache`` before the next
    starts, and ``progress(n)`` is told its size. Every rank must call this together (retrieval split over ranks
    meets the other ranks while it runs: the caller holds its searcher's session around it). Returns the record of
    every question of ``chosen``, from every rank, on every rank, in ``chosen``'s order.
    """
    mine = list(chosen[info.rank::info.world_size])
    done = cache.done if cache is not None else {}
    fresh: dict[int, dict] = {}
    todo = [i for i in mine if i not in done]
    size = batch if batch > 0 else max(len(todo), 1)
    for k in range(0, len(todo), size):
        records = roll(todo[k:k + size])
        if cache is not None:
            cache.add(records)
        fresh.update((r["index"], r) for r in records)
        if progress is not None:
            progress(len(records))
    ours = [fresh[i] if i in fresh else done[i] for i in mine]
    if info.world_size == 1:
        return ours
    import torch.distributed as dist

    shards: list = [None] * info.world_size
    dist.all_gather_object(shards, ours, group=info.group)
    by_index = {r["index"]: r for shard in shards for r in shard}
    return [by_index[i] for i in chosen]


def atomic_json(path: str, obj) -> None:
    with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
