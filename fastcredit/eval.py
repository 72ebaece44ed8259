"""Evaluate a search agent: greedy rollouts through the training agent loop and retriever, EM and F1 per
data source, in the papers' table layout.

    python -m fastcredit.eval --model runs/demo                      # the run's last checkpoint on its own test split
    python -m fastcredit.eval --model runs/x --step 200 --data data/nq_hotpotqa/test.parquet
    python -m fastcredit.eval --model ckpt/Qwen2.5-3B-search/ --data test.parquet \\
        --config configs/searchr1_ppo.yaml retrieval.backend=http retrieval.url=http://127.0.0.1:8000/retrieve

``--model`` is a Hugging Face folder, or a run folder (its checkpoint is exported into
``<run>/exports/step_N`` by :func:`fastcredit.export.export_once`, and exported again only when
that step's checkpoint was saved again since, as a collapse-guard rollback does; the run's
``config.yaml`` is the default config). Rollouts are greedy (temperature 0) through
:func:`fastcredit.trainer.parts.agent_loop` with the config's turn and token limits and the
config's retriever, on the vLLM engine where a GPU and vLLM are there, else the HF engine.

Scores: EM exactly as Search-R1's ``verl/utils/reward_score/qa_em.py`` (lower case, ASCII
punctuation, articles, white space; no unicode folding), F1 the SQuAD token F1 over the same
normalisation, max over gold answers. The table has one column per ``data_source`` in the
papers' order (NQ, TriviaQA, PopQA, HotpotQA, 2Wiki, Musique, Bamboogle, then others), in-domain
ones marked †, out-of-domain *, with the macro averages over in-domain, out-of-domain and all
sources (the papers' "Avg."). Written to ``<out>/results.md`` and ``<out>/results.json``.

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
from typing import Iterable, Optional

from fastcredit.config import ConfigError, TrainConfig, load_config, parse_cli
from fastcredit.data.loaders import DataError, QAExample
from fastcredit.trainer.heldout import (RESULTS_JSON, RESULTS_MD, SEARCHR1_IN_DOMAIN, PredictionCache, atomic_json,
                                   format_markdown, sample_per_source, score_records, source_sums, summarize)

SYNOPSIS = ("python -m fastcredit.eval --model DIR|runs/X [--step N] [--data FILE] [flags] "
            "[--config X.yaml] [key=value ...]")
FLAG_HELP = """
--model DIR|RUN     a Hugging Face folder, or a run folder (its checkpoint is exported to RUN/exports/step_N)
--step N            with a run folder: the checkpoint step (default: the latest)
--data FILE         QA file: Search-R1 parquet, FlashRAG jsonl, or a folder holding <split>.parquet / .jsonl
                    (default: the config's data.test_path, or its toy world's test split)
--split NAME        the split read from a data folder (default: test)
--limit N           evaluate N questions, spread evenly over the data sources (default: all)
--in-domain A,B     data sources marked in-domain (default: the run's training sources, else nq,hotpotqa)
--engine E          auto | vllm | hf (auto: vLLM on a GPU when installed, else the HF engine)
--batch N           questions rolled out together per chunk (default 256); predictions are saved per chunk
--out DIR           where results go (default: RUN/eval/<data>-step<N>, or runs/eval/<model>-<data>)
--fresh             start over: move an earlier evaluation's predictions in --out aside
--config X.yaml     the config (default: the run's config.yaml, else the built-in defaults); key=value
                    overrides as for training (rollout.max_turns=5, retrieval.url=...)
-h, --help [PREFIX] this help; with PREFIX the config keys under it (rollout, retrieval, all)
"""


# ------------------------------------------------------------------------------------- the command


FLAGS = {"--model": str, "--step": int, "--data": str, "--split": str, "--limit": int, "--in-domain": str,
         "--engine": str, "--batch": int, "--out": str, "--fresh": None}


def _file_id(path: str) -> dict:
    st = os.stat(path)
    return {"path": os.path.abspath(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def _is_run(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "checkpoints")) and os.path.exists(os.path.join(path, "config.yaml"))


def _run_step(run: str, step: Optional[int]) -> int:
    from fastcredit.distributed.checkpoint import latest_checkpoint

    if step is not None:
        return step
    path = latest_checkpoint(os.path.join(run, "checkpoints"))
    if path is None:
        raise ConfigError(f"{run}/checkpoints has no finished checkpoint to evaluate")
    return int(os.path.basename(path).split("_")[-1])


def resolve_model(model: str, step: Optional[int]) -> tuple[str, Optional[str], Optional[int]]:
    """``(Hugging Face folder, run folder or None, step or None)``; a run's checkpoint is exported once."""
    if not os.path.isdir(model):
        raise ConfigError(f"--model {model}: no such folder (a Hugging Face model folder or a run folder)")
    if not _is_run(model):
        if step is not None:
            raise ConfigError(f"--step applies to a run folder; {model} is not one (it has no checkpoints/)")
        if not os.path.exists(os.path.join(model, "config.json")):
            raise ConfigError(f"--model {model}: neither a Hugging Face folder (no config.json) nor a run folder "
                              "(no checkpoints/ and config.yaml)")
        return model, None, None
    from fastcredit.export import export_once

    step = _run_step(model, step)
    # reused while it was made from the checkpoint as it is now (its manifest), else exported again
    folder = export_once(model, os.path.join(model, "exports", f"step_{step:06d}"), step=step)
    return folder, model, step


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


def _eval_data(cfg: TrainConfig, data: Optional[str], split: str) -> tuple[list[QAExample], str, str]:
    """``(examples, the file they came from, the corpus the retriever reads)``."""
    from fastcredit.trainer import parts as C
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
        world = C.load_data(cfg)  # generated once into data.world_dir; reused afterwards
        corpus = world.corpus
        if data is None:
            return world.test, os.path.join(cfg.data.world_dir, f"{split}.jsonl"), corpus
    if not examples:
        raise DataError(f"{data}: no questions to evaluate")
    if not corpus and cfg.retrieval.backend != "http":
        raise ConfigError("retrieval.corpus is not set: the retriever needs the corpus its index was built from "
                          "(or retrieval.backend=http with retrieval.url)")
    return examples, data, corpus


def _pick_engine(kind: str) -> str:
    import torch

    if kind not in ("auto", "vllm", "hf"):
        raise ConfigError(f"--engine {kind!r}: valid: auto, vllm, hf")
    if kind != "auto":
        return kind
    if not torch.cuda.is_available():
        return "hf"
    import importlib.util

    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def _make_engine(kind: str, folder: str, tokenizer, cfg: TrainConfig, device):
    import torch

    from fastcredit.rollout.engines import make_engine

    if kind == "vllm":
        return make_engine("vllm", None, tokenizer, cfg.rollout, device=device, model_path=folder)
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device.type == "cpu" else getattr(torch, cfg.model.dtype)
    lm = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype, local_files_only=True).to(device).eval()
    return make_engine("hf", lm, tokenizer, cfg.rollout, device=device)


def open_policy(cfg: TrainConfig, folder: str, corpus: str, engine: str = "auto", progress: bool = True):
    """``(tokenizer, engine, searcher, engine kind, device)``: the model in ``folder`` ready to roll out on this
    machine's device with the config's retriever (``engine``: auto | vllm | hf)."""
    import torch
    from fastcredit.trainer import parts as C
    from fastcredit.export import load_tokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(folder)  # the class the folder names, as training tokenized (fastcredit.export)
    kind = _pick_engine(engine)
    gen = _make_engine(kind, folder, tokenizer, cfg, device)
    try:
        searcher, _ = C.make_searcher(cfg, tokenizer, corpus, progress=progress, device=device)
    except BaseException:
        gen.close()
        raise
    return tokenizer, gen, searcher, kind, device


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
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def evaluate(cfg: TrainConfig, model: str, *, step: Optional[int] = None, data: Optional[str] = None,
             split: str = "test", limit: Optional[int] = None, in_domain: Optional[Iterable[str]] = None,
             engine: str = "auto", batch: int = 256, out: Optional[str] = None, fresh: bool = False,
             progress: bool = True) -> dict:
    """Evaluate ``model`` (a Hugging Face folder or a run folder); returns the summary written to ``out``."""
    from tqdm import tqdm
    from fastcredit.trainer import parts as C
    from fastcredit.data.prompts import example_prompt_ids

    if batch < 1 or (limit is not None and limit < 1):
        raise ConfigError("--batch and --limit must be at least 1")
    folder, run, step = resolve_model(model, step)
    examples, data_path, corpus = _eval_data(cfg, data, split)
    chosen = sample_per_source(examples, limit, cfg.eval.seed_for(cfg.seed)) if limit else list(range(len(examples)))
    if in_domain is None:
        in_domain = _training_sources(cfg) if run is not None or cfg.data.source == "toy" else None
        in_domain = in_domain if in_domain is not None else set(SEARCHR1_IN_DOMAIN)
    out = out or _default_out(model, run, step, data_path)
    meta = {"model": os.path.abspath(folder), "step": step, "data": _file_id(data_path) if os.path.isfile(data_path)
            else os.path.abspath(data_path), "split": split, "limit": limit, "seed": cfg.seed,
            "config": _config_fingerprint(cfg)}
    if run is not None:  # which save of the step was exported: predictions of a step saved since are not mixed in
        from fastcredit.export import source_key

        meta["checkpoint"] = source_key(folder)
    cache = PredictionCache(out, meta, fresh=fresh)
    todo = [i for i in chosen if i not in cache.done]
    if cache.done:
        print(f"{out}: {len(chosen) - len(todo)} of {len(chosen)} questions already scored; rolling out the rest",
              flush=True)
    if todo:
        tokenizer, gen, searcher, kind, device = open_policy(cfg, folder, corpus, engine, progress)
        print(f"evaluating {folder} on {data_path} ({len(chosen)} questions, "
              f"{len({examples[i].data_source for i in chosen})} data sources) with the {kind} engine on {device}",
              flush=True)
        loop = C.agent_loop(cfg, gen, searcher, greedy=True)
        d = cfg.data
        bar = tqdm(total=len(chosen), initial=len(chosen) - len(todo), unit="q", desc="eval", disable=not progress,
                   dynamic_ncols=True)
        try:
            for k in range(0, len(todo), batch):
                idx = todo[k:k + batch]
                exs = [examples[i] for i in idx]
                prompts = example_prompt_ids(tokenizer, exs, d.prompt_source, d.prompt_template,
                                             cfg.model.chat_template)
                result = loop.run(prompts)
                cache.add(score_records(result.episodes, exs, idx))
                bar.update(len(idx))
                scored = [cache.done[i] for i in chosen if i in cache.done]
                bar.set_postfix(em=f"{sum(r['em'] for r in scored) / len(scored):.3f}")
        finally:
            bar.close()
            gen.close()
    summary = summarize(source_sums(cache.done[i] for i in chosen), in_domain)
    summary.update({"model": folder, "run": run, "step": step, "data": data_path, "split": split})
    label = os.path.basename(os.path.normpath(run or folder)) + (f" step {step}" if step is not None else "")
    atomic_json(os.path.join(out, RESULTS_JSON), summary)
    with open(os.path.join(out, RESULTS_MD), "w", encoding="utf-8") as f:
        f.write(format_markdown(summary, label))
    return {**summary, "out": out, "markdown": format_markdown(summary, label)}


def model_config(model: str, rest: list) -> TrainConfig:
    """The config of a command that takes ``--model``: ``--config``, else a run folder's ``config.yaml``, else the
    defaults; then the ``key=value`` overrides in ``rest``."""
    path, overrides = parse_cli(rest)
    if path is None and _is_run(model):
        path = os.path.join(model, "config.yaml")
    return load_config(path, overrides)


def main(argv: Optional[list] = None) -> int:
    from fastcredit.distributed.checkpoint import CheckpointError
    from fastcredit.config.help import take_flags
    from fastcredit.export import ExportError

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        from fastcredit.config.help import format_usage, handle_help

        handle_help(argv, format_usage(SYNOPSIS, __doc__, FLAG_HELP))
    try:
        opts, rest = take_flags(argv, FLAGS)
        if "--model" not in opts:
            raise ConfigError("--model DIR|runs/X is required (see --help)")
        model = opts["--model"]
        cfg = model_config(model, rest)
        in_domain = opts.get("--in-domain")
        res = evaluate(cfg, model, step=opts.get("--step"), data=opts.get("--data"), split=opts.get("--split", "test"),
                       limit=opts.get("--limit"), in_domain=None if in_domain is None else
                       [s.strip() for s in in_domain.split(",") if s.strip()], engine=opts.get("--engine", "auto"),
                       batch=opts.get("--batch", 256), out=opts.get("--out"), fresh=bool(opts.get("--fresh")),
                       progress=cfg.logging.progress)
    except (ConfigError, DataError, FileNotFoundError, ExportError, CheckpointError) as exc:
        print(f"eval error: {exc}", file=sys.stderr)
        return 2
    print(res["markdown"])
    print(f"results: {os.path.join(res['out'], RESULTS_MD)}  {os.path.join(res['out'], RESULTS_JSON)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
