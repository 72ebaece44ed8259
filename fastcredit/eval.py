"""Evaluate a search agent: greedy rollouts through the training agent loop and retriever, EM and F1 per
data source, in the papers' table layout.

    python -m fastcredit.eval --model runs/demo                      # the run's last checkpoint on its own test split
    python -m fastcredit.eval --model runs/x --step 200 --data data/nq_hotpotqa/test.parquet
    python -m fastcredit.eval --model ckpt/Qwen2.5-3B-search/ --data test.parquet \\
        --config configs/searchr1_ppo.yaml retrieval.backend=http retrieval.url=http://127.0.0.1:8000/retrieve
    torchrun --nproc_per_node=8 -m fastcredit.eval --model runs/x --data data/nq_hotpotqa/test.parquet

``--model`` is a Hugging Face folder, or a run folder (its checkpoint is exported into
``<run>/exports/step_N`` by :func:`fastcredit.models.export.export_once`, and exported again only when
that step's checkpoint was saved again since, as a collapse-guard rollback does; the run's
``config.yaml`` is the default config). Rollouts are greedy (temperature 0) through
:func:`fastcredit.rollout.build.agent_loop` with the config's turn and token limits and the
config's retriever, on the vLLM engine where a GPU and vLLM are there, else the HF engine.

Scores: EM exactly as Search-R1's ``verl/utils/reward_score/qa_em.py`` (lower case, ASCII
punctuation, articles, white space; no unicode folding), F1 the SQuAD token F1 over the same
normalisation, max over gold answers. The table has one column per ``data_source`` in the
papers' order (NQ, TriviaQA, PopQA, HotpotQA, 2Wiki, Musique, Bamboogle, then others), in-domain
ones marked †, out-of-domain *, with the macro averages over in-domain, out-of-domain and all
sources (the papers' "Avg."). Written to ``<out>/results.md`` and ``<out>/results.json``.

Under ``torchrun`` the evaluation is data-parallel: each rank rolls out every W-th question (its
shard) on its own GPU and engine, searching the index split over the ranks as training does
(``retrieval.across_ranks``), and appends to its own ``predictions.rank<r>.jsonl``; rank 0
gathers every record, writes the table and merges the files into ``predictions.jsonl``. A rank
killed mid-run takes the job down; started again, each rank rolls out only what its shard still
lacks. ``results.json`` records the rollout's seconds and questions/s (``timing``).

Every scored question is appended to ``<out>/predictions.jsonl`` as it finishes a chunk; an
interrupted evaluation started again with the same arguments skips what is there (a different
model, another save of a run's step, data file or config is refused rather than mixed in;
``--fresh`` starts over, moving the old predictions aside). The scoring, the table and the cache
live in :mod:`fastcredit.trainer.heldout`, which the trainer's periodic evaluation uses too, so its
``eval/em/<source>`` metrics are computed the same way.

Exit status: 0 done, 2 bad input.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Callable, Iterable, Optional

from fastcredit.config import ConfigError, TrainConfig
from fastcredit.config.checks import check_paths
from fastcredit.data.loaders import DataError, QAExample
from fastcredit.distributed.process_group import DistInfo
from fastcredit.models.export import model_config, resolve_model
from fastcredit.rollout.build import agent_loop, engine_from_folder, open_policy
from fastcredit.trainer.heldout import (RESULTS_JSON, RESULTS_MD, SEARCHR1_IN_DOMAIN, PredictionCache, atomic_json,
                                        evaluate_shard, format_markdown, sample_per_source, score_records,
                                        source_sums, summarize)

SYNOPSIS = ("python -m fastcredit.eval --model DIR|runs/X [--step N] [--data FILE] [flags] "
            "[--config X.yaml] [key=value ...]")


def parser():
    """The command's line: the model, what to evaluate it on, the config and its overrides."""
    from fastcredit.config import command_parser

    p = command_parser("python -m fastcredit.eval", __doc__, usage=SYNOPSIS, help_prefixes="rollout, retrieval",
                       config="the config (default: the run's config.yaml, else the built-in defaults); key=value "
                              "overrides as for training (rollout.max_turns=5, retrieval.url=...)")
    p.add_argument("--model", required=True, metavar="DIR|RUN",
                   help="a Hugging Face folder, or a run folder (its checkpoint is exported to RUN/exports/step_N)")
    p.add_argument("--step", type=int, metavar="N",
                   help="with a run folder: the checkpoint step (default: the latest)")
    p.add_argument("--data", metavar="FILE",
                   help="QA file: Search-R1 parquet, FlashRAG jsonl, or a folder holding <split>.parquet / .jsonl "
                        "(default: the config's data.test_path, or its toy world's test split)")
    p.add_argument("--split", default="test", metavar="NAME", help="the split read from a data folder")
    p.add_argument("--limit", type=int, metavar="N",
                   help="evaluate N questions, spread evenly over the data sources (default: all)")
    p.add_argument("--in-domain", metavar="A,B",
                   help="data sources marked in-domain (default: the run's training sources, else nq,hotpotqa)")
    p.add_argument("--engine", default="auto", metavar="E",
                   help="auto | vllm | hf (auto: vLLM on a GPU when installed, else the HF engine)")
    p.add_argument("--batch", type=int, default=256, metavar="N",
                   help="questions rolled out together per chunk; predictions are saved per chunk")
    p.add_argument("--out", metavar="DIR",
                   help="where results go (default: RUN/eval/<data>-step<N>, or runs/eval/<model>-<data>)")
    p.add_argument("--fresh", action="store_true",
                   help="start over: move an earlier evaluation's predictions in --out aside")
    return p


def _file_id(path: str) -> dict:
    st = os.stat(path)
    return {"path": os.path.abspath(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def _training_sources(cfg: TrainConfig) -> Optional[set]:
    """The data sources a run trained on (its in-domain sets), or None when they cannot be read cheaply."""
    if cfg.data.source == "toy":
        return {"toyworld"}
    path = cfg.data.train_path
    if not path or not os.path.exists(path):
        return None
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return set(pq.read_table(path, columns=["data_source"]).column("data_source").to_pylist())
        except (KeyError, ValueError, OSError):
            return None
    return None


def _eval_data(cfg: TrainConfig, data: Optional[str], split: str,
               rank: int = 0) -> tuple[list[QAExample], str, str]:
    """``(examples, the file they came from, the corpus the retriever reads)``."""
    from fastcredit.data.build import load_data
    from fastcredit.data.loaders import load_qa

    if data is not None:  # read first: a wrong path fails before anything is generated or built
        examples = load_qa(data, split=split)
    elif cfg.data.source != "toy":
        data = cfg.data.test_path
        if not data:
            raise ConfigError("no --data given and the config has no data.test_path")
        examples = load_qa(data, split=split)
    corpus = cfg.retrieval.corpus
    if cfg.data.source == "toy":
        world = load_data(cfg, rank)  # generated once into data.world_dir (rank 0 writes); reused afterwards
        corpus = world.corpus
        if data is None:
            return world.test, os.path.join(cfg.data.world_dir, f"{split}.jsonl"), corpus
    if not examples:
        raise DataError(f"{data}: no questions to evaluate")
    if not corpus and cfg.retrieval.backend != "http":
        raise ConfigError("retrieval.corpus is not set: the retriever needs the corpus its index was built from "
                          "(or retrieval.backend=http with retrieval.url)")
    return examples, data, corpus


# how evaluate() opens a folder's engine (tests put a scripted policy in its place)
engine_factory = engine_from_folder


def input_errors() -> tuple:
    """What bad input raises: the command reports these in one line (exit status 2)."""
    from fastcredit.distributed.checkpoint import CheckpointError
    from fastcredit.models.export import ExportError

    return ConfigError, DataError, FileNotFoundError, ExportError, CheckpointError


def rank0_first(info: DistInfo, fn: Callable, then_all: bool = True):
    """``fn()`` on rank 0, then (``then_all``) on the other ranks once it is done; an input error on rank 0
    (ConfigError, DataError, ...) is raised on every rank, so they all stop together."""
    if not info.distributed:
        return fn()
    import torch.distributed as dist

    out, error = None, None
    if info.is_main:
        try:
            out = fn()
        except input_errors() as exc:
            error = exc
    box = [None if error is None else (type(error).__name__, str(error))]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        if error is not None:
            raise error
        raise next(e for e in input_errors() if e.__name__ == box[0][0])(box[0][1])
    if not info.is_main and then_all:
        out = fn()
    return out


def _default_out(model: str, run: Optional[str], step: Optional[int], data: str) -> str:
    stem = os.path.splitext(os.path.basename(os.path.normpath(data)))[0]
    if run is not None:
        return os.path.join(run, "eval", f"{stem}-step{step:06d}")
    return os.path.join("runs", "eval", f"{os.path.basename(os.path.normpath(model))}-{stem}")


def _config_fingerprint(cfg: TrainConfig) -> str:
    """What changes a rollout: the prompt, the rollout limits and the retriever."""
    from dataclasses import asdict

    key = {"data": {k: v for k, v in asdict(cfg.data).items() if k.startswith("prompt")},
           "chat_template": cfg.model.chat_template,
           "rollout": {k: v for k, v in asdict(cfg.rollout).items()
                       if k in ("max_turns", "max_action_tokens", "max_obs_tokens", "max_response_tokens", "mode")},
           "retrieval": {k: v for k, v in asdict(cfg.retrieval).items()
                         if k in ("backend", "url", "corpus", "index", "encoder", "topk", "max_passage_tokens")}}
    if cfg.eval.observations != "real":  # a closed-book control (real searches keep the fingerprint they had)
        key["observations"] = cfg.eval.observations
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def evaluate(cfg: TrainConfig, model: str, *, step: Optional[int] = None, data: Optional[str] = None,
             split: str = "test", limit: Optional[int] = None, in_domain: Optional[Iterable[str]] = None,
             engine: str = "auto", batch: int = 256, out: Optional[str] = None, fresh: bool = False,
             progress: bool = True, info: Optional[DistInfo] = None) -> dict:
    """Evaluate ``model`` (a Hugging Face folder or a run folder); returns the summary written to ``out``.

    ``info``: under torchrun, this rank's DistInfo: every rank rolls out its shard of the questions
    (:func:`~fastcredit.trainer.heldout.evaluate_shard`) into its own predictions file, and rank 0 merges them
    and writes the table; every rank returns the summary."""
    import time

    import torch
    from fastcredit.data.lookup import turn_budget
    from fastcredit.data.prompts import example_prompt_ids
    from fastcredit.distributed.process_group import max_over_ranks
    from fastcredit.rollout.agent import searcher_session
    from fastcredit.runtime.progress import progress_bar

    info = info or DistInfo(device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if batch < 1 or (limit is not None and limit < 1):
        raise ConfigError("--batch and --limit must be at least 1")
    check_paths(cfg, "data", "retrieval")  # the questions and the retriever's files, before anything loads
    folder, run, step = rank0_first(info, lambda: resolve_model(model, step))  # rank 0 exports; the others reuse it
    examples, data_path, corpus = rank0_first(info, lambda: _eval_data(cfg, data, split, info.rank))
    chosen = sample_per_source(examples, limit, cfg.eval.seed_for(cfg.seed)) if limit else list(range(len(examples)))
    if in_domain is None:
        in_domain = _training_sources(cfg) if run is not None or cfg.data.source == "toy" else None
        in_domain = in_domain if in_domain is not None else set(SEARCHR1_IN_DOMAIN)
    out = out or _default_out(model, run, step, data_path) + (
        f"-observations-{cfg.eval.observations}" if cfg.eval.observations != "real" else "")
    meta = {"model": os.path.abspath(folder), "step": step, "data": _file_id(data_path) if os.path.isfile(data_path)
            else os.path.abspath(data_path), "split": split, "limit": limit, "seed": cfg.seed,
            "config": _config_fingerprint(cfg)}
    if run is not None:  # which save of the step was exported: predictions of a step saved since are not mixed in
        from fastcredit.models.export import source_key

        meta["checkpoint"] = source_key(folder)
    # rank 0 compares the fingerprint and applies --fresh first; no rank appends before every rank has read (the
    # all-reduce below comes first)
    cache = rank0_first(info, lambda: PredictionCache(out, meta, fresh=fresh, rank=info.rank,
                                                      world_size=info.world_size, check=info.is_main))
    todo = [i for i in chosen if i not in cache.done]
    if cache.done and info.is_main:
        print(f"{out}: {len(chosen) - len(todo)} of {len(chosen)} questions already scored; rolling out the rest",
              flush=True)
    seconds = 0.0
    if max_over_ranks(len(todo), info):  # every rank opens its engine and index share when any rank has work
        tokenizer, gen, searcher, kind, device = open_policy(cfg, folder, corpus, engine, progress and info.is_main,
                                                             info, make_engine=engine_factory,
                                                             observations=cfg.eval.observations)
        if info.is_main:
            ranks = f" ({info.world_size} ranks, each its shard)" if info.distributed else ""
            print(f"evaluating {folder} on {data_path} ({len(chosen)} questions, "
                  f"{len({examples[i].data_source for i in chosen})} data sources) with the {kind} engine on "
                  f"{device}{ranks}", flush=True)
        loop = agent_loop(cfg, gen, searcher, greedy=True)
        d = cfg.data

        def roll(idx: list) -> list:
            exs = [examples[i] for i in idx]
            prompts = example_prompt_ids(tokenizer, exs, d.prompt_source, d.prompt_template, cfg.model.chat_template)
            metas = [{"max_turns": turn_budget(ex)} for ex in exs]  # a lookup question's own budget
            return score_records(loop.run(prompts, metas=metas).episodes, exs, idx)

        mine = chosen[info.rank::info.world_size]
        bar = progress_bar(total=len(mine), initial=sum(i in cache.done for i in mine), unit="q",
                           desc="eval" + (f" rank 0 of {info.world_size}" if info.distributed else ""),
                           disable=not (progress and info.is_main), dynamic_ncols=True)
        start = time.perf_counter()
        try:
            with searcher_session(searcher):
                records = evaluate_shard(chosen, info, roll, cache=cache, batch=batch, progress=bar.update)
        finally:
            bar.close()
            gen.close()
        seconds = time.perf_counter() - start
    else:
        records = [cache.done[i] for i in chosen]
    summary = summarize(source_sums(records), in_domain)
    summary.update({"model": folder, "run": run, "step": step, "data": data_path, "split": split,
                    "timing": {"rolled_out": len(todo), "seconds": round(seconds, 3), "ranks": info.world_size,
                               "questions_per_s": round(len(todo) / seconds, 3) if seconds > 0 else None}})
    label = os.path.basename(os.path.normpath(run or folder)) + (f" step {step}" if step is not None else "")
    if info.is_main:
        cache.merge(records)
        atomic_json(os.path.join(out, RESULTS_JSON), summary)
        with open(os.path.join(out, RESULTS_MD), "w", encoding="utf-8") as f:
            f.write(format_markdown(summary, label))
    return {**summary, "out": out, "markdown": format_markdown(summary, label)}


def main(argv: Optional[list] = None) -> int:
    """The command; under torchrun (``torchrun --nproc_per_node=8 -m fastcredit.eval ...``) every rank evaluates
    its shard of the questions and rank 0 prints the table."""
    from fastcredit.distributed.process_group import init_distributed, rank_failure_ends_job, shutdown
    from fastcredit.runtime.progress import quiet_library_bars

    args = parser().parse_args(argv)
    quiet_library_bars()  # a log gets plain progress lines, not the libraries' bar frames
    info = init_distributed()  # one process: nothing to initialise
    code = 0
    try:
        cfg = model_config(args.model, args.config, args.overrides)
        in_domain = None if args.in_domain is None else [s.strip() for s in args.in_domain.split(",") if s.strip()]
        # an input error reaches every rank together (rank0_first); any other failure ends this rank's process
        with rank_failure_ends_job(info, expected=input_errors()):
            res = evaluate(cfg, args.model, step=args.step, data=args.data, split=args.split, limit=args.limit,
                           in_domain=in_domain, engine=args.engine, batch=args.batch, out=args.out, fresh=args.fresh,
                           progress=cfg.logging.progress, info=info)
    except input_errors() as exc:
        if info.is_main:
            print(f"eval error: {exc}", file=sys.stderr)
        code = 2
    else:
        if info.is_main:
            print(res["markdown"])
            t = res["timing"]
            if t["questions_per_s"] is not None:
                print(f"rolled out {t['rolled_out']} questions in {t['seconds']:.1f} s on {t['ranks']} rank(s): "
                      f"{t['questions_per_s']:.2f} questions/s")
            print(f"results: {os.path.join(res['out'], RESULTS_MD)}  {os.path.join(res['out'], RESULTS_JSON)}")
    if info.distributed:
        shutdown(info, code)
    return code


if __name__ == "__main__":
    from fastcredit.distributed.process_group import exit_process

    exit_process(main())
