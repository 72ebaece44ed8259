"""CPU benchmark of the credit estimators: vectorised vs a per-trajectory, per-token Python loop.

    python -m bench.bench_credit                 # B = 512 trajectories, 4 turns, 4,096 tokens each
    python -m bench.bench_credit --trajectories 64 --repeats 3   # a quick look
    pytest --benchmark-only bench/bench_credit.py       # (make bench) both providers at B = 64, 1,024 tokens each

Legend: N packed tokens, S turns, B trajectories.

The loop baseline is each estimator's reference (``fastcredit/credit/reference.py``; GiGPO's in
``gigpo.py``): Python loops over trajectories, turns and tokens writing one advantage per token, the
way the released CW-GRPO trainer fills its advantage tensor. The vectorised time
includes writing the per-token advantages too (``token_advantages``), although the
trainer's loss gathers per-turn advantages itself; both numbers are reported. Both
sides run in the same process, one after the other, on the same inputs; medians.
Results go to ``bench/results/credit_<cpu>.json``.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import pytest
import torch

from fastcredit.credit import CreditInputs, get_estimator
from fastcredit.config.credit import CreditConfig
from fastcredit.rollout.trajectory import observation_key
from bench.results_io import device_name, write_results

SEARCH, ANSWER = 0, 1
CHOICES = 3  # distinct observations a search turn of a group may show


def _variants() -> list[tuple[str, str, CreditConfig]]:
    """(label, estimator, config) rows; PPO and PiCA also with γλ < 1 (the blocked scan) and turn-level GAE."""
    rows = [(name, name, CreditConfig()) for name in ("grpo", "criticsearch", "cwgrpo", "proceed", "ppo", "pica",
                                                       "gigpo", "igsearch")]
    rows.append(("ppo γ=0.99 λ=0.95", "ppo", CreditConfig(gamma=0.99, lam=0.95)))
    rows.append(("pica γ=0.99 λ=0.95", "pica", CreditConfig(gamma=0.99, lam=0.95)))
    turn = CreditConfig()
    turn.pica.gae_level = "turn"
    rows.append(("pica turn-level", "pica", turn))
    finite = CreditConfig()
    finite.cwgrpo.alpha = 5.0
    rows.append(("cwgrpo α=5", "cwgrpo", finite))
    similar = CreditConfig()
    similar.gigpo.match, similar.gigpo.threshold = "similar", 0.9
    rows.append(("gigpo similar τ=0.9", "gigpo", similar))
    return rows


def _observations(B: int, turns: int, tokens: int, group: int, gen: torch.Generator):
    """``(obs_S, choice_S, pool)``: every search turn shows one of ``CHOICES`` observations of its group and turn
    (so GiGPO finds repeated anchor states, as retrieval does), each a random span of token ids in ``pool``."""
    G, per = -(-B // group), tokens / (2 * turns - 1)
    length_C = torch.floor((torch.rand(G, turns - 1, CHOICES, generator=gen) + 0.2) * per).long()
    pick_B = torch.randint(0, CHOICES, (B, turns - 1), generator=gen)
    obs_B = torch.gather(length_C[torch.arange(B) // group], 2, pick_B[..., None])[..., 0]
    choice_B = ((torch.arange(B) // group)[:, None] * (turns - 1) + torch.arange(turns - 1)) * CHOICES + pick_B
    pool = torch.randint(0, 151_936, (G * (turns - 1) * CHOICES, max(int(length_C.max()), 1)), generator=gen)
    return obs_B, choice_B, pool


def make_inputs(B: int, turns: int, tokens: int, group: int, seed: int = 0) -> CreditInputs:
    """B trajectories of ``turns`` turns (searches then an answer) and exactly ``tokens`` tokens each."""
    gen = torch.Generator().manual_seed(seed)
    S = B * turns
    obs_B, choice_B, pool = _observations(B, turns, tokens, group, gen)
    # Split the rest of each trajectory's tokens at random into per-turn action spans.
    share = torch.rand(B, turns, generator=gen) + 0.2
    action_B = torch.floor(share / share.sum(1, keepdim=True) * (tokens - obs_B.sum(1, keepdim=True))).long()
    action_B[:, -1] += tokens - action_B.sum(1) - obs_B.sum(1)
    action_S = action_B.reshape(-1)
    obs_S = torch.cat([obs_B, torch.zeros(B, 1, dtype=torch.long)], 1).reshape(-1)
    seg_len = action_S + obs_S
    start_S = torch.cumsum(seg_len, 0) - seg_len
    N = B * tokens
    turn_N = torch.repeat_interleave(torch.arange(S), seg_len)
    is_action = (torch.arange(N) - start_S[turn_N]) < action_S[turn_N]
    obs_N = ~is_action
    offset_N = torch.arange(N) - (start_S + action_S)[turn_N]
    choice_S = torch.cat([choice_B, torch.zeros(B, 1, dtype=torch.long)], 1).reshape(-1)
    tokens_N = torch.randint(0, 151_936, (N,), generator=gen)
    tokens_N[obs_N] = pool[choice_S[turn_N[obs_N]], offset_N[obs_N]]
    tokens, obs_start = tokens_N.tolist(), (start_S + action_S).tolist()
    key_S = torch.tensor([observation_key(tokens[a:a + n]) for a, n in zip(obs_start, obs_S.tolist())])
    kind_S = torch.full((B, turns), SEARCH, dtype=torch.int8)
    kind_S[:, -1] = ANSWER
    em_B = (torch.rand(B, generator=gen) < 0.4).float()
    return CreditInputs(
        reward_B=em_B.clone(), group_id_B=torch.arange(B) // group, em_B=em_B, seg_start_S=start_S,
        seg_action_len_S=action_S, seg_traj_S=torch.repeat_interleave(torch.arange(B), turns),
        seg_kind_S=kind_S.reshape(-1), seg_id_N=torch.where(is_action, turn_N, -1).to(torch.int32),
        demo_mask_N=(torch.rand(N, generator=gen) < 0.1) & is_action, tokens_N=tokens_N, seg_obs_len_S=obs_S,
        seg_obs_key_S=key_S,
        critic_label_S=torch.randint(0, 2, (S,), generator=gen).float(),
        critic_ok_B=torch.rand(B, generator=gen) < 0.95,
        judge_u_S=torch.randint(0, 2, (S,), generator=gen).float(),
        judge_v_S=torch.randint(0, 2, (S,), generator=gen).float(),
        prm_f0_B=torch.rand(B, generator=gen), prm_f_S=torch.rand(S, generator=gen),
        values_N=torch.randn(N, generator=gen), old_logp_N=-torch.rand(N, generator=gen),
        ref_logp_N=-torch.rand(N, generator=gen),
        # IG-Search: a gain on every search turn (NaN on answers), its query the middle half of the action
        ig_S=torch.where(kind_S.reshape(-1) == SEARCH, torch.randn(S, generator=gen), float("nan")),
        seg_query_start_S=action_S // 4, seg_query_len_S=action_S // 2,
    )


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _load_average() -> float:
    """1-minute load average (other processes on a shared machine skew timings; it is recorded)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def run(args) -> dict:
    load_before = _load_average()
    inputs = make_inputs(args.trajectories, args.turns, args.tokens, args.group)
    rows = []
    for label, name, cfg in _variants():
        vec, ref = get_estimator(name), get_estimator(name, reference=True)
        vec(inputs, cfg)  # warm-up (first-call allocations)
        estimator_s = _median_time(lambda: vec(inputs, cfg), args.repeats)
        per_token_s = _median_time(lambda: vec(inputs, cfg).token_advantages(inputs.seg_id_N), args.repeats)
        loop_s = _median_time(lambda: ref(inputs, cfg), args.loop_repeats)
        got = vec(inputs, cfg).token_advantages(inputs.seg_id_N)
        assert torch.allclose(got, ref(inputs, cfg).adv_N, rtol=1e-5, atol=1e-5), label  # same numbers
        rows.append({"estimator": label, "vectorised_s": estimator_s, "vectorised_per_token_s": per_token_s,
                     "loop_s": loop_s, "speedup": loop_s / per_token_s, "speedup_estimator_only": loop_s / estimator_s})
        print(f"{label:<20} {estimator_s * 1e3:9.2f} ms {per_token_s * 1e3:9.2f} ms {loop_s:9.2f} s "
              f"{loop_s / per_token_s:8.0f}x {loop_s / estimator_s:8.0f}x", flush=True)
    return {"device": device_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "load_average_1min_before_after": [load_before, _load_average()],
            "shape": {"trajectories": args.trajectories, "turns": args.turns, "tokens_per_trajectory": args.tokens,
                      "group": args.group, "N": args.trajectories * args.tokens, "repeats": args.repeats,
                      "loop_repeats": args.loop_repeats},
            "results": rows}


# make bench's shape: B 64, N 65,536 (a loop reference: 20 to 200 ms, three rounds)
CPU_SHAPE = {"trajectories": 64, "turns": 4, "tokens": 1024, "group": 8}
VARIANTS = {label: (name, cfg) for label, name, cfg in _variants()}


def _ascii_id(label: str) -> str:
    return label.translate(str.maketrans({"γ": "g", "λ": "l", "α": "a", "τ": "t", " ": "-"}))


@pytest.fixture(scope="module")
def cpu_inputs() -> CreditInputs:
    return make_inputs(CPU_SHAPE["trajectories"], CPU_SHAPE["turns"], CPU_SHAPE["tokens"], CPU_SHAPE["group"])


@pytest.mark.parametrize("provider", ("vectorised", "loop"))
@pytest.mark.parametrize("label", VARIANTS, ids=_ascii_id)
def test_credit(benchmark, cpu_inputs, label, provider):
    """One estimator's per-token advantages: vectorised (``token_advantages`` included) or its loop reference."""
    name, cfg = VARIANTS[label]
    benchmark.extra_info.update(device=device_name(), N=cpu_inputs.seg_id_N.numel(), **CPU_SHAPE)
    if provider == "loop":
        ref = get_estimator(name, reference=True)
        benchmark.pedantic(lambda: ref(cpu_inputs, cfg), rounds=3, warmup_rounds=0)
        return
    vec = get_estimator(name)
    got = benchmark(lambda: vec(cpu_inputs, cfg).token_advantages(cpu_inputs.seg_id_N))
    assert got.shape == cpu_inputs.seg_id_N.shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=512)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--loop-repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"device: {device_name()}; B={args.trajectories}, {args.turns} turns, {args.tokens} tokens each "
          f"(N={args.trajectories * args.tokens:,}); medians of {args.repeats} / {args.loop_repeats} runs")
    print(f"{'estimator':<20} {'vectorised':>12} {'+per-token':>12} {'loop':>11} {'speedup':>9} {'(est. only)':>9}")
    report = run(args)
    worst = min(r["speedup"] for r in report["results"])
    print(f"slowest ratio: {worst:.0f}x (target ≥ 50x); geometric mean: "
          f"{math.exp(statistics.mean(math.log(r['speedup']) for r in report['results'])):.0f}x")
    write_results("credit", report, args.out)


if __name__ == "__main__":
    main()
