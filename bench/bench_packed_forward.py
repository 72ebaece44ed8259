"""The actor's forward: padding-free packed ``[1, T]`` row vs the former right-padded ``[B, L]`` batch.

    python -m bench.bench_packed_forward               # tiny policy, 32 trajectories of mixed lengths
    python -m bench.bench_packed_forward --repeats 3    # a quick look

Legend: B trajectories, L the longest prompt + response, T the real tokens (Σ prompt + response).

The batch: ``--trajectories`` responses with log-uniform lengths in ``[--min-len, --max-len]``
(agent trajectories are skewed: a few long ones, many short), prompts of ``--prompt`` tokens.
The padded side is what ``fastcredit.trainer.update`` ran before: right-padded ``[B, L]`` ids with an
attention mask through the HF decoder (sdpa), then the hidden states gathered at each
response token's predictor and the same fused log-prob. The packed side is today's
``PolicyModel(model_inputs(...))``. Both run on copies of one model, input building
included, alternating in one process on the same batch; medians of ``--repeats``, for the
forward alone (no grad: old / reference log-probs) and forward + backward (the update).
tokens/s counts real tokens (T) on both sides. Results: ``bench/results/packed_forward_<device>.json``.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import time

import torch

from bench.results_io import device_name, write_results


class _Vocab:
    """What build_tiny_policy reads of a tokenizer."""

    eos_token_id, pad_token_id = 1, 0

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n


def make_batch(args):
    from fastcredit.rollout.trajectory import Turn, from_turns

    g = torch.Generator().manual_seed(args.seed)
    lo, hi = math.log(args.min_len), math.log(args.max_len)
    lens = [int(round(math.exp(lo + (hi - lo) * float(u)))) for u in torch.rand(args.trajectories, generator=g)]
    tok = lambda n: torch.randint(2, args.vocab, (n,), generator=g).tolist()  # noqa: E731
    batch = from_turns([[Turn(tok(n), "answer")] for n in lens], group_id=[0] * len(lens))
    return batch, [tok(args.prompt) for _ in lens]


def padded_logprobs(lm, prompts, batch, device, impl):
    """The former path: ``[B, L]`` + attention mask, hidden states gathered at ``(row_N, pos_N)``."""
    from fastcredit.models.logprob import linear_logprob

    B = batch.num_trajectories
    P_B = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    R_B = batch.seqlens_B.long()
    L = int((P_B + R_B).max())
    ids = torch.zeros((B, L), dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.as_tensor(p, dtype=torch.int64)
    row_N = torch.repeat_interleave(torch.arange(B), R_B)
    col_N = P_B[row_N] + torch.arange(batch.num_tokens) - batch.cu_seqlens.long()[:-1][row_N]
    ids[row_N, col_N] = batch.tokens_N.long()
    mask = (torch.arange(L)[None, :] < (P_B + R_B)[:, None]).long()
    hidden = lm.get_decoder()(input_ids=ids.to(device), attention_mask=mask.to(device),
                              use_cache=False).last_hidden_state
    return linear_logprob(hidden[row_N.to(device), (col_N - 1).to(device)], lm.get_output_embeddings().weight,
                          batch.tokens_N.long().to(device), configured=impl)


def _time(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _load_average() -> float:
    """1-minute load average (other processes on a shared machine skew timings; it is recorded)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def run(args) -> dict:
    from fastcredit.models.packed import PolicyModel, model_inputs
    from fastcredit.models.tiny import build_tiny_policy

    device = torch.device(args.device)
    load_before = _load_average()
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    lm = build_tiny_policy(_Vocab(args.vocab), hidden=args.hidden, layers=args.layers,
                           heads=args.heads).to(device, dtype)
    padded_lm, policy = copy.deepcopy(lm), PolicyModel(lm, args.impl)
    batch, prompts = make_batch(args)
    T = sum(len(p) for p in prompts) + batch.num_tokens
    L = max(len(p) + int(r) for p, r in zip(prompts, batch.seqlens_B))
    B = batch.num_trajectories

    def packed_fwd():
        return policy(model_inputs(prompts, batch, device))

    def padded_fwd():
        return padded_logprobs(padded_lm, prompts, batch, device, args.impl)

    def backward(fwd, model):
        def go():
            lp, ent = fwd()
            (lp.sum() + ent.sum()).backward()
            model.zero_grad(set_to_none=True)
        return go

    with torch.no_grad():  # the same numbers (and a warm-up of both)
        diff = float((packed_fwd()[0] - padded_fwd()[0]).abs().max())
    rows = []
    for mode in ("forward", "forward+backward"):
        if mode == "forward":
            sides = {"packed": packed_fwd, "padded": padded_fwd}
        else:
            lm.train(), padded_lm.train()
            sides = {"packed": backward(packed_fwd, lm), "padded": backward(padded_fwd, padded_lm)}
        times = {k: [] for k in sides}
        ctx = torch.no_grad if mode == "forward" else torch.enable_grad
        with ctx():
            for fn in sides.values():
                fn()  # warm-up
            for _ in range(args.repeats):  # alternating, so drift in the machine's load hits both sides
                for k, fn in sides.items():
                    times[k].append(_time(fn, device))
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"mode": mode, "packed_s": med["packed"], "padded_s": med["padded"],
               "packed_tokens_per_s": T / med["packed"], "padded_tokens_per_s": T / med["padded"],
               "speedup": med["padded"] / med["packed"]}
        rows.append(row)
        print(f"{mode:<17} packed {row['packed_tokens_per_s']:>10,.0f} tok/s   "
              f"padded {row['padded_tokens_per_s']:>10,.0f} tok/s   packed/padded throughput {row['speedup']:.2f}x",
              flush=True)
    return {"device": device_name(device.type), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "attention": lm.config._attn_implementation, "reference_attention": padded_lm.config._attn_implementation,
            "load_average_1min_before_after": [load_before, _load_average()],
            "dtype": str(dtype).replace("torch.", ""),
            "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "vocab": args.vocab},
            "shape": {"trajectories": B, "prompt": args.prompt, "response_len_min": int(batch.seqlens_B.min()),
                      "response_len_max": int(batch.seqlens_B.max()), "T_real_tokens": T, "padded_B_x_L": B * L,
                      "padding_fraction": 1 - T / (B * L), "repeats": args.repeats},
            "max_abs_logp_diff": diff, "results": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trajectories", type=int, default=32)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--impl", default="auto", help="loss.impl of the fused log-prob (both sides)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtype", default="",
                   help="model dtype (default: bfloat16 on CUDA, as training computes; float32 on the CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args)
    s = report["shape"]
    print(f"device: {report['device']}; B={s['trajectories']}, T={s['T_real_tokens']:,} real tokens, "
          f"B×L={s['padded_B_x_L']:,} padded ({s['padding_fraction']:.0%} padding); "
          f"max |Δlogp| {report['max_abs_logp_diff']:.1e}")
    write_results("packed_forward", report, args.out)


if __name__ == "__main__":
    main()
