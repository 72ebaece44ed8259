"""Outcome and pivot labels of trajectories for PiCA's process reward model (PiCA App. A; docs/methods.md §6).

    python -m fastcredit.prm.label --config configs/debug.yaml --model scripted --questions 200 \\
        rollout.max_turns=4 rollout.max_action_tokens=64 rollout.max_obs_tokens=200 \\
        rollout.max_response_tokens=800 retrieval.max_passage_tokens=64        # a CPU, under a minute
    python -m fastcredit.prm.label --config configs/demo.yaml --model scripted:0.8 --labeller judge \\
        judges.backend=oracle
    python -m fastcredit.prm.label --model runs/pica --step 200 --samples 5 --out runs/prm_data/train.parquet
    python -m fastcredit.prm.label --config configs/pica.yaml --model ckpt/Qwen2.5-3B/ --labeller judge \\
        judges.backend=http judges.url=http://127.0.0.1:8001/v1 judges.model=deepseek-v3

For each question of the split (``--questions N``: N of them spread over the data sources) the
policy answers ``--samples`` times (PiCA samples 5) at ``rollout.temperature`` through the
training agent loop and retriever. A trajectory's outcome label is Search-R1's EM of its
extracted answer; its pivot labels, one per turn, come from

* ``--labeller rule`` (the toy world, and its default there): a turn is a pivot when it is a search
  whose retrieval brings a gold passage of a hop no earlier turn had found, i.e. it yields the gold
  sub-answer with its sub-query (``OracleBackend.pivots``);
* ``--labeller judge`` (the default elsewhere): the ``judges.backend`` judge (http, colocated, or
  oracle on the toy world) applies PiCA's Appendix A criteria against the question's gold
  decomposition (``metadata.hops`` [{query, answer}], or MuSiQue / StepSearch's
  ``metadata.question_decomposition`` [{question, answer}]), with the other judges' untrusted-text
  handling, re-asks (``credit.critic.retries``) and failure counts. A trajectory whose verdict never
  parses is dropped and counted, as PiCA's filtering drops structurally inconsistent ones.

``--model`` takes what ``fastcredit.eval`` takes (a Hugging Face folder, or a run folder with
``--step``), or ``scripted[:p]`` on the toy world: a noisy oracle (:class:`ScriptedPolicy`) that
searches each gold hop's sub-query with probability p (default 0.6), else a plausible wrong query,
then answers from what it has read, through the same agent loop and retriever; it makes PRM data
with successes and failures in under a minute on a CPU. The rows (``fastcredit.prm.data``) are written
atomically to ``--out`` (default ``runs/prm_data/<split>.parquet``), what ``fastcredit.prm.train`` reads.

Exit status: 0 done, 1 no trajectory could be labelled, 2 bad input (the message names it).
"""
from __future__ import annotations

import os
import random
import sys
import time
from typing import Optional, Sequence

import torch

from fastcredit.config import ConfigError, TrainConfig
from fastcredit.config.checks import check_paths
from fastcredit.data.loaders import DataError, QAExample
from fastcredit.data.toyqa import RELATIONS, fact_sentence, question_hops
from fastcredit.prm.data import LabelledTrajectory, write_labelled
from fastcredit.rollout.actions import INVALID_OBSERVATION
from fastcredit.rollout.engines.base import GenOutput

SYNOPSIS = ("python -m fastcredit.prm.label --config X.yaml --model DIR|runs/X|scripted[:p] [flags] "
            "[key=value ...]")
LABELLERS = ("rule", "judge")


def parser():
    """The command's line: the model, what to label and how, the config and its overrides."""
    from fastcredit.config import command_parser

    p = command_parser("python -m fastcredit.prm.label", __doc__, usage=SYNOPSIS, help_prefixes="rollout, judges",
                       config="the config (default: a run folder's config.yaml); key=value overrides after it")
    p.add_argument("--model", required=True, metavar="M",
                   help="a Hugging Face folder, a run folder (its checkpoint is exported, as fastcredit.eval does), "
                        "or scripted[:p]: the toy world's noisy oracle (p: chance of each gold sub-query, default 0.6)")
    p.add_argument("--step", type=int, metavar="N", help="with a run folder: the checkpoint step (default: the latest)")
    p.add_argument("--samples", type=int, default=5, metavar="N", help="trajectories per question (PiCA samples 5)")
    p.add_argument("--questions", type=int, metavar="N",
                   help="label N questions, spread evenly over the data sources (default: all of the split)")
    p.add_argument("--split", default="train", metavar="NAME", help="train | test")
    p.add_argument("--labeller", metavar="L",
                   help="rule (the toy world's gold facts; its default there) | judge (judges.backend; else the "
                        "default)")
    p.add_argument("--out", metavar="FILE", help="the parquet written (default runs/prm_data/<split>.parquet)")
    p.add_argument("--seed", type=int, metavar="S",
                   help="question choice and sampling seeds (default: the config's seed)")
    p.add_argument("--engine", default="auto", metavar="E", help="auto | vllm | hf, for a model folder (as "
                                                                 "fastcredit.eval)")
    p.add_argument("--batch", type=int, default=64, metavar="N", help="questions rolled out and labelled together")
    return p


# ------------------------------------------------------------------------------------------ labels


def sub_steps(ex: QAExample, where: str) -> list[tuple[str, str]]:
    """A question's golden ``(sub-query, sub-answer)`` pairs, from ``metadata.hops`` (the toy world) or
    ``metadata.question_decomposition`` (MuSiQue, StepSearch); a DataError naming ``where`` when it has neither."""
    meta = ex.metadata or {}
    for key, query in (("hops", "query"), ("question_decomposition", "question")):
        steps = meta.get(key)
        if not steps:
            continue
        try:
            return [(str(s[query]), str(s["answer"])) for s in steps]
        except (TypeError, KeyError):
            raise DataError(f"{where}: every entry of metadata.{key} needs {query!r} and 'answer', "
                            f"got {steps!r:.120}") from None
    raise DataError(f"{where}: no gold decomposition, which the pivot judge labels against: metadata.hops "
                    "[{query, answer}] (toy world) or metadata.question_decomposition [{question, answer}] "
                    "(MuSiQue / StepSearch)")


def rule_pivots(items: Sequence) -> list[list[int]]:
    """The toy world's pivot labels of each :class:`~fastcredit.judges.types.JudgeItem` (see the module docstring)."""
    from fastcredit.judges.oracle import OracleBackend

    oracle = OracleBackend()
    return [[int(p) for p in oracle.pivots(it)] for it in items]


def judge_pivots(labeller, items: Sequence, subs: Sequence) -> tuple[list[Optional[list[int]]], dict]:
    """``labeller`` (a :class:`~fastcredit.judges.runner.PivotLabeller`) on ``items`` against their golden
    ``subs``: per item its labels or None (no verdict parsed), and the labeller's running counts."""
    from fastcredit.judges.runner import run_sync

    return run_sync(labeller.label(items, subs))


def labelled_rows(episodes, examples, samples, pivots, labeller: str) -> list[LabelledTrajectory]:
    """One row per trajectory whose ``pivots`` entry is not None (episode ``b`` answers ``examples[b]``, its
    ``samples[b]``-th sample); the outcome is Search-R1's EM of the extracted answer."""
    from fastcredit.credit.rewards import score_trajectory

    rows = []
    for e, ex, k, piv in zip(episodes, examples, samples, pivots):
        if piv is None:
            continue
        o = score_trajectory(e.action_texts, ex.golden_answers, kind="em")
        turns = [{"action": s.action_text, "observation": s.obs_text} for s in e.steps]
        rows.append(LabelledTrajectory(ex.question, turns, int(o.em), list(piv), ex.data_source,
                                       list(ex.golden_answers), o.prediction or "", k, labeller))
    return rows


# ------------------------------------------------------------------------------------ scripted policy


class ScriptedPolicy:
    """The toy world's noisy oracle as a rollout engine (``--model scripted[:p]``).

    It reads its context as a policy does (decoded: the question, then the observations so far)
    and plays the question's gold hops in order: hop k's gold sub-query with probability ``p``,
    else a plausible wrong one (the hop's relation on another subject, or another question's
    sub-query); after the last hop it answers the gold answer when the last hop's fact is in what
    it has read, else another entity of that relation. Draws follow the request's seed (the agent
    loop moves a trajectory's seed every turn), so a dataset repeats under ``--seed``. An action
    longer than the request's ``max_tokens`` drops its think, then is cut as an engine cuts
    (``finish_reason="length"``, an invalid turn); a fact cut off by ``retrieval.max_passage_tokens``
    has not been read. So the limits decide what it can do: ``configs/debug.yaml``'s 16-token actions
    and 24-token passages leave it no success (the module docstring's first example lifts them).
    """

    weight_dtype = torch.float32  # what a colocated judge of its own is loaded in

    def __init__(self, tokenizer, examples: Sequence[QAExample], p: float = 0.6):
        if not 0.0 <= p <= 1.0:
            raise ConfigError(f"--model scripted:{p}: p is a probability, in [0, 1]")
        self.tokenizer, self.p = tokenizer, p
        self.by_question = {ex.question: ex for ex in examples if question_hops(ex)}
        hops = [h for ex in examples for h in question_hops(ex)]
        self.queries = sorted({h["query"] for h in hops})
        self.subjects = {r: sorted({h["subject"] for h in hops if h["relation"] == r}) for r in RELATIONS}
        self.objects = {r: sorted({h["answer"] for h in hops if h["relation"] == r}) for r in RELATIONS}

    def _question(self, text: str) -> QAExample:
        found = [ex for q, ex in self.by_question.items() if q in text]
        if not found:
            raise ValueError("the scripted policy was asked a question that is not in its toy world")
        return max(found, key=lambda ex: len(ex.question))

    def _wrong_query(self, hop: dict, rng: random.Random) -> str:
        others = [s for s in self.subjects[hop["relation"]] if s != hop["subject"]]
        queries = [q for q in self.queries if q != hop["query"]]
        if others and (rng.random() < 0.5 or not queries):
            return RELATIONS[hop["relation"]].query.format(s=rng.choice(others))
        return rng.choice(queries) if queries else f"{hop['subject']} trivia"

    def _wrong_answer(self, ex: QAExample, hop: dict, rng: random.Random) -> str:
        from fastcredit.credit.rewards import exact_match

        for _ in range(8):  # the pool holds the gold answer too: draw again when it is drawn
            entity = rng.choice(self.objects[hop["relation"]])
            if not exact_match(entity, ex.golden_answers):
                return entity
        return "nobody"

    def _one(self, context: Sequence[int], params) -> GenOutput:
        text = self.tokenizer.decode(list(context), skip_special_tokens=False)
        ex = self._question(text)
        read = text[text.index(ex.question) + len(ex.question):]  # the prompt's instructions come before it
        turn = read.count("</information>") + read.count(INVALID_OBSERVATION.strip())
        hops = question_hops(ex)
        rng = random.Random(f"{params.seed}/{ex.id}/{turn}")
        if turn < len(hops):
            query = hops[turn]["query"] if rng.random() < self.p else self._wrong_query(hops[turn], rng)
            think, tag = f"I need to find {query}.", f"<search> {query} </search>"
        else:
            found = fact_sentence(hops[-1]) in read
            answer = ex.golden_answers[0] if found else self._wrong_answer(ex, hops[-1], rng)
            think, tag = f"The answer is {answer}.", f"<answer> {answer} </answer>"
        for action in (f"<think>{think}</think>\n{tag}", tag):
            ids = list(self.tokenizer(action, add_special_tokens=False)["input_ids"])
            if len(ids) <= params.max_tokens:
                return GenOutput(ids, None, "stop", tag.rsplit(" ", 1)[-1])
        return GenOutput(ids[:params.max_tokens], None, "length")

    def generate(self, prompts, params) -> list[GenOutput]:
        params = params if isinstance(params, list) else [params] * len(prompts)
        return [self._one(p, q) for p, q in zip(prompts, params)]

    async def agenerate(self, prompt, params) -> GenOutput:
        return self._one(prompt, params)

    def close(self) -> None:
        pass


def scripted_p(model: str) -> Optional[float]:
    """``p`` of ``--model scripted[:p]``; None for any other model."""
    if model != "scripted" and not model.startswith("scripted:"):
        return None
    try:
        p = float(model.split(":", 1)[1]) if ":" in model else 0.6
    except ValueError:
        raise ConfigError(f"--model {model}: scripted:p takes a probability p, e.g. scripted:0.6") from None
    if not 0.0 <= p <= 1.0:
        raise ConfigError(f"--model {model}: p is a probability, in [0, 1]")
    return p


# ------------------------------------------------------------------------------------------ the command


def _check(cfg: TrainConfig, model: str, labeller: str, split: str, counts: dict) -> None:
    """Refuse bad requests before anything is loaded."""
    toy = cfg.data.source == "toy"
    for flag, n in counts.items():
        if n is not None and n < 1:
            raise ConfigError(f"{flag} must be at least 1, got {n}")
    if split not in ("train", "test"):
        raise ConfigError(f"--split {split!r}: valid: train, test")
    if labeller not in LABELLERS:
        raise ConfigError(f"--labeller {labeller!r}: valid: {', '.join(LABELLERS)}")
    if labeller == "rule" and not toy:
        raise ConfigError(f"--labeller rule labels pivots from the toy world's gold facts (data.source=toy), not "
                          f"data.source={cfg.data.source}: use --labeller judge with judges.backend=http or colocated")
    if labeller == "judge" and cfg.judges.backend == "none":
        raise ConfigError("--labeller judge asks the judge of judges.backend, which is none: set judges.backend=http "
                          "(judges.url, judges.model), colocated (judges.model) or oracle (the toy world)")
    if labeller == "judge" and cfg.judges.backend == "oracle" and not toy:
        raise ConfigError("judges.backend=oracle answers from the toy world's gold facts: it needs data.source=toy")
    if scripted_p(model) is not None and not toy:
        raise ConfigError(f"--model {model} is the toy world's noisy oracle: it needs data.source=toy, not "
                          f"data.source={cfg.data.source}")


def _open_policy(cfg: TrainConfig, model: str, step, engine: str, data, examples, progress: bool):
    """``(engine, searcher, device)`` for ``model`` (a folder or run as ``fastcredit.eval`` opens it, or scripted)."""
    from fastcredit.models.build import run_tokenizer
    from fastcredit.models.export import resolve_model
    from fastcredit.retrieval.searcher import make_searcher
    from fastcredit.rollout.build import open_policy

    p = scripted_p(model)
    if p is None:
        folder, _, _ = resolve_model(model, step)
        _, gen, searcher, kind, device = open_policy(cfg, folder, data.corpus, engine, progress)
        print(f"rolling out {folder} with the {kind} engine on {device}", flush=True)
        return gen, searcher, device
    if step is not None:
        raise ConfigError("--step applies to a run folder, not to --model scripted")
    check_paths(cfg, "model")  # the scripted policy rolls out with the config's tokenizer
    tokenizer = run_tokenizer(cfg, data, cfg.logging.output_dir)
    searcher, _ = make_searcher(cfg, tokenizer, data.corpus, progress=progress)
    print(f"rolling out the scripted toy-world policy (p = {p:g})", flush=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return ScriptedPolicy(tokenizer, examples, p), searcher, device


def _judge(cfg: TrainConfig, gen, device):
    """``(PivotLabeller, its backend)`` of ``judges.backend`` (refusals as ConfigError)."""
    from fastcredit.judges.phase import make_backend
    from fastcredit.judges.runner import PivotLabeller

    if cfg.judges.backend == "colocated" and not cfg.judges.model and isinstance(gen, ScriptedPolicy):
        raise ConfigError("judges.backend=colocated without judges.model is the policy judging itself; the scripted "
                          "policy cannot: set judges.model (a local judge folder) or judges.backend=http")
    try:
        backend = make_backend(cfg, gen, device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return PivotLabeller(backend, cfg.credit.critic.retries), backend


def sample_trajectories(cfg: TrainConfig, loop, exs: list, n: int, seed_base: int):
    """``n`` trajectories of each of ``exs`` through ``loop`` (an ``AgentLoop``), trajectory ``j`` sampled with seed
    ``seed_base + j``: ``(episodes, the example of each, the sample index of each)``."""
    from fastcredit.data.lookup import turn_budget
    from fastcredit.data.prompts import example_prompt_ids

    rep = [ex for ex in exs for _ in range(n)]
    ks = [k for _ in exs for k in range(n)]
    d = cfg.data
    prompts = example_prompt_ids(loop.tokenizer, rep, d.prompt_source, d.prompt_template, cfg.model.chat_template)
    metas = [{"question": ex.question, "golds": ex.golden_answers, "example": ex, "seed": (seed_base + j) % 2**31,
              "max_turns": turn_budget(ex)} for j, ex in enumerate(rep)]
    return loop.run(prompts, metas=metas).episodes, rep, ks


def _labeller_name(cfg: TrainConfig, labeller: str) -> str:
    if labeller == "rule":
        return "rule"
    return ":".join(["judge", cfg.judges.backend] + ([cfg.judges.model] if cfg.judges.model else []))


def _rates(rows: list) -> tuple[float, float]:
    """``(outcome rate, pivot rate)``: the share of trajectories answered right, and of turns that are pivots."""
    turns = sum(len(r.pivots) for r in rows)
    return (sum(r.outcome for r in rows) / max(len(rows), 1), sum(sum(r.pivots) for r in rows) / max(turns, 1))


def _label_chunks(cfg: TrainConfig, loop, examples, chosen, samples: int, batch: int, seed: int, judge, subs,
                  name: str) -> tuple[list, int, dict]:
    """Roll out and label ``chosen`` questions ``batch`` at a time: ``(rows, trajectories dropped, judge counts)``."""
    from fastcredit.judges.types import items_from_rollout

    rows, dropped, stats = [], 0, {}
    for k in range(0, len(chosen), batch):
        idx = chosen[k:k + batch]
        episodes, exs, ks = sample_trajectories(cfg, loop, [examples[i] for i in idx], samples,
                                                seed * 1_000_003 + k * samples)
        # pivot labels do not depend on the outcome: the judge is not shown it
        items = items_from_rollout(episodes, exs, [0.0] * len(exs), [None] * len(exs))
        if judge is None:
            pivots = rule_pivots(items)
        else:
            pivots, stats = judge_pivots(judge, items, [subs[i] for i in idx for _ in range(samples)])
        dropped += sum(p is None for p in pivots)
        rows += labelled_rows(episodes, exs, ks, pivots, name)
        outcome, pivot = _rates(rows)
        print(f"label: {k + len(idx)}/{len(chosen)} questions, {len(rows)} trajectories, outcome rate {outcome:.3f}, "
              f"pivot rate {pivot:.3f}, parse failures {stats.get('parse_failures', 0)}, dropped {dropped}", flush=True)
    return rows, dropped, stats


def label_dataset(cfg: TrainConfig, model: str, *, samples: int = 5, questions: Optional[int] = None,
                  split: str = "train", labeller: Optional[str] = None, out: Optional[str] = None,
                  seed: Optional[int] = None, step: Optional[int] = None, engine: str = "auto", batch: int = 64,
                  progress: bool = True) -> dict:
    """Roll out, label and write a PRM dataset (see the module docstring); returns the summary it prints.
    Nothing is written when no trajectory could be labelled."""
    from fastcredit.data.build import load_data
    from fastcredit.rollout.build import agent_loop
    from fastcredit.trainer.heldout import sample_per_source

    t0 = time.perf_counter()
    labeller = labeller or ("rule" if cfg.data.source == "toy" else "judge")
    seed = cfg.seed if seed is None else seed
    _check(cfg, model, labeller, split, {"--samples": samples, "--questions": questions, "--batch": batch})
    out = out or os.path.join("runs", "prm_data", f"{split}.parquet")
    check_paths(cfg, "data", "retrieval")  # the questions and the retriever's files, before anything loads
    data = load_data(cfg)
    examples = data.train if split == "train" else data.test
    if not examples:
        raise DataError(f"the {split} split has no questions")
    chosen = sample_per_source(examples, questions, seed) if questions else list(range(len(examples)))
    source = cfg.data.world_dir if cfg.data.source == "toy" else getattr(cfg.data, f"{split}_path")
    subs = {i: sub_steps(examples[i], f"{source}: {split} question {i} (id {examples[i].id!r})")
            for i in chosen} if labeller == "judge" else {}  # every question checked before anything rolls out
    gen, searcher, device = _open_policy(cfg, model, step, engine, data, examples, progress)
    judge = backend = None
    try:
        if labeller == "judge":
            judge, backend = _judge(cfg, gen, device)
        loop = agent_loop(cfg, gen, searcher, greedy=False)
        name = _labeller_name(cfg, labeller)
        rows, dropped, stats = _label_chunks(cfg, loop, examples, chosen, samples, batch, seed, judge, subs, name)
    finally:
        gen.close()
        own = getattr(backend, "engine", None)
        if own is not None and own is not gen:
            own.close()
    if rows:
        write_labelled(rows, out)
    outcome, pivot = _rates(rows)
    return {"out": out, "questions": len(chosen), "samples": samples, "trajectories": len(rows), "dropped": dropped,
            "outcome_rate": outcome, "pivot_rate": pivot, "turns": sum(len(r.pivots) for r in rows),
            "pivots": sum(sum(r.pivots) for r in rows), "labeller": name,
            "parse_failures": stats.get("parse_failures", 0), "judge_requests": stats.get("requests", 0),
            "seconds": time.perf_counter() - t0}


def main(argv: Optional[list] = None) -> int:
    from fastcredit.distributed.checkpoint import CheckpointError
    from fastcredit.models.export import ExportError, model_config

    args = parser().parse_args(argv)
    try:
        cfg = model_config(args.model, args.config, args.overrides)
        res = label_dataset(cfg, args.model, samples=args.samples, questions=args.questions, split=args.split,
                            labeller=args.labeller, out=args.out, seed=args.seed, step=args.step, engine=args.engine,
                            batch=args.batch, progress=cfg.logging.progress)
    except (ConfigError, DataError, FileNotFoundError, ExportError, CheckpointError) as exc:
        print(f"label error: {exc}", file=sys.stderr)
        return 2
    if not res["trajectories"]:
        print(f"label: no trajectory could be labelled ({res['dropped']} dropped: the judge's verdicts never parsed); "
              f"nothing written to {res['out']}", file=sys.stderr)
        return 1
    print(f"wrote {res['trajectories']} labelled trajectories to {res['out']} ({res['questions']} questions x "
          f"{res['samples']} samples, {res['dropped']} dropped; labeller {res['labeller']}): outcome rate "
          f"{res['outcome_rate']:.3f}, pivot rate {res['pivot_rate']:.3f} ({res['pivots']} of {res['turns']} turns), "
          f"judge parse failures {res['parse_failures']}, {res['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
