"""The report of ``python -m fastcredit.compare``: one table and one plot over every finished run.

Per method (and noisy-judge variant): held-out EM at the start and at the end, mean ± 95%
interval over seeds (Student's t; one seed has no interval), the difference to GRPO paired by
seed with its interval, the mean held-out EM over the evaluations after step 0 (learning speed)
with its paired difference to GRPO, the steps to reach a threshold EM (mean over the seeds that reach it,
and how many do; paired with GRPO over the seeds where both reach it), how often the method's credit goes
against the trajectory's outcome, the median seconds per step and judge calls per step; then the credit
accuracy per turn (``CREDIT_METRICS``: each run's mean over its training steps, then mean ± 95% interval over
seeds, with the labels they were measured against) and its paired difference to GRPO; then what the policy does
at the start and at the end of training (``BEHAVIOUR_METRICS``: searches, turns and response tokens per trajectory,
sampled EM, well-formed share, each the mean over the first and the last ``STRETCH`` training steps), the end paired
with GRPO. Written to ``<out>/compare_<name>_<device>.{md,json,png}``.
"""
from __future__ import annotations

import glob
import json
import os
import statistics
from typing import Optional

from fastcredit.credit.accuracy import LABEL_SOURCES, LABELLED_METRICS
from fastcredit.runtime.profiling import device_name, device_slug
from fastcredit.runtime.stats import mean_interval

# The credit metrics of the second table (``credit/<name>`` in metrics.jsonl; docs/methods.md §0) and their headers.
# The labelled ones are measured against the toy world's gold labels, or a judge's (``credit/<name>/<judge>``).
CREDIT_METRICS = {"turn_auc": "turn AUC", "turn_auc_within": "AUC within trajectories",
                  "miscredit_frac/wasted_in_success": "wasted search in success, A > 0",
                  "miscredit_frac/good_in_failure": "good search in failure, A < 0",
                  "degenerate_adv_share": "advantage mass in same-outcome groups",
                  "all_fail_group_frac": "all-fail groups",
                  "all_fail_nonzero_frac": "all-fail groups with A ≠ 0"}
# What the sampled policy does (metrics.jsonl's training-step names) and their headers: the third table. A policy
# that keeps wasted searches which still succeed (what the turn-level papers say outcome-only GRPO reinforces)
# makes more searches and turns per trajectory for the same EM.
BEHAVIOUR_METRICS = {"searches_per_traj": "searches / trajectory", "turns_per_traj": "turns / trajectory",
                     "searches/wasted_per_traj": "wasted searches / trajectory",
                     "searches/harmful_per_traj": "harmful searches / trajectory",
                     "response_tokens_mean": "response tokens", "em": "sampled EM", "format_ok": "well-formed"}
STRETCH = 10  # training steps averaged at the start and at the end of a run for the third table


def read_metrics(path: str) -> list[dict]:
    """The run's metrics.jsonl lines (a torn last line, from a crash mid-write, is skipped)."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def credit_summary(rows: list[dict]) -> tuple[dict, Optional[str]]:
    """``(means, labels)``: each of ``CREDIT_METRICS`` averaged over the steps that logged it (None where none
    did), and the labels the labelled ones were measured against: ``gold`` (the toy world), the first judge
    whose suffixed names the run logged, or None."""
    def mean_of(key: str) -> Optional[float]:
        xs = [float(r[key]) for r in rows if key in r]
        return sum(xs) / len(xs) if xs else None

    means = {name: mean_of(f"credit/{name}") for name in CREDIT_METRICS}
    if any(means[name] is not None for name in LABELLED_METRICS):
        return means, "gold"
    for source in LABEL_SOURCES[1:]:
        judged = {name: mean_of(f"credit/{name}/{source}") for name in LABELLED_METRICS}
        if any(v is not None for v in judged.values()):
            return {**means, **judged}, source
    return means, None


def behaviour_summary(rows: list[dict], steps: int) -> tuple[dict, dict]:
    """``(start, end)``: each of ``BEHAVIOUR_METRICS`` averaged over the training steps 1..``STRETCH`` and over the
    last ``STRETCH`` (after ``steps - STRETCH``); None where no such step logged it."""
    def mean_of(key: str, keep) -> Optional[float]:
        xs = [float(r[key]) for r in rows if "reward" in r and key in r and keep(int(r.get("step", 0)))]
        return sum(xs) / len(xs) if xs else None

    return ({name: mean_of(name, lambda s: s <= STRETCH) for name in BEHAVIOUR_METRICS},
            {name: mean_of(name, lambda s: s > steps - STRETCH) for name in BEHAVIOUR_METRICS})


def summarize_run(rows: list[dict]) -> dict:
    """From a run's metrics lines: held-out EM by step, the median seconds per step (a run paused or sharing its
    cores for a while moves a median least), judge calls per step and share of advantage tokens against their
    trajectory's outcome (``credit/against_outcome_frac``) over the training steps, the credit-accuracy means
    (``credit``) with their labels (``credit_labels``; :func:`credit_summary`), and what the policy did at the start
    and at the end (``behaviour_start``, ``behaviour``; :func:`behaviour_summary`)."""
    em = {}
    secs, calls, against, steps, ig = [], [], [], 0, []
    for r in rows:
        step = int(r.get("step", 0))
        if "eval/em" in r:
            em[step] = float(r["eval/em"])
        if "time/step" in r:
            secs.append(float(r["time/step"]))
            if "time/ig_score" in r and float(r["time/step"]) > 0:  # a share within one step: the cores' load
                ig.append(float(r["time/ig_score"]) / float(r["time/step"]))  # moves both alike
        if "credit/against_outcome_frac" in r:
            against.append(float(r["credit/against_outcome_frac"]))
        if "reward" in r:  # a training step's line
            steps = max(steps, step)
            calls.append(sum(float(v) for k, v in r.items()
                             if k.endswith("/requests") or k == "proceed/critiqued_steps"))
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    credit, labels = credit_summary(rows)
    start, end = behaviour_summary(rows, steps)
    return {"eval_em": {str(k): em[k] for k in sorted(em)}, "steps": steps,
            "seconds_per_step": statistics.median(secs) if secs else None,
            "ig_score_share": statistics.median(ig) if ig else None,
            "judge_calls_per_step": mean(calls) or 0.0, "against_outcome_frac": mean(against),
            "credit": credit, "credit_labels": labels, "behaviour_start": start, "behaviour": end}


def load_results(runs: str, labels: list[str]) -> dict[str, list[dict]]:
    """``label → [summary of each finished seed]`` (labels without a finished run are left out): its result.json,
    summarised again from its metrics.jsonl where that is there, so a report rebuilt by newer code has every
    column."""
    out = {}
    for label in labels:
        rows = []
        for path in sorted(glob.glob(os.path.join(runs, label, "seed*", "result.json"))):
            with open(path, encoding="utf-8") as fh:
                row = json.load(fh)
            metrics = os.path.join(os.path.dirname(path), "metrics.jsonl")
            rows.append({**row, **summarize_run(read_metrics(metrics))} if os.path.exists(metrics) else row)
        if rows:
            out[label] = rows
    return out


def _curve(r: dict) -> list[tuple[int, float]]:
    return sorted((int(k), v) for k, v in r["eval_em"].items())


def final_em(r: dict) -> Optional[float]:
    """The run's last held-out EM; None for a run that never evaluated (``eval.every=0 eval.questions=0``)."""
    curve = _curve(r)
    return curve[-1][1] if curve else None


def start_em(r: dict) -> Optional[float]:
    """The run's first held-out EM (its warm start's); None for a run that never evaluated."""
    curve = _curve(r)
    return curve[0][1] if curve else None


def mean_after_start(r: dict) -> Optional[float]:
    """The mean held-out EM over the run's evaluations after step 0 (learning speed: the area under its curve);
    None for a run evaluated only at the start."""
    later = [em for s, em in _curve(r) if s > 0]
    return sum(later) / len(later) if later else None


def _paired(rows: list[dict], base: dict, value) -> tuple[list[float], Optional[float], Optional[float]]:
    """``(differences, mean, 95% half-width)`` of ``value(run) - base[seed]`` over the runs whose seed ``base``
    has (each method against GRPO's run of the same seed)."""
    diffs = [value(r) - base[r["seed"]] for r in rows if r["seed"] in base and value(r) is not None]
    return (diffs, *mean_interval(diffs)) if diffs else (diffs, None, None)


def steps_to(r: dict, threshold: Optional[float]) -> Optional[int]:
    """The first evaluated step (after 0) whose held-out EM reaches ``threshold``; None if none does (or there is no
    threshold: no run evaluated)."""
    if threshold is None:
        return None
    return next((s for s, em in _curve(r) if s > 0 and em >= threshold), None)


def summarize(results: dict[str, list[dict]], threshold: Optional[float]) -> dict:
    """The table's numbers per label, and the threshold used.

    ``vs_grpo`` pairs runs by seed: a seed gives every method the same warm start and the same prompts at every
    step, and every evaluation scores the same held-out questions, so the per-seed difference to GRPO's run is the
    comparison with the least noise; its interval is over those differences. Runs that never evaluated (held-out
    EM off) leave their EM columns empty (None); the rest of the table is theirs as well."""
    finals = {label: [em for em in map(final_em, rows) if em is not None] for label, rows in results.items()}
    evaluated = [label for label, ems in finals.items() if ems]
    if threshold is None and evaluated:
        base = "grpo" if "grpo" in evaluated else evaluated[0]
        threshold = sum(finals[base]) / len(finals[base])
    grpo = results.get("grpo", [])
    grpo_final = {r["seed"]: em for r in grpo if (em := final_em(r)) is not None}
    grpo_mean = {r["seed"]: mean_after_start(r) for r in grpo if mean_after_start(r) is not None}
    grpo_steps = {r["seed"]: steps_to(r, threshold) for r in grpo if steps_to(r, threshold) is not None}
    table = {}
    for label, rows in results.items():
        final, ci = mean_interval(finals[label]) if finals[label] else (None, None)
        starts = [em for em in map(start_em, rows) if em is not None]
        start = mean_interval(starts)[0] if starts else None
        speeds = [m for m in map(mean_after_start, rows) if m is not None]
        speed, speed_ci = mean_interval(speeds) if speeds else (None, None)
        reached = [s for s in (steps_to(r, threshold) for r in rows) if s is not None]
        secs = [r["seconds_per_step"] for r in rows if r.get("seconds_per_step") is not None]
        shares = [r["ig_score_share"] for r in rows if r.get("ig_score_share") is not None]
        against = [r["against_outcome_frac"] for r in rows if r.get("against_outcome_frac") is not None]
        other = label != "grpo"
        diffs, vs, vs_ci = _paired(rows, grpo_final, final_em) if other else ([], None, None)
        _, vs_speed, vs_speed_ci = _paired(rows, grpo_mean, mean_after_start) if other else ([], None, None)
        pairs, vs_steps, vs_steps_ci = (_paired(rows, grpo_steps, lambda r: steps_to(r, threshold)) if other
                                        else ([], None, None))
        table[label] = {
            "seeds": [r["seed"] for r in rows], "start_em": start, "final_em": final, "final_em_ci95": ci,
            "final_em_per_seed": finals[label], "vs_grpo": vs, "vs_grpo_ci95": vs_ci, "vs_grpo_seeds": len(diffs),
            "mean_em": speed, "mean_em_ci95": speed_ci, "mean_em_vs_grpo": vs_speed,
            "mean_em_vs_grpo_ci95": vs_speed_ci,
            "steps": max(r["steps"] for r in rows),
            "steps_to_threshold": sum(reached) / len(reached) if reached else None,
            "reached_threshold": f"{len(reached)}/{len(rows)}",
            "steps_to_threshold_vs_grpo": vs_steps, "steps_to_threshold_vs_grpo_ci95": vs_steps_ci,
            "steps_to_threshold_vs_grpo_seeds": len(pairs),
            "against_outcome_frac": sum(against) / len(against) if against else None,
            "seconds_per_step": sum(secs) / len(secs) if secs else None,
            "ig_score_share": sum(shares) / len(shares) if shares else None,
            "judge_calls_per_step": sum(r["judge_calls_per_step"] for r in rows) / len(rows),
            **credit_over_seeds(rows),
            **(credit_vs_grpo(rows, grpo) if other else {}),
            **behaviour_over_seeds(rows),
            **(behaviour_vs_grpo(rows, grpo) if other else {}),
        }
    return {"threshold": threshold, "methods": table}


def _field_vs_grpo(rows: list[dict], grpo: list[dict], field: str, names, labelled: bool = False) -> tuple:
    """``(means, half-widths, seeds)``: each of ``names`` in each run's ``field`` dict as the mean difference to
    GRPO's run of the same seed and its 95% half-width, over the seeds where both runs have it (``labelled``: and
    measured it against the same labels)."""
    means, cis, seeds = {}, {}, {}
    labels = {r["seed"]: r.get("credit_labels") for r in grpo}
    for name in names:
        base = {r["seed"]: (r.get(field) or {}).get(name) for r in grpo}
        base = {k: v for k, v in base.items() if v is not None}
        same = [r for r in rows if r["seed"] in base and (not labelled or r.get("credit_labels") == labels[r["seed"]])]
        diffs, means[name], cis[name] = _paired(same, base, lambda r, n=name: (r.get(field) or {}).get(n))
        seeds[name] = len(diffs)
    return means, cis, seeds


def _field_over_seeds(rows: list[dict], field: str, names) -> tuple[dict, dict]:
    """``(means, half-widths)``: each of ``names`` in each run's ``field`` dict over the seeds that have it (None
    without any)."""
    per = {name: [r[field][name] for r in rows if (r.get(field) or {}).get(name) is not None] for name in names}
    stats = {name: mean_interval(xs) if xs else (None, None) for name, xs in per.items()}
    return {k: v[0] for k, v in stats.items()}, {k: v[1] for k, v in stats.items()}


def credit_vs_grpo(rows: list[dict], grpo: list[dict]) -> dict:
    """``credit_vs_grpo`` / ``credit_vs_grpo_ci95`` / ``credit_vs_grpo_seeds``: each of ``CREDIT_METRICS`` as the
    mean difference to GRPO's run of the same seed and its 95% half-width, over the seeds where both runs logged it
    against the same labels (a difference between the gold labels and a judge's would compare two rulers)."""
    vs = _field_vs_grpo(rows, grpo, "credit", CREDIT_METRICS, labelled=True)
    return dict(zip(("credit_vs_grpo", "credit_vs_grpo_ci95", "credit_vs_grpo_seeds"), vs))


def credit_over_seeds(rows: list[dict]) -> dict:
    """``credit`` / ``credit_ci95``: each of ``CREDIT_METRICS`` as mean and 95% half-width over the seeds that
    logged it (None without any); ``credit_labels``: the labels the seeds used (``gold``, a judge, or several
    joined by ``+``; None without any). A result.json written before these metrics existed has none."""
    credit, ci = _field_over_seeds(rows, "credit", CREDIT_METRICS)
    labels = sorted({r["credit_labels"] for r in rows if r.get("credit_labels")})
    return {"credit": credit, "credit_ci95": ci, "credit_labels": "+".join(labels) or None}


def behaviour_over_seeds(rows: list[dict]) -> dict:
    """``behaviour_start`` (means) and ``behaviour`` / ``behaviour_ci95`` (the end: means and 95% half-widths)
    over the seeds, each of ``BEHAVIOUR_METRICS``."""
    start, _ = _field_over_seeds(rows, "behaviour_start", BEHAVIOUR_METRICS)
    end, ci = _field_over_seeds(rows, "behaviour", BEHAVIOUR_METRICS)
    return {"behaviour_start": start, "behaviour": end, "behaviour_ci95": ci}


def behaviour_vs_grpo(rows: list[dict], grpo: list[dict]) -> dict:
    """``behaviour_vs_grpo`` / ``_ci95`` / ``_seeds``: the end of ``BEHAVIOUR_METRICS`` paired with GRPO by seed."""
    vs = _field_vs_grpo(rows, grpo, "behaviour", BEHAVIOUR_METRICS)
    return dict(zip(("behaviour_vs_grpo", "behaviour_vs_grpo_ci95", "behaviour_vs_grpo_seeds"), vs))


def _fmt(x: Optional[float], spec: str = ".3f") -> str:
    return "–" if x is None else format(x, spec)


def _pm(x: Optional[float], ci: Optional[float], spec: str) -> str:
    return _fmt(x, spec) + ("" if x is None or ci is None else f" ± {ci:{spec.lstrip('+')}}")


def format_markdown(summary: dict, device: str, name: str) -> str:
    thr = summary["threshold"]
    lines = [f"# Turn-level credit at toy scale: `{name}` — {device}", "",
             "Held-out EM (greedy) of each method from the same warm start; mean ± 95% interval over seeds. "
             "*vs GRPO*: the mean per-seed difference to GRPO's run of the same seed (same warm start, prompts and "
             f"held-out questions) ± its 95% interval. Steps to EM ≥ {_fmt(thr)} (the default threshold is GRPO's "
             "final mean): mean over the seeds that reach it, and its per-seed difference to GRPO over the seeds "
             "where both reach it. *Against outcome*: share of advantage tokens whose sign is opposite to their "
             "trajectory's outcome in its group (0 for GRPO). *Mean EM*: the mean over the evaluations after step "
             "0, the area under the EM curve over the run's length (learning speed), with its per-seed difference to "
             "GRPO. *s / step*: the median over a run's steps, "
             "then the mean over seeds; *IG scoring*: the share of a step IG-Search's scoring forward takes "
             "(`time/ig_score` over `time/step` in each step, its median, then the mean over seeds).", "",
             "| method | seeds | EM at start | final EM | vs GRPO | mean EM | vs GRPO | steps to threshold (reached) | "
             "vs GRPO | against outcome | s / step | IG scoring | judge calls / step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, t in summary["methods"].items():
        lines.append(f"| {label} | {len(t['seeds'])} | {_fmt(t['start_em'])} | "
                     f"{_pm(t['final_em'], t['final_em_ci95'], '.3f')} | "
                     f"{_pm(t['vs_grpo'], t['vs_grpo_ci95'], '+.3f')} | "
                     f"{_pm(t.get('mean_em'), t.get('mean_em_ci95'), '.3f')} | "
                     f"{_pm(t.get('mean_em_vs_grpo'), t.get('mean_em_vs_grpo_ci95'), '+.3f')} | "
                     f"{_fmt(t['steps_to_threshold'], '.0f')} ({t['reached_threshold']}) | "
                     f"{_pm(t.get('steps_to_threshold_vs_grpo'), t.get('steps_to_threshold_vs_grpo_ci95'), '+.1f')} | "
                     f"{_fmt(t['against_outcome_frac'], '.3f')} | "
                     f"{_fmt(t['seconds_per_step'], '.1f')} | {_fmt(t.get('ig_score_share'), '.0%')} | "
                     f"{t['judge_calls_per_step']:.0f} |")
    return "\n".join(lines + [""] + credit_markdown(summary) + [""] + behaviour_markdown(summary)) + "\n"


def credit_markdown(summary: dict) -> list[str]:
    """The second table's lines: credit accuracy per turn, per method (docs/methods.md §0)."""
    lines = ["## Credit accuracy per turn", "",
             "Each run's mean over its training steps, then mean ± 95% interval over seeds. A search turn is good "
             "when it retrieved a gold passage of a hop no earlier turn had found, else wasted (*labels*: `gold`, "
             "the toy world's; a judge's name where the run had no gold hops); a turn's advantage A is the mean over "
             "its action tokens. *Turn AUC*: A as a classifier of good against wasted searches, over the batch; "
             "*within trajectories*: the same inside each trajectory holding both, averaged. *Wasted search in "
             "success, A > 0* and *good search in failure, A < 0*: the share of such turns credited the wrong "
             "way. *Advantage mass in same-outcome groups*: share of Σ|A| over tokens in groups whose samples all "
             "succeeded or all failed. *All-fail groups with A ≠ 0*: of the groups where every sample failed (GRPO's "
             "advantage is 0 there), the share in which some token's advantage is not. –: the runs logged none.", "",
             "| method | labels | " + " | ".join(CREDIT_METRICS.values()) + " |",
             "|---|---|" + "---:|" * len(CREDIT_METRICS)]
    for label, t in summary["methods"].items():
        credit, ci = t.get("credit") or {}, t.get("credit_ci95") or {}
        cells = [_pm(credit.get(name), ci.get(name), ".3f") for name in CREDIT_METRICS]
        lines.append(f"| {label} | {t.get('credit_labels') or '–'} | " + " | ".join(cells) + " |")
    paired = [(label, t) for label, t in summary["methods"].items() if any(t.get("credit_vs_grpo_seeds", {}).values())]
    if not paired:
        return lines
    lines += ["", "The same, as the mean per-seed difference to GRPO's run of the same seed ± its 95% interval (over "
              "the seeds where both runs logged the metric against the same labels; *seeds*: the most such seeds "
              "of any metric).", "",
              "| method | seeds | " + " | ".join(CREDIT_METRICS.values()) + " |",
              "|---|---:|" + "---:|" * len(CREDIT_METRICS)]
    for label, t in paired:
        vs, ci = t["credit_vs_grpo"], t["credit_vs_grpo_ci95"]
        cells = [_pm(vs.get(name), ci.get(name), "+.3f") for name in CREDIT_METRICS]
        lines.append(f"| {label} | {max(t['credit_vs_grpo_seeds'].values())} | " + " | ".join(cells) + " |")
    return lines


def behaviour_markdown(summary: dict) -> list[str]:
    """The third table's lines: what the sampled policy does at the start and at the end, and the end paired with
    GRPO (``BEHAVIOUR_METRICS``)."""
    spec = lambda name: ".1f" if name == "response_tokens_mean" else ".3f"  # noqa: E731
    lines = ["## What the policy does", "",
             f"Over the sampled training trajectories: the mean over the first {STRETCH} training steps → the mean "
             f"over the last {STRETCH}, each averaged over seeds, the end ± its 95% interval. *Wasted* and *harmful* "
             "searches: by the toy world's gold labels (a wasted search finds nothing new; a harmful one finds a "
             "needed entity's decoy, the lookup world's only). *Well-formed*: the share of trajectories that follow "
             "the tag format. –: the runs logged none.", "",
             "| method | " + " | ".join(BEHAVIOUR_METRICS.values()) + " |", "|---|" + "---:|" * len(BEHAVIOUR_METRICS)]
    for label, t in summary["methods"].items():
        start, end, ci = t.get("behaviour_start") or {}, t.get("behaviour") or {}, t.get("behaviour_ci95") or {}
        cells = [f"{_fmt(start.get(n), spec(n))} → {_pm(end.get(n), ci.get(n), spec(n))}" for n in BEHAVIOUR_METRICS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    paired = [(label, t) for label, t in summary["methods"].items()
              if any(t.get("behaviour_vs_grpo_seeds", {}).values())]
    if paired:
        lines += ["", f"The last {STRETCH} steps' means as the per-seed difference to GRPO's run of the same seed ± "
                  "its 95% interval.", "",
                  "| method | seeds | " + " | ".join(BEHAVIOUR_METRICS.values()) + " |",
                  "|---|---:|" + "---:|" * len(BEHAVIOUR_METRICS)]
        for label, t in paired:
            vs, ci = t["behaviour_vs_grpo"], t["behaviour_vs_grpo_ci95"]
            cells = [_pm(vs.get(n), ci.get(n), "+" + spec(n)) for n in BEHAVIOUR_METRICS]
            lines.append(f"| {label} | {max(t['behaviour_vs_grpo_seeds'].values())} | " + " | ".join(cells) + " |")
    return lines


def plot(results: dict[str, list[dict]], path: str, title: str) -> None:
    """Held-out EM against step: the mean per method and a band from the lowest to the highest seed; the methods
    with exact judges on the left, the noisy-judge variants (dashed) on the right, GRPO (black) on both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    noisy = [label for label in results if "+noise" in label]
    panels = [[label for label in results if "+noise" not in label]]
    if noisy:
        panels.append((["grpo"] if "grpo" in results else []) + noisy)
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), sharey=True, squeeze=False)
    colors = {}  # a method and its noisy-judge variant share a colour
    for ax, labels in zip(axes[0], panels):
        for label in labels:
            rows = results[label]
            steps = sorted(set.intersection(*(set(s for s, _ in _curve(r)) for r in rows)))
            if not steps:  # held-out EM off: nothing to draw for this method
                continue
            per = [[dict(_curve(r))[s] for r in rows] for s in steps]
            mean = [sum(v) / len(v) for v in per]
            base = label.split("+")[0]
            color = "black" if base == "grpo" else colors.setdefault(base, f"C{len(colors) % 10}")
            ax.plot(steps, mean, marker="o", ms=3, label=label, color=color, lw=2 if base == "grpo" else 1.3,
                    ls="--" if "+noise" in label else "-")
            if len(rows) > 1:
                ax.fill_between(steps, [min(v) for v in per], [max(v) for v in per], color=color, alpha=0.1)
        ax.set(xlabel="training step", ylabel="held-out EM (greedy)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # held-out EM off: no curves, no legend
            ax.legend(fontsize=8)
    # the band's note on a line of its own: one line with a long device name runs past a one-panel figure
    fig.suptitle(title + ("\nband: lowest to highest seed" if any(len(r) > 1 for r in results.values()) else ""),
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(runs: str, labels: list[str], out_dir: str, name: str, threshold: Optional[float] = None,
                 setting: str = "") -> list[str]:
    """Write the markdown table, the JSON and the PNG; returns their paths (nothing when no run has finished).
    ``setting``: how the runs shared the machine, shown after the device's name (e.g. two runs side by side)."""
    results = load_results(runs, labels)
    if not results:
        print(f"no finished runs under {runs}: nothing to report")
        return []
    # the machine the runs ran on, as each recorded it (runs from before that was recorded: this process's)
    devices = sorted({r.get("device") or device_name() for rows in results.values() for r in rows})
    slug = device_slug(devices[0])
    device = " / ".join(devices) + (f", {setting}" if setting else "")
    summary = summarize(results, threshold)
    base = os.path.join(out_dir, f"compare_{name}_{slug}")
    os.makedirs(out_dir, exist_ok=True)
    with open(base + ".md", "w", encoding="utf-8") as fh:
        fh.write(format_markdown(summary, device, name))
    with open(base + ".json", "w", encoding="utf-8") as fh:
        json.dump({"device": device, "name": name, **summary,
                   "curves": {k: [r["eval_em"] for r in rows] for k, rows in results.items()}}, fh, indent=1)
    plot(results, base + ".png", f"{name}: held-out EM ({device})")
    return [base + ".md", base + ".json", base + ".png"]
