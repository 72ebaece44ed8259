"""``bench/race_trl.py``'s report: fastcredit against TRL's GRPOTrainer, the training side on identical tokens and
the rollout side each on its own generation, medians per phase and each phase paired by round.

Three runs side by side (each a fresh process in every round): ``fastcredit`` (its own steps, their batches
recorded), ``trl_replay`` (TRL training on those recorded batches: the same prompts, tokens, masks and rewards) and
``trl`` (TRL rolling out with its own ``rollout_func`` and training on that). The training side compares
``fastcredit`` with ``trl_replay`` per trained token: the reference log-probs, the update and the training step
(the step less its rollout, reward and judge phases). The rollout side compares ``fastcredit`` with ``trl``: the
rollout's seconds and the generation's seconds per decoded token, with what each rollout did beside them (their
tokens are not the same: each samples its own, so a rollout's seconds are compared only with its workload).
Rows use ``bench/step_report.py``'s arithmetic (medians, per-token medians, ``paired_rounds``).
"""
from __future__ import annotations

import os
import statistics

from bench.step_report import ROUND, decoded_tokens, paired_rounds, phase_table, trained_tokens, workload

TRAINING = ("fastcredit", "trl_replay")
ROLLOUT = ("fastcredit", "trl")
# the training side's phases: (label, metric keys), per trained token
TRAINING_PHASES = (("old log-probs", ("time/old_logprobs",)), ("reference log-probs", ("time/ref_logprobs",)),
                   ("update", ("time/update",)), ("training step", ("time/train_step",)))
ROLLOUT_PHASES = (("rollout", ("time/rollout",)),)
GENERATION = (("generation (per decoded token)", ("time/rollout/generating",)),)
NOT_TRAINING = ("time/rollout", "time/reward", "time/judge")


def add_training_step(rows: list) -> None:
    """Each step's ``time/train_step``: the step less its rollout, reward and judge phases (what is left runs on
    the batch once it is collected), in place."""
    for r in rows:
        r["time/train_step"] = r["time/step"] - sum(r.get(k, 0.0) for k in NOT_TRAINING)


def same_tokens(fastcredit_rows: list, replay_rows: list) -> list:
    """The steps (by number) where TRL's replay, in any round, trained another number of tokens than fastcredit's
    first round, the one it replays (empty: none)."""
    first = min((r.get(ROUND, 0) for r in fastcredit_rows), default=0)
    ours = {r["step"]: r.get("tokens/trained") for r in fastcredit_rows if r.get(ROUND, 0) == first}
    return sorted({r["step"] for r in replay_rows if ours.get(r["step"]) != r.get("tokens/trained")})


def build(runs: dict) -> dict:
    """The report's tables from ``runs`` (``{name: {"rows": [...]}}`` for the three runs)."""
    for run in runs.values():
        add_training_step(run["rows"])
    training = {d: runs[d] for d in TRAINING}
    rollout = {d: runs[d] for d in ROLLOUT}
    train_rows = [{"phase": label, **{d: _medians(runs[d]["rows"], keys) for d in TRAINING}}
                  for label, keys in TRAINING_PHASES]
    return {"training": {"step": train_rows, "paired": paired_rounds(training, TRAINING, TRAINING_PHASES),
                         "different_tokens": same_tokens(runs["fastcredit"]["rows"], runs["trl_replay"]["rows"])},
            "rollout": {"table": [r for r in phase_table(rollout, ROLLOUT)
                                  if r["phase"] in ("rollout", "generation", "retrieval wait")],
                        "paired": paired_rounds(rollout, ROLLOUT, ROLLOUT_PHASES)
                        + paired_rounds(rollout, ROLLOUT, GENERATION, tokens=decoded_tokens),
                        "workload": workload(rollout)}}


def _medians(rows: list, keys: tuple) -> dict:
    """The phase's median seconds and median microseconds per trained token over ``rows``."""
    secs = [sum(r.get(k, 0.0) for k in keys) for r in rows]
    per = [s / trained_tokens(r) * 1e6 for s, r in zip(secs, rows) if trained_tokens(r)]
    return {"s": statistics.median(secs), "us_per_token": statistics.median(per) if per else None}


def _f(v, digits: int = 3) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def _paired_lines(paired: list, a: str, b: str, per: str) -> list:
    if not paired:
        return ["", "(one round: no paired ratios; two rounds or more give them)"]
    lines = ["", f"Paired by round ({a} / {b} {per}, each round's two fresh processes minutes apart): the geometric "
             "mean of the rounds' ratios and its 95% interval.", "",
             "| phase | rounds | ratio | 95% interval | each round |", "|---|---:|---:|---|---|"]
    lines += [f"| {p['phase']} | {p['rounds']} | {p['ratio']:.3f} | {p['lo']:.3f}–{p['hi']:.3f} | "
              + " ".join(f"{x:.2f}" for x in p["per_round"]) + " |" for p in paired]
    return lines


def markdown(report: dict, root: str) -> str:
    t, ro = report["training"], report["rollout"]
    lines = [f"# fastcredit against TRL's GRPOTrainer (trl {report['trl']}) — {report['device']}", "",
             f"{report['shape']} policy, `{os.path.relpath(report['config'], root)}` {' '.join(report['overrides'])}; "
             f"{report['steps']} timed steps a run ({report['rounds']} rounds, each a fresh process of each run, "
             f"{report['warmup']} warm-up step first); policy frozen (optim.lr=0) from one start (sha256 "
             f"{report['start_weights'][:12]}), the same prompts each step.", "",
             "## The training side, on identical tokens", "",
             "TRL's `rollout_func` replays the batches fastcredit's rollout made (prompt and response ids, the "
             "observation mask, the rewards): "
             + ("every step's trained tokens are the same." if not t["different_tokens"] else
                f"**steps {t['different_tokens']} trained other token counts: not the same work.**")
             + (f" fastcredit's own rollouts in rounds {report['recordings_differ_in_rounds']} differed from round "
                "1's (the replay is round 1's)." if report.get("recordings_differ_in_rounds") else
                " fastcredit's rollouts were the same tokens in every round."), "",
             "| phase | fastcredit (s) | TRL (s) | fastcredit (µs/trained token) | TRL (µs/trained token) | "
             "per token |", "|---|---:|---:|---:|---:|---:|"]
    for row in t["step"]:
        a, b = row["fastcredit"], row["trl_replay"]
        ratio = a["us_per_token"] / b["us_per_token"] if a["us_per_token"] and b["us_per_token"] else None
        lines.append(f"| {row['phase']} | {a['s']:.3f} | {b['s']:.3f} | {_f(a['us_per_token'], 2)} | "
                     f"{_f(b['us_per_token'], 2)} | {_f(ratio, 2)} |")
    lines += _paired_lines(t["paired"], "fastcredit", "TRL", "per trained token")
    lines += ["", "## The rollout side, each trainer's own generation (HF engine)", "",
              "fastcredit's agent loop on its HF engine against TRL's `rollout_func` with `model.generate`; each "
              "samples its own tokens, so the seconds are read beside what the rollouts did (below), and the "
              "generation per decoded token compares the engines.", "",
              "| | fastcredit (s) | TRL (s) | fastcredit / TRL | fastcredit (µs/token) | TRL (µs/token) | per token |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for row in ro["table"]:
        name = row["phase"] + (" (per decoded token)" if row.get("per") == "decoded" else " (per trained token)")
        lines.append(f"| {name} | {row['fastcredit']:.3f} | {row['trl']:.3f} | {_f(row['ratio'], 2)} | "
                     f"{_f(row.get('fastcredit_us_per_token'), 1)} | {_f(row.get('trl_us_per_token'), 1)} | "
                     f"{_f(row.get('ratio_per_token'), 2)} |")
    lines += ["", "| what the rollouts did (medians) | fastcredit | TRL |", "|---|---:|---:|"]
    lines += [f"| {w['what']} | {w['fastcredit']:.2f} | {w['trl']:.2f} |" for w in ro["workload"]]
    lines += _paired_lines(ro["paired"], "fastcredit", "TRL", "per trained token, the generation per decoded token")
    for name, run in report["runs"].items():
        peaks = ", ".join(f"{k} {v:.2f}" for k, v in run["peak"].items()) or "n/a"
        lines.append(f"\n{name}: peak memory {peaks}; wall {run['wall_s']:.1f} s for all its steps.")
    return "\n".join(lines) + "\n"
