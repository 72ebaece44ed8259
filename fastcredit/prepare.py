"""Data pipeline: toy world → Search-R1-format files → loaders → prompts → oracle replay.

    python -m fastcredit.prepare                                  # embedded defaults (toy world)
    python -m fastcredit.prepare --config configs/demo.yaml data.toy.seed=3
    python -m fastcredit.prepare --help data        # the data.* config keys

Run it before the first training run of a config, or after changing data.*: it writes the data
and checks the whole data path, so a broken file fails here rather than steps into a run.
The summary is printed and written to <logging.output_dir>/summary.json. Exit status: 0 ok,
1 an oracle trajectory did not score EM = 1, 2 bad config.

Steps (each timed and printed): save the merged config; generate the toy world and write
its corpus / QA / parquet files; read them back through the same loaders as Search-R1's
data; build the training prompts and the tokenizer; replay an oracle search trajectory for
every test question (each hop's gold sub-query, the gold passages as the observation, the
gold answer) through the reward code and the packed trajectory model; print a summary.
The replay is a consistency check of the whole data path: every oracle trajectory must be
well formed and score EM = 1, and a no-search guess must not.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from typing import Optional

from fastcredit.config import ConfigError, TrainConfig, command_parser, load_config, save_config
from fastcredit.config.checks import check_paths
from fastcredit.data.build import Data
from fastcredit.data.loaders import QAExample, iter_corpus, load_qa
from fastcredit.data.prompts import build_prompt
from fastcredit.data.toyworld import generate_world, write_world
from fastcredit.credit.rewards import score_trajectory
from fastcredit.models.build import run_tokenizer
from fastcredit.runtime.progress import quiet_library_bars


def format_observation(passages: list[tuple[str, str]]) -> str:
    """Search-R1's observation text for ``(title, text)`` passages (``Doc i(Title: "t") text``).

    The corpus reader drops the title's quotes; Search-R1 shows the ``contents`` field's
    first line, quotes included, so they are put back before formatting.
    """
    from fastcredit.retrieval.observation import format_observation as from_contents

    return from_contents(f'"{title}"\n{text}' for title, text in passages)


def oracle_turns(example: QAExample, passages: dict) -> list[tuple[str, str]]:
    """(action, observation) pairs of a trajectory that searches each gold hop, then answers."""
    from fastcredit.data.toyqa import oracle_actions

    hops = example.metadata.get("hops", [])
    return [(action, format_observation([passages[pid] for pid in hops[t]["passage_ids"] if pid in passages])
             if query is not None else "") for t, (action, query) in enumerate(oracle_actions(example))]


class _Timer:
    def __init__(self):
        self.t0 = time.perf_counter()

    def step(self, label: str) -> None:
        now = time.perf_counter()
        print(f"  {label:<44s} {now - self.t0:6.2f} s", flush=True)
        self.t0 = now


def _replay(examples: list[QAExample], passages: dict, tokenizer, prompts: list[str]):
    """Oracle and no-search trajectories → rewards → one packed TrajectoryBatch."""
    from fastcredit.rollout.trajectory import Turn, from_turns

    trajs, outcomes, guesses = [], [], []
    for ex in examples:
        turns = oracle_turns(ex, passages)
        outcomes.append(score_trajectory([a for a, _ in turns], ex.golden_answers))
        guesses.append(score_trajectory(["<answer>unknown</answer>"], ex.golden_answers))
        encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
        trajs.append([
            Turn(encode(a), "search" if o else "answer", encode(o) if o else ()) for a, o in turns
        ])
    batch = from_turns(
        trajs,
        group_id=list(range(len(trajs))),
        em=[o.em for o in outcomes],
        f1=[o.f1 for o in outcomes],
        format_ok=[o.format_ok for o in outcomes],
        predictions=[o.prediction for o in outcomes],
    )
    prompt_tokens = [len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
    return batch, outcomes, guesses, prompt_tokens


def run(cfg: TrainConfig) -> dict:
    """Run the pipeline; return the summary that is printed and written to summary.json."""
    timer, out_dir = _Timer(), cfg.logging.output_dir
    os.makedirs(out_dir, exist_ok=True)
    save_config(cfg, os.path.join(out_dir, "config.yaml"))
    if cfg.data.source == "toy":
        world = generate_world(cfg.data.toy)
        timer.step(f"toy world generated (seed {cfg.data.toy.seed})")
        write_world(world, cfg.data.world_dir)
        timer.step(f"files written to {cfg.data.world_dir}")
        train_path = os.path.join(cfg.data.world_dir, "train.parquet")
        test_path = os.path.join(cfg.data.world_dir, "test.jsonl")
        corpus_path = os.path.join(cfg.data.world_dir, "corpus.jsonl")
    else:
        train_path, test_path, corpus_path = cfg.data.train_path, cfg.data.test_path, cfg.retrieval.corpus
    train = load_qa(train_path)
    test = load_qa(test_path) if test_path else []
    timer.step(f"loaded {len(train)} train / {len(test)} test questions")
    passages = {pid: (title, text) for pid, title, text in iter_corpus(corpus_path)} if corpus_path else {}
    timer.step(f"read {len(passages)} passages")
    prompts = [build_prompt(ex.question, cfg.data.prompt_template) for ex in train]
    check_paths(cfg, "model")  # a missing tokenizer or model folder named by its key
    tokenizer = run_tokenizer(cfg, Data(train, test, corpus_path), out_dir)
    timer.step(f"tokenizer ready (vocabulary {len(tokenizer)})")
    replayed = [ex for ex in test if ex.metadata.get("hops")]
    batch, outcomes, guesses, prompt_tokens = _replay(replayed, passages, tokenizer, prompts)
    timer.step(f"replayed {batch.num_trajectories} oracle trajectories")
    summary = _summarise(cfg, train, test, passages, batch, outcomes, guesses, prompt_tokens)
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2, sort_keys=True)
    return summary


def _summarise(cfg, train, test, passages, batch, outcomes, guesses, prompt_tokens) -> dict:
    n = max(len(outcomes), 1)
    hops = Counter(len(ex.metadata.get("hops", [])) for ex in train + test)
    return {
        "passages": len(passages),
        "train_questions": len(train),
        "test_questions": len(test),
        "questions_by_hops": {str(k): v for k, v in sorted(hops.items())},
        "prompt_tokens_mean": sum(prompt_tokens) / max(len(prompt_tokens), 1),
        "prompt_tokens_max": max(prompt_tokens, default=0),
        "oracle_trajectories": batch.num_trajectories,
        "oracle_turns": batch.num_turns,
        "oracle_tokens": batch.num_tokens,
        "oracle_action_tokens": int(batch.action_mask_N.sum()),
        "oracle_em": sum(o.em for o in outcomes) / n,
        "oracle_format_ok": sum(o.format_ok for o in outcomes) / n,
        "oracle_reward": sum(o.reward for o in outcomes) / n,
        "no_search_guess_em": sum(g.em for g in guesses) / n,
        "output_dir": cfg.logging.output_dir,
    }


def parser():
    """The command's line: the config and its overrides."""
    return command_parser("python -m fastcredit.prepare", __doc__,
                          usage="python -m fastcredit.prepare [--config X.yaml] [key=value ...]",
                          config="the run's YAML (values only; default: the embedded defaults, the toy world)",
                          help_prefixes="data, data.toy")


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    quiet_library_bars()  # a log gets plain progress lines, not the libraries' bar frames
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    print(f"fastcredit.prepare: {args.config or 'embedded defaults'} → {cfg.logging.output_dir}")
    summary = run(cfg)
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        shown = f"{value:.3f}" if isinstance(value, float) else value
        print(f"  {key:<{width}s}  {shown}")
    if summary["oracle_trajectories"] and summary["oracle_em"] < 1.0:
        print("error: an oracle trajectory did not score EM = 1; the data path is inconsistent", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
