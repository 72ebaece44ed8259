"""Where turn-level credit pays, across worlds: each method's held-out EM gap to GRPO against a world setting (the
lookup world's K), from the reports of ``python -m fastcredit.compare`` run once per setting.

    python -m fastcredit.compare.sweep --point 1=bench/results/compare_lookup_k1_X.json \\
        --point 3=bench/results/compare_lookup_X.json --point 6=bench/results/compare_lookup_k6_X.json \\
        --name lookup_k --xlabel "K (entities per question)"

Each ``--point X=REPORT`` is one report's JSON (``compare_<name>_<device>.json``) at setting ``X``; every method
the reports hold besides GRPO gets a line: its final held-out EM minus GRPO's, paired by seed, with the 95%
interval of those differences (the report's ``vs_grpo`` and ``vs_grpo_ci95``), and the same for its mean EM over
the run's evaluations, the area under the EM curve (``mean_em_vs_grpo``): a method that learns faster and ends
level shows there. Written to ``<out>/sweep_<name>.{md,png}``: the plot (a panel each), and a table of the same
numbers each with GRPO's own figure at each point.
Exit status: 0 done, 2 bad arguments or a report that cannot be read.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_point(spec: str) -> tuple[float, dict]:
    """``X=PATH`` → ``(X, the report)``; a ValueError naming the argument or the file when it cannot be read."""
    x, sep, path = spec.partition("=")
    try:
        value = float(x)
    except ValueError:
        raise ValueError(f"--point {spec!r}: expected X=REPORT.json with a number X") from None
    if not sep or not path:
        raise ValueError(f"--point {spec!r}: expected X=REPORT.json")
    try:
        with open(path, encoding="utf-8") as fh:
            report = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read a comparison report ({exc})") from None
    if not isinstance(report.get("methods"), dict):
        raise ValueError(f"{path}: not a report of python -m fastcredit.compare (no 'methods')")
    return value, report


# what a gap is taken of: (its name, the report's figure, the paired difference to GRPO, its 95% half-width)
MEASURES = {"final": ("final EM", "final_em", "vs_grpo", "vs_grpo_ci95"),
            "mean": ("mean EM (area under the EM curve)", "mean_em", "mean_em_vs_grpo", "mean_em_vs_grpo_ci95")}


def gaps(points: list[tuple[float, dict]], measure: str = "final"
         ) -> dict[str, list[tuple[float, Optional[float], Optional[float], int]]]:
    """``method → [(X, gap to GRPO, its 95% half-width, seeds paired)]`` over the points that have the method, of
    the final EM (``measure="final"``) or of the mean EM over the run (``"mean"``)."""
    _, _, key, ci_key = MEASURES[measure]
    out: dict = {}
    for x, report in sorted(points, key=lambda p: p[0]):
        for label, row in report["methods"].items():
            if label == "grpo":
                continue
            out.setdefault(label, []).append((x, row.get(key), row.get(ci_key),
                                              int(row.get("vs_grpo_seeds") or 0)))
    return out


def _fmt(v: Optional[float], ci: Optional[float]) -> str:
    if v is None:
        return "–"
    return f"{v:+.3f}" + (f" ± {ci:.3f}" if ci is not None else "")


def markdown(points: list[tuple[float, dict]], name: str, xlabel: str) -> str:
    xs = sorted(p[0] for p in points)
    by_x = dict(points)
    lines = [f"# Gap to GRPO across {xlabel}: `{name}`"]
    grpo = [by_x[x]["methods"].get("grpo", {}) for x in xs]
    for measure, (what, own, _, _) in MEASURES.items():
        lines += ["", f"{what[0].upper() + what[1:]} on the held-out questions of each method minus GRPO's, paired "
                  "by seed, ± the 95% interval of the differences; GRPO's own (mean ± 95% interval over seeds) in "
                  "the first row.", "",
                  "| method | " + " | ".join(f"{x:g}" for x in xs) + " |", "|---|" + "---:|" * len(xs)]
        lines.append(f"| grpo ({what.split(' (')[0]}) | " + " | ".join(
            "–" if g.get(own) is None else f"{g[own]:.3f}" + (
                f" ± {g[own + '_ci95']:.3f}" if g.get(own + "_ci95") is not None else "") for g in grpo) + " |")
        for label, rows in gaps(points, measure).items():
            at = {x: (v, ci) for x, v, ci, _ in rows}
            lines.append(f"| {label} | " + " | ".join(_fmt(*at[x]) if x in at else "–" for x in xs) + " |")
    devices = sorted({p[1].get("device", "?") for p in points})
    return "\n".join(lines + ["", "Devices: " + "; ".join(devices), ""])


def plot(points: list[tuple[float, dict]], path: str, title: str, xlabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MEASURES), figsize=(12, 4.5), sharey=True)
    for ax, (measure, (what, _, _, _)) in zip(axes, MEASURES.items()):
        ax.axhline(0.0, color="black", lw=1.5, label="grpo")
        for k, (label, rows) in enumerate(gaps(points, measure).items()):
            rows = [r for r in rows if r[1] is not None]
            if not rows:
                continue
            xs = [r[0] for r in rows]
            ys = [r[1] for r in rows]
            err = [r[2] or 0.0 for r in rows]
            ax.errorbar([x + 0.04 * (k - 1) for x in xs], ys, yerr=err, marker="o", ms=4, capsize=3, label=label,
                        ls="--" if "+noise" in label else "-")
        ax.set(xlabel=xlabel, title=f"{title}: {what.split(' (')[0]}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("held-out EM − GRPO's (paired, 95% CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parser():
    """The command line: the reports, one per setting, and where the sweep's files go."""
    from fastcredit.config import command_parser

    p = command_parser("python -m fastcredit.compare.sweep", __doc__)
    p.add_argument("--point", action="append", required=True, metavar="X=REPORT",
                   help="a comparison report's JSON at setting X (repeat, one per setting)")
    p.add_argument("--name", default="sweep", help="the sweep's name (its files: sweep_<name>.md / .png)")
    p.add_argument("--xlabel", default="K", help="what the setting is, for the plot and the table")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"), help="where the files go")
    return p


def main(argv: Optional[list] = None) -> int:
    args = parser().parse_args(argv)
    try:
        points = [read_point(spec) for spec in args.point]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if len({x for x, _ in points}) != len(points):
        print("error: two --point arguments give the same setting", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"sweep_{args.name}")
    with open(base + ".md", "w", encoding="utf-8") as fh:
        fh.write(markdown(points, args.name, args.xlabel))
    plot(points, base + ".png", f"{args.name}: gap to GRPO", args.xlabel)
    print(f"wrote {base}.md and {base}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
