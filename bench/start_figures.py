"""What a comparison preset's warm-started policy does at the start of training, before any RL step.

    python -m bench.start_figures --config configs/compare_starved.yaml          # 128 prompts x 4 samples
    python -m bench.start_figures --config configs/compare_detour.yaml --prompts 128

Loads (or makes) the warm start ``python -m fastcredit.compare`` shares between its runs of that
config (``runs/<run_name>/warmstart``, the config's seed), then samples trajectories as a training
step does (``rollout.n_samples`` per prompt, temperature as configured) over training prompts drawn
with the config's seed, and scores greedy rollouts of the held-out questions (``eval.questions``).
Every search turn is labelled against the question's gold hops (``fastcredit.data.toyqa.new_hop_turns``:
good = it found a hop no earlier turn had found, else wasted). Reported: sampled and greedy EM, the
share of all-fail (and all-success) groups, the share of successes that contain a wasted search,
of failures that contain a good search, and *repairs*: a wasted search followed later in the same
trajectory by a good one (share of trajectories, and of successes). Written to
``<out>/start_<run_name>_<device>.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trajectory_figures(labels: list[list], success: list[bool], group: list[int]) -> dict:
    """The start figures of trajectories given, per trajectory, the label of each search turn in order (``good``,
    ``wasted`` or ``harmful``, ``fastcredit.data.lookup.search_labels``; True / False stand for good / wasted),
    whether it succeeded, and its group id. A *bad* search is a wasted or a harmful one."""
    labels = [[{True: "good", False: "wasted"}.get(x, x) if isinstance(x, bool) else x for x in t] for t in labels]
    n = len(labels)
    bad = [any(x != "good" for x in t) for t in labels]
    wasted = [any(x == "wasted" for x in t) for t in labels]
    harmful = [any(x == "harmful" for x in t) for t in labels]
    good = [any(x == "good" for x in t) for t in labels]
    repaired = [any(a != "good" and "good" in t[k + 1:] for k, a in enumerate(t)) for t in labels]
    groups: dict = {}
    for g, s in zip(group, success):
        groups.setdefault(g, []).append(s)
    wins = [k for k in range(n) if success[k]]
    losses = [k for k in range(n) if not success[k]]
    searches = max(sum(len(t) for t in labels), 1)

    def share(keys, flag) -> Optional[float]:  # None: no such trajectory
        keys = list(keys)
        return sum(flag[k] for k in keys) / len(keys) if keys else None

    return {
        "trajectories": n, "groups": len(groups),
        "sampled_em": sum(success) / max(n, 1),
        "all_fail_groups": sum(not any(v) for v in groups.values()) / max(len(groups), 1),
        "all_success_groups": sum(all(v) for v in groups.values()) / max(len(groups), 1),
        "searches_per_trajectory": sum(len(t) for t in labels) / max(n, 1),
        "wasted_search_share": sum(t.count("wasted") for t in labels) / searches,
        "harmful_search_share": sum(t.count("harmful") for t in labels) / searches,
        "successes_with_wasted_search": share(wins, wasted),
        "successes_with_bad_search": share(wins, bad),
        "failures_with_good_search": share(losses, good),
        "failures_with_harmful_search": share(losses, harmful),
        "trajectories_with_repair": share(range(n), repaired),
        "successes_with_repair": share(wins, repaired),
        "repairs": sum(repaired),
    }


def retrieval_controls(searcher, examples: list, k: int) -> dict:
    """The lookup world's retrieval controls over the distinct entities ``examples`` ask about: the share whose
    gold query (``Sagul Gitris code``) retrieves the entity's passage within the run's top ``k``, and, of the
    entities with a decoy, what the careless surname-only query (``Gitris code``) puts first: the entity, its
    decoy, or another passage."""
    from fastcredit.data.lookup import gold_query, surname_query
    from fastcredit.data.toyqa import question_hops

    hops = {h["subject"]: h for ex in examples for h in question_hops(ex)}
    names = sorted(hops)
    gold = searcher([gold_query(n) for n in names])
    hit = [bool(set(hops[n]["passage_ids"]) & set(ids)) for n, (_, ids) in zip(names, gold)]
    decoyed = [n for n in names if hops[n].get("decoy_ids")]
    careless = searcher([surname_query(n) for n in decoyed])
    first = [ids[0] if ids else None for _, ids in careless]
    entity = sum(f in hops[n]["passage_ids"] for n, f in zip(decoyed, first))
    decoy = sum(f in hops[n]["decoy_ids"] for n, f in zip(decoyed, first))
    m = max(len(decoyed), 1)
    return {"entities": len(names), f"gold_query_hit_at_{k}": sum(hit) / max(len(names), 1),
            "careless_query_entity_first": entity / m, "careless_query_decoy_first": decoy / m,
            "careless_query_other_first": (len(decoyed) - entity - decoy) / m}


def lookup_controls(trainer, parts, cfg, info) -> dict:
    """The lookup world's controls: held-out EM with every search's observation removed and with random passages
    in its place (closed book: near chance if the answers come from retrieval), and :func:`retrieval_controls` on
    the held-out and the training questions."""
    from dataclasses import replace

    from fastcredit.rollout.agent import searcher_session
    from fastcredit.trainer.placement import evaluate_heldout

    out = {}
    for mode in ("none", "shuffled"):
        t0 = time.time()
        closed = replace(cfg, eval=replace(cfg.eval, observations=mode))
        em = evaluate_heldout(parts, closed, info, trainer.run.timer).get("eval/em")
        out[f"greedy_heldout_em_observations_{mode}"] = em
        print(f"greedy held-out EM with observations {mode}: {em:.3f} ({time.time() - t0:.0f} s)", flush=True)
    with searcher_session(parts.rollout.searcher):
        for split, examples in (("heldout", parts.shared.data.test), ("train", parts.shared.data.train)):
            got = retrieval_controls(parts.rollout.searcher, examples, cfg.retrieval.topk)
            out.update({f"{split}_{k}": v for k, v in got.items()})
    return out


def ig_openings(trainer, parts, cfg, info, result, examples) -> dict:
    """IG-Search's two answer openings on the sampled batch (``credit.igsearch.opening``, docs/methods.md §11):
    the gold answer's mean log-prob per token after each real observation, after the drawn counterfactual ones,
    and the mean gain, with the released opening (``\\n<answer>`` right after the observation) and with the
    policy's own (its think, then ``\\n<answer>``)."""
    import math
    import random

    from fastcredit.trainer.igscore import draw_observations, policy_thinks, score_information_gain

    golds = [list(ex.golden_answers) for ex in examples]
    draws = draw_observations(result.batch, cfg.credit.igsearch.n_random, random.Random(cfg.seed))
    with parts.phases.rollout(weights=parts.weights):
        thinks = policy_thinks(parts.rollout.engine.generate, result.prompt_ids, result.batch, draws,
                               cfg.rollout.max_action_tokens)
    out = {}
    for name, opening in (("released", None), ("policy", thinks)):
        extras, m = score_information_gain(trainer.parts.training.policy, result.prompt_ids, result.batch, golds,
                                           parts.shared.tokenizer, cfg.credit.igsearch, info.device,
                                           cfg.optim.micro_batch_tokens, cfg.rollout.temperature, draws=draws,
                                           thinks=opening)
        ig = [x for x in extras["ig_S"].tolist() if not math.isnan(x)]
        out[f"ig_{name}_gold_logp_real"] = m.get("ig/logp_real_mean")
        out[f"ig_{name}_gold_logp_counterfactual"] = m.get("ig/logp_baseline_mean")
        out[f"ig_{name}_gain_mean"] = sum(ig) / len(ig) if ig else None
    out["ig_policy_think_closed"] = m.get("ig/opening_think_closed")
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", required=True, help="a comparison preset (configs/compare*.yaml)")
    p.add_argument("--prompts", type=int, default=128, help="training prompts sampled (each rollout.n_samples times)")
    p.add_argument("--runs", default=None, help="the comparison's runs folder (default runs/<run_name>): its warm "
                                                "start is loaded from <runs>/warmstart")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"), help="where the results go")
    args, overrides = p.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        p.error(f"unknown argument(s): {' '.join(bad)} (config overrides are key=value)")
    if args.prompts < 1:
        p.error(f"--prompts must be at least 1, got {args.prompts}")
    return args, overrides


def main(argv=None) -> int:
    from bench.results_io import device_name, write_results
    from fastcredit.config import ConfigError, load_config
    from fastcredit.credit.types import TurnKind
    from fastcredit.data.lookup import search_labels
    from fastcredit.distributed.process_group import init_distributed, shutdown
    from fastcredit.rollout.agent import searcher_session
    from fastcredit.trainer.checks import check_run
    from fastcredit.trainer.build import colocated_trainer
    from fastcredit.trainer.sampling import outcome_rewards, rollout

    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        base = load_config(args.config, overrides)
        runs = args.runs or os.path.join(ROOT, "runs", base.run_name)
        cfg = load_config(args.config, [*overrides, f"warmstart.seed={base.warmstart.seed_for(base.seed)}",
                                        f"warmstart.cache_dir={os.path.join(runs, 'warmstart')}",
                                        f"logging.output_dir={os.path.join(runs, 'start_figures')}",
                                        "logging.progress=false", "logging.tensorboard=false"])
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if cfg.data.source != "toy":
        print(f"config error: {args.config}: the start figures need the toy world's gold hops", file=sys.stderr)
        return 2
    try:
        check_run(cfg)  # the training command's checks, before anything loads
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    info = init_distributed()
    trainer = colocated_trainer(cfg, info)
    t0 = time.time()
    heldout = trainer.evaluate()
    print(f"greedy held-out EM {heldout.get('eval/em', float('nan')):.3f} "
          f"({cfg.eval.questions} questions, {time.time() - t0:.0f} s)", flush=True)
    parts = trainer.source.parts  # the rollout side: the engine, searcher and data
    train = parts.shared.data.train
    idx = random.Random(cfg.seed).sample(range(len(train)), min(args.prompts, len(train)))
    t0 = time.time()
    with searcher_session(parts.rollout.searcher):
        result, examples = rollout(parts, cfg, idx, train, group_size=cfg.rollout.n_samples,
                                   seed_base=cfg.seed * 1_000_003)
    reward, _ = outcome_rewards(cfg, result, examples)
    print(f"sampled {len(examples)} trajectories in {time.time() - t0:.0f} s", flush=True)
    labels = []
    for episode, ex in zip(result.episodes, examples):
        got = search_labels(ex, [s.retrieved_ids for s in episode.steps])
        labels.append([g for g, s in zip(got, episode.steps) if s.kind == TurnKind.SEARCH])
    figures = trajectory_figures(labels, [bool(e) for e in result.batch.em_B.tolist()],
                                 result.batch.group_id_B.tolist())
    figures["greedy_heldout_em"] = heldout.get("eval/em")
    figures["heldout_questions"] = min(cfg.eval.questions, len(parts.shared.data.test))
    if cfg.data.toy.kind == "lookup":
        figures.update(lookup_controls(trainer, parts, cfg, info))
        figures.update(ig_openings(trainer, parts, cfg, info, result, examples))
    trainer.logger.close()
    shutdown(info)  # FSDP2's one-process group
    device = device_name()
    doc = {"config": os.path.relpath(os.path.abspath(args.config), ROOT), "overrides": overrides,
           "prompts": len(idx), "n_samples": cfg.rollout.n_samples, "max_turns": cfg.rollout.max_turns,
           "warmstart": {"epochs": cfg.warmstart.epochs, "detour_fraction": cfg.warmstart.detour_fraction},
           "device": device, "figures": figures}
    stem = write_results(f"start_{cfg.run_name}", doc, args.out)[:-len(".json")]
    with open(stem + ".md", "w", encoding="utf-8") as fh:
        fh.write(f"# Start figures: {doc['config']} ({len(idx)} prompts x {cfg.rollout.n_samples} samples, "
                 f"{device})\n\n| figure | value |\n|---|---:|\n")
        fh.writelines(f"| {k} | {v:.3f} |\n" if isinstance(v, float) else f"| {k} | {v} |\n"
                      for k, v in figures.items())
    print(json.dumps(figures, indent=1))
    print(f"wrote {stem}.md")
    return 0


if __name__ == "__main__":
    from fastcredit.distributed.process_group import exit_process

    exit_process(main())
