"""bench/bench_step.py's report: the phases of both designs side by side, their time per token, what the steps did,
and whether the two designs did the same work (only then is a speed-up given).

A step's time is compared only at equal work: the same trajectories, or at least the same number of turns and of
tokens. bench_step freezes the policy (``optim.lr=0``, both designs from the same weights, checked by a hash), so
each design rolls out the same prompts with the same per-trajectory seeds every step; what still differs is each
design's own doing (Search-R1's turns decode past the tag, to the token cap, and are cut after). The report checks
it: when turns or response tokens per trajectory differ by more than ``COMPARABLE`` (5%), it says the steps are not
comparable instead of giving a ratio. Per phase it gives the time per trained token (``tokens/trained``: the prompt
and response tokens every pass and the update run over), and the generation time per decoded token (every token
the engine generated, the ones cut after a tag included: ``decoded_tokens_per_traj``).
"""
from __future__ import annotations

import math
import os
import statistics
from typing import Optional

from fastcredit.runtime.stats import mean_interval

DESIGNS = ("fastcredit", "searchr1_design")
COMPARABLE = 0.05  # the largest relative difference of turns or response tokens per trajectory at "equal work"
# (label, how it is read from a step's metrics row, top-level?)
TOP = (("rollout", ("time/rollout",)), ("reward", ("time/reward",)), ("judge", ("time/judge",)),
       ("old log-probs", ("time/old_logprobs",)), ("reference log-probs", ("time/ref_logprobs",)),
       ("values", ("time/values",)), ("advantage", ("time/advantage",)), ("update", ("time/update",)))
INSIDE = (("generation", ("time/rollout/generating",), ()),
          ("retrieval wait", ("time/rollout/retrieving",), ("time/rollout/overlap",)),
          ("weight sync", ("time/colocate/sync_weights",), ()),
          ("offload / reload", ("time/colocate/offload", "time/colocate/reload"), ()),
          ("engine sleep / wake", ("time/colocate/engine_sleep", "time/colocate/engine_wake"), ()))
# What each design's steps did (medians over the timed steps): a step without searches leaves the retrieval path,
# where the designs differ most, idle, so the report says how much it searched.
WORKLOAD = (("searches / trajectory", "searches_per_traj"), ("turns / trajectory", "turns_per_traj"),
            ("invalid turns / trajectory", "invalid_per_traj"), ("truncated trajectories", "truncated_frac"),
            ("response tokens / trajectory", "response_tokens_mean"),
            ("decoded tokens / trajectory", "decoded_tokens_per_traj"), ("trained tokens / step", "tokens/trained"),
            ("format followed", "format_ok"),
            # the engine's steps (issue 60 item 6: what a decoded token costs depends on them)
            ("sequences in flight / engine step", "engine/seqs_per_step"),
            ("the same, in steps that admit no request", "engine/decode_seqs_per_step"),
            ("prefilled prompt tokens / decoded token", "engine/prefill_per_decoded"),
            ("prefix-cache hit rate (prompt tokens)", "engine/prefix_hit_rate"),
            ("seconds in engine steps that admit requests", "engine/admit_step_s"),
            ("seconds in engine steps that admit none", "engine/decode_step_s"))
# the workload rows that must agree for the steps to be called the same work
MUST_AGREE = ("turns_per_traj", "response_tokens_mean")
RAN = 1e-3  # seconds: a phase whose median is below this in a design was not run there (paired_rounds)
ROUND = "bench/round"  # bench_step tags each step's row with the round (0-based) whose processes ran it


def _median(rows: list[dict], plus: tuple, minus: tuple = ()) -> float:
    return statistics.median(sum(r.get(k, 0.0) for k in plus) - sum(r.get(k, 0.0) for k in minus) for r in rows)


def _per(rows: list[dict], plus: tuple, minus: tuple, tokens) -> Optional[float]:
    """Median over the steps of (the phase's seconds / the step's ``tokens(row)``), in microseconds per token."""
    vals = [(sum(r.get(k, 0.0) for k in plus) - sum(r.get(k, 0.0) for k in minus)) / tokens(r) * 1e6
            for r in rows if tokens(r)]
    return statistics.median(vals) if vals else None


def trained_tokens(row: dict) -> float:
    return row.get("tokens/trained", 0.0)


def decoded_tokens(row: dict) -> float:
    return row.get("decoded_tokens_per_traj", 0.0) * row.get("trajectories", 0.0)


def phase_table(runs: dict, designs: tuple = DESIGNS) -> list[dict]:
    """Rows ``{phase, inside, <design>: median seconds, <design>_us_per_token, ratio}``: the top-level phases,
    "other", then the "of which" rows, the step and tokens/s. Per token: of a trained token, but the generation's of
    a decoded one. ``ratio``: ``designs[0]`` over ``designs[1]``."""
    table = []

    def add(label: str, inside: bool, plus: tuple, minus: tuple = ()) -> None:
        per = decoded_tokens if label == "generation" else trained_tokens
        table.append({"phase": label, "inside": inside, "per": "decoded" if per is decoded_tokens else "trained",
                      **{d: _median(runs[d]["rows"], plus, minus) for d in runs},
                      **{f"{d}_us_per_token": _per(runs[d]["rows"], plus, minus, per) for d in runs}})

    for label, keys in TOP:
        if any(k in r for run in runs.values() for r in run["rows"] for k in keys):
            add(label, False, keys)
    add("other", False, ("time/step",), tuple(k for _, keys in TOP for k in keys))
    for label, plus, minus in INSIDE:
        if any(k in r for run in runs.values() for r in run["rows"] for k in plus):
            add(label, True, plus, minus)
    add("step", False, ("time/step",))
    table.append({"phase": "tokens/s", "inside": False, "per": None,
                  **{d: _median(runs[d]["rows"], ("tokens_per_s",)) for d in runs}})
    a, b = designs
    for row in table:
        row["ratio"] = row[a] / row[b] if row[b] > 1e-9 else None
        pa, pb = row.get(f"{a}_us_per_token"), row.get(f"{b}_us_per_token")
        row["ratio_per_token"] = pa / pb if pa is not None and pb else None
    return table


def paired_rounds(runs: dict, designs: tuple = DESIGNS, phases: tuple = (), tokens=trained_tokens) -> list[dict]:
    """The phases' ratios paired by round, per trained token: in each round both designs ran in fresh processes
    minutes apart, so a round's ratio (of each design's median over its steps) cancels the machine's drift between
    rounds, which pooled medians do not. Rows ``{phase, rounds, ratio, lo, hi, per_round}``: the geometric mean of
    the rounds' ratios and its 95% interval (t over the rounds' log ratios). A phase one design does not run (its
    median under ``RAN``) and rows whose steps carry no ``ROUND`` tag (one round, or older reports) give no rows.
    ``phases``: ``(label, metric keys)`` pairs (default: the top-level ones and the step); ``tokens(row)``: the
    tokens a step's seconds are divided by (default: trained; :func:`decoded_tokens` for the generation)."""
    a, b = designs
    rounds = sorted({r[ROUND] for d in designs for r in runs[d]["rows"] if ROUND in r})
    out = []
    for label, keys in phases or (*TOP, ("step", ("time/step",))):
        if min(_median(runs[d]["rows"], keys) for d in designs) < RAN:  # a phase one design skips
            continue
        per_round = []
        for n in rounds:
            pa = _per([r for r in runs[a]["rows"] if r.get(ROUND) == n], keys, (), tokens)
            pb = _per([r for r in runs[b]["rows"] if r.get(ROUND) == n], keys, (), tokens)
            if pa is not None and pb:
                per_round.append(pa / pb)
        if len(per_round) < 2 or min(per_round) <= 0:
            continue
        mean, half = mean_interval([math.log(x) for x in per_round])
        out.append({"phase": label, "rounds": len(per_round), "ratio": math.exp(mean),
                    "lo": math.exp(mean - half), "hi": math.exp(mean + half), "per_round": per_round})
    return out


def workload(runs: dict) -> list[dict]:
    """Rows ``{what, key, <design>: median over the timed steps}`` of ``WORKLOAD``, the ones the runs logged."""
    return [{"what": label, "key": key, **{d: statistics.median(r[key] for r in runs[d]["rows"]) for d in runs}}
            for label, key in WORKLOAD if all(key in r for run in runs.values() for r in run["rows"])]


def comparability(rows: list[dict], designs: tuple = DESIGNS) -> tuple[bool, list[str]]:
    """``(same work, why not)``: turns and response tokens per trajectory within ``COMPARABLE`` of each other."""
    a, b = designs
    why = []
    for row in rows:
        if row["key"] not in MUST_AGREE:
            continue
        hi = max(row[a], row[b])
        diff = abs(row[a] - row[b]) / hi if hi > 0 else 0.0
        if diff > COMPARABLE:
            why.append(f"{row['what']} differ by {diff:.0%} ({row[a]:.2f} against {row[b]:.2f})")
    missing = [k for k in MUST_AGREE if k not in {r["key"] for r in rows}]
    why += [f"{k} was not logged" for k in missing]
    return not why, why


def headline(report: dict) -> str:
    """The one line a reader takes away: the equal-work ratio with its per-token ratio, or why there is none."""
    step = next(r for r in report["table"] if r["phase"] == "step")
    if not report["comparable"]:
        return ("not comparable: " + "; ".join(report["not_comparable"]) +
                f" (more than {COMPARABLE:.0%}): no speed-up is claimed from these steps")
    per = "" if step["ratio_per_token"] is None else f", {step['ratio_per_token']:.2f} per trained token"
    return f"equal-work step ratio fastcredit / Search-R1 design: {step['ratio']:.2f}{per}"


def _cell(v) -> str:
    return "" if v is None else f"{v:.2f}"


def markdown(report: dict, root: str) -> str:
    a, b = DESIGNS
    frozen = "policy frozen (optim.lr=0), the same start weights (sha256 " \
             f"{report['start_weights'][:12]}), " if report.get("frozen") else "the policy learning (--learning), "
    lines = [f"# Per-step time: fastcredit vs the Search-R1 design — {report['device']}", "",
             f"{report['shape']} policy, `{os.path.relpath(report['config'], root)}` "
             f"{' '.join(report['overrides']) or ''}; medians of {report['steps']} steps "
             f"({report.get('rounds', 1)} alternating rounds, each a fresh process per design with "
             f"{report['warmup']} warm-up step); {frozen}same seed, prompts and batch.", "",
             f"**{headline(report)}**", "",
             f"| phase | {a} (s) | {b} (s) | {a} / {b} | {a} (µs/token) | {b} (µs/token) | per token |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in report["table"]:
        name = f"&nbsp;&nbsp;of which: {row['phase']}" if row["inside"] else row["phase"]
        if row["phase"] in ("step", "tokens/s"):
            name = f"**{row['phase']}**"
        if row.get("per") == "decoded":
            name += " (per decoded token)"
        pa, pb = row.get(f"{a}_us_per_token"), row.get(f"{b}_us_per_token")
        lines.append(f"| {name} | {row[a]:.3f} | {row[b]:.3f} | {_cell(row['ratio'])} | {_cell(pa)} | {_cell(pb)} "
                     f"| {_cell(row.get('ratio_per_token'))} |")
    if report.get("workload"):
        lines += ["", "What the timed steps did (medians):", "", f"| | {a} | {b} |", "|---|---:|---:|"]
        lines += [f"| {w['what']} | {w[a]:.2f} | {w[b]:.2f} |" for w in report["workload"]]
        searches = [w for w in report["workload"] if w["key"] == "searches_per_traj"]
        if searches and max(searches[0][d] for d in DESIGNS) == 0:
            lines.append("\nNo trajectory searched: the retrieval path sat idle, so this step says little about "
                         "the designs' retrieval (a warm-started policy searches).")
    if report.get("paired"):
        lines += ["", f"Paired by round, per trained token: {a} / {b} in each round (both fresh processes, minutes "
                  "apart), their geometric mean and its 95% interval over the rounds:", "",
                  "| phase | rounds | ratio | 95% interval | each round |", "|---|---:|---:|---|---|"]
        lines += [f"| {p['phase']} | {p['rounds']} | {p['ratio']:.3f} | {p['lo']:.3f}–{p['hi']:.3f} | "
                  + " ".join(f"{x:.2f}" for x in p["per_round"]) + " |" for p in report["paired"]]
    for d in DESIGNS:
        peaks = ", ".join(f"{k} {v:.2f}" for k, v in report["runs"][d]["peak"].items()) or "n/a"
        lines.append(f"\n{d}: peak memory {peaks}; wall {report['runs'][d]['wall_s']:.1f} s for all its steps.")
    lines.append("\nTop-level phases add up to the step; \"of which\" rows are inside them (generation and retrieval "
                 "wait inside rollout; sync, moves and sleeps inside whichever phase needed them). Per token: "
                 "microseconds per trained token (prompt + response tokens of the step), the generation's per decoded "
                 "token (cut tokens included).")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["table"] if not r["inside"] and r["phase"] not in ("step", "tokens/s")]
    fig, ax = plt.subplots(figsize=(6, 4))
    bottom = [0.0, 0.0]
    for r in rows:
        ys = [r[d] for d in DESIGNS]
        ax.bar(DESIGNS, ys, bottom=bottom, label=r["phase"])
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax.set_ylabel("seconds per step (median)")
    ax.set_title(f"{report['shape']} on {report['device']}: {headline(report)}"[:110], fontsize=7)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
