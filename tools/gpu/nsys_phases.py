"""An nsys profile of the trainer as its per-phase table, side by side with the trainer's own timers.

    nsys profile -o prof --force-overwrite true -t cuda,nvtx --capture-range=cudaProfilerApi --capture-range-end=stop \\
        python -m fastcredit.train --config configs/debug.yaml --profile
    nsys stats -q -r nvtx_sum -f csv -o prof prof.nsys-rep      # writes prof_nvtx_sum.csv
    python -m tools.gpu.nsys_phases prof_nvtx_sum.csv --metrics OUTPUT_DIR/metrics.jsonl --steps 3,4,5

``--profile`` opens the capture window before the trainer's third step and closes it three steps later
(steps 3, 4, 5 of metrics.jsonl), and every phase of a step is an NVTX push/pop range of the domain
``fastcredit`` (``fastcredit/runtime/profiling.py``): ``step`` around the whole step; inside it rollout, reward,
judge, old_logprobs, ref_logprobs, values, advantage, update; checkpoint and eval between steps; and the
colocation manager's sync_weights, switch_to_critic, offload, reload, engine_sleep, engine_wake, nested
inside those phases. The same phases are the ``time/<phase>`` (``time/colocate/<name>``) of metrics.jsonl.

Input: the CSV of nsys's ``nvtx_sum`` report (columns ``Time (%)``, ``Total Time (ns)``, ``Instances``,
``Avg (ns)``, ``Med (ns)``, ``Min (ns)``, ``Max (ns)``, ``StdDev (ns)``, ``Style``, ``Range``; the older
``nvtxsum`` / ``nvtxppsum`` reports lack ``Style``, some spell ``Time(%)``, ``Total Time``, ``Name``), or a
``.nsys-rep`` / ``.sqlite``, which this script hands to ``nsys stats`` itself. A range is named
``fastcredit:rollout``, ``:rollout`` (recent nsys when the domain's name was not captured) or ``rollout``
(older nsys); ranges of other domains and other names are listed under "other" in the JSON.

Output: a markdown table on stdout and in ``PREFIX.md``, the same numbers in ``PREFIX.json`` (``--out PREFIX``;
by default ``<csv stem>_phases`` next to the CSV). Per phase: nsys seconds per step (Total Time / number
of profiled steps: the Instances of ``step``, else ``--num-steps``), its share of the step, its instances, the
timers' seconds per step (the mean over the ``--steps`` rows of metrics.jsonl, a step without the key counting
0 s, as nsys's total does), and nsys / timers. The table is ``fastcredit.runtime.phase_table``'s, the one
``python -m fastcredit.train --profile`` writes from its torch.profiler trace (which adds the device time and the
heaviest kernels of each phase; nvtx_sum has neither). Bad input exits 2 with one line on stderr. Standard
library and that module (itself standard library only).
nsys sums a range over every process it traced: under torchrun each rank adds its own ``step``, so the
profiled steps counted are steps x ranks and the nsys column is per rank, as the timers are (rank means).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from fastcredit.runtime.phase_table import (InputError, RangeRow, build_rows, classify, markdown, num_profiled_steps,
                                            report)

NvtxRow = RangeRow  # an nvtx_sum row is one range's total
UNIT_NS = {"ns": 1.0, "nsec": 1.0, "us": 1e3, "usec": 1e3, "\u00b5s": 1e3, "\u03bcs": 1e3, "ms": 1e6,
           "msec": 1e6, "s": 1e9, "sec": 1e9}
TOTAL_RE = re.compile(r"^Total Time(?:\s*\((\S+)\))?$")


# ----------------------------------------------------------------------------------------------- nsys CSV
def _number(text: str, path: Path, line: int, column: str) -> float:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        raise InputError(f"{path}:{line}: column {column!r} holds {text!r}, not a number") from None


def _columns(header: list[str]) -> tuple[dict[str, int], float, list[str]]:
    """Indices of the needed columns (total, instances, range, style), the total's unit in ns, what is missing."""
    cells = [c.strip() for c in header]
    found, scale = {}, 1.0
    for i, cell in enumerate(cells):
        m = TOTAL_RE.match(cell)
        if m and "total" not in found and (m.group(1) is None or m.group(1) in UNIT_NS):
            found["total"], scale = i, UNIT_NS[m.group(1) or "ns"]  # unit-less "Total Time": ns, as documented
    for key, names in (("instances", ("Instances",)), ("range", ("Range", "Name")), ("style", ("Style",))):
        for name in names:
            if name in cells and key not in found:
                found[key] = cells.index(name)
    wanted = (("total", "Total Time (ns)"), ("instances", "Instances"), ("range", "Range"))
    return found, scale, [label for key, label in wanted if key not in found]


def parse_nvtx_csv(text: str, path: Path) -> list[NvtxRow]:
    """The rows of an ``nvtx_sum`` CSV; lines before its header (nsys's "Processing ..." notes) are skipped."""
    rows = list(csv.reader(io.StringIO(text.lstrip("\ufeff"))))
    best: Optional[tuple[int, dict, float, list]] = None
    for i, row in enumerate(rows):
        found, scale, missing = _columns(row)
        if best is None or len(missing) < len(best[3]):
            best = (i, found, scale, missing)
        if not missing:
            break
    if best is None or best[3]:
        missing = best[3] if best else ["Total Time (ns)", "Instances", "Range"]
        raise InputError(f"{path}: not an nvtx_sum CSV: no header with the column(s) {', '.join(missing)}")
    start, cols, scale, _ = best
    out = []
    for offset, row in enumerate(rows[start + 1:], start=start + 2):
        if not any(c.strip() for c in row):
            break  # the end of the table (another report may follow in a concatenated stdout)
        if len(row) <= max(cols.values()):
            raise InputError(f"{path}:{offset}: {len(row)} cells, the header has {len(rows[start])}")
        out.append(NvtxRow(range=row[cols["range"]].strip(),
                           style=row[cols["style"]].strip() if "style" in cols else "",
                           total_ns=round(_number(row[cols["total"]], path, offset, "Total Time") * scale),
                           instances=int(_number(row[cols["instances"]], path, offset, "Instances"))))
    return out


def _nsys_stats(rep: Path, prefix: Path) -> Path:
    """Run ``nsys stats`` on a .nsys-rep / .sqlite; the CSV it wrote."""
    nsys = shutil.which("nsys")
    if nsys is None:
        raise InputError(f"nsys is not on PATH, so {rep} cannot be read here: run `nsys stats -q -r nvtx_sum "
                         f"-f csv -o prof {rep}` where nsys is installed and pass the prof_nvtx_sum.csv it writes")
    said = ""
    for name in ("nvtx_sum", "nvtxsum"):  # the report's name in recent nsys, and in older ones
        done = subprocess.run([nsys, "stats", "-q", "-r", name, "-f", "csv", "-o", str(prefix), str(rep)],
                              capture_output=True, text=True)
        written = sorted(prefix.parent.glob(f"{prefix.name}_*.csv"))
        if done.returncode == 0 and written:
            return written[0]
        output = (done.stderr + done.stdout).strip().splitlines()
        said = output[-1] if output else f"exit status {done.returncode}"
    raise InputError(f"nsys stats wrote no nvtx_sum CSV for {rep} (does it hold NVTX ranges?): {said}")


def read_text(path: Path) -> str:
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None


def load_nvtx(path: Path) -> list[NvtxRow]:
    """The nvtx_sum rows of a CSV, or of a report run through ``nsys stats``."""
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    if path.suffix in (".nsys-rep", ".qdrep", ".sqlite"):
        with tempfile.TemporaryDirectory() as tmp:
            return parse_nvtx_csv(read_text(_nsys_stats(path, Path(tmp) / "report")), path)
    return parse_nvtx_csv(read_text(path), path)


# ------------------------------------------------------------------------------------------ metrics.jsonl
def load_step_rows(path: Path, steps: list[int]) -> dict[int, dict]:
    """The metrics of each asked-for step: its row with ``time/step`` (the last one, should a step repeat)
    plus the ``time/checkpoint`` the trainer logs on a line of its own; other rows (evaluation) are skipped,
    as is a torn last line."""
    lines = read_text(path).splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows: dict[int, dict] = {}
    checkpoint: dict[int, float] = {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i != last:
                print(f"nsys_phases: warning: {path}:{i + 1} is not JSON; skipped", file=sys.stderr)
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)):
            continue
        step = int(row["step"])
        if step not in steps:
            continue
        if "time/step" in row:
            rows[step] = row
        elif isinstance(row.get("time/checkpoint"), (int, float)):
            checkpoint[step] = checkpoint.get(step, 0.0) + row["time/checkpoint"]
    if not rows:
        raise InputError(f"{path}: no step row (one with time/step) for step(s) {', '.join(map(str, steps))}")
    for step, seconds in checkpoint.items():
        if step in rows:
            rows[step] = {**rows[step], "time/checkpoint": rows[step].get("time/checkpoint", 0.0) + seconds}
    return rows


# ------------------------------------------------------------------------------------------------- main
def parse_steps(text: str) -> list[int]:
    """``3,4,5`` or ``3-5`` (or a mix) -> [3, 4, 5]."""
    steps: list[int] = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            lo, _, hi = part.partition("-")
            steps += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of step numbers: {text!r} (e.g. 3,4,5 or 3-5)") from None
    if not steps:
        raise argparse.ArgumentTypeError("no step given")
    return sorted(set(steps))


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer: {text!r}")
    return int(text)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Per-phase table of an nsys profile of fastcredit.train, "
                                            "compared with the trainer's timers (metrics.jsonl).")
    p.add_argument("profile", type=Path, help="nvtx_sum CSV of `nsys stats`, or a .nsys-rep / .sqlite")
    p.add_argument("--metrics", type=Path, help="the run's OUTPUT_DIR/metrics.jsonl")
    p.add_argument("--steps", type=parse_steps, default=[3, 4, 5],
                   help="the profiled steps of metrics.jsonl (default 3,4,5: what --profile captures)")
    p.add_argument("--num-steps", type=positive_int,
                   help="profiled steps, where the profile has no 'step' range to count")
    p.add_argument("--out", type=Path, help="write PREFIX.md and PREFIX.json (default: <csv stem>_phases "
                                            "next to the input)")
    return p.parse_args(argv)


def default_prefix(profile: Path) -> Path:
    return profile.with_name(f"{profile.stem}_phases")


def run(args: argparse.Namespace) -> int:
    nvtx_rows = load_nvtx(args.profile)
    phases, other = classify(nvtx_rows)
    metrics = load_step_rows(args.metrics, args.steps) if args.metrics else None
    n_steps, n_from = num_profiled_steps(phases, args.num_steps, str(args.profile))
    if args.num_steps is not None and n_from != "--num-steps" and args.num_steps != n_steps:
        print(f"nsys_phases: warning: --num-steps {args.num_steps} but {args.profile} has {n_steps} instances of the "
              f"step range; using {n_steps}", file=sys.stderr)
    if metrics is not None:
        absent = [s for s in args.steps if s not in metrics]
        if absent:
            print(f"nsys_phases: warning: {args.metrics} has no step row for step(s) "
                  f"{', '.join(map(str, absent))}; the timers are the mean over the others", file=sys.stderr)
        if len(metrics) != n_steps:
            print(f"nsys_phases: warning: {len(metrics)} step(s) of timers against {n_steps} profiled step(s)",
                  file=sys.stderr)
    rows = build_rows(phases, n_steps, metrics)
    info = {"source": "nsys", "profile": str(args.profile), "metrics": str(args.metrics) if args.metrics else None,
            "steps": args.steps, "steps_found": sorted(metrics) if metrics else [],
            "num_steps": n_steps, "num_steps_from": n_from, "device": None}
    table = markdown(rows, info)
    prefix = args.out or default_prefix(args.profile)
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{prefix}.md").write_text(table)
        Path(f"{prefix}.json").write_text(json.dumps(report(rows, other, info), indent=1) + "\n")
    except OSError as e:
        raise InputError(f"cannot write {prefix}.md / .json: {e.strerror or e}") from None
    sys.stdout.write(table)
    print(f"wrote {prefix}.md and {prefix}.json", file=sys.stderr)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except InputError as e:
        print(f"nsys_phases: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
