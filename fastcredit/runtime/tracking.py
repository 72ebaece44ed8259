"""Per-step metrics: a compact console table, ``metrics.jsonl``, TensorBoard, optional wandb, and a PNG;
and the run folder's own files (:func:`archive_previous_run` moves an earlier run's aside).

Only rank 0 writes. Every sink gets the same flat ``{name: float}`` dict; the console
shows a fixed selection (:data:`CONSOLE_KEYS`) so a line stays readable, the files keep
everything. ``metrics.jsonl`` is appended and flushed each step, so a crash loses nothing
already logged, and a resumed run appends after the last step it finished (lines of steps
past the checkpoint are dropped on resume: :meth:`MetricLogger.truncate_after`). ``curves.png`` has a
panel per group of curves (:data:`PANELS`: reward and EM, KL and entropy, gradient norm and clipping,
seconds per phase, throughput).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Iterable, Optional, Sequence


def _seconds(v: float) -> str:
    return f"{v:5.2f}" if v < 10 else f"{v:5.1f}" if v < 1000 else f"{v:5.0f}"


# (metric key, column title, format: a format string or a function of the value). The seconds: ``time`` the
# whole step; ``roll`` the rollout (generation and retrieval), ``retr`` the seconds a trajectory waited on the
# retriever (mean over trajectories, inside ``roll``), ``judge``, ``logp`` (old / reference log-probs and
# values), ``upd`` the update, ``sync`` the policy's weights streamed into the rollout engine (inside ``roll``).
CONSOLE_KEYS = (
    ("reward", "reward", "{:6.3f}"), ("em", "EM", "{:5.3f}"), ("f1", "F1", "{:5.3f}"),
    ("turns_per_traj", "turns", "{:5.2f}"), ("searches_per_traj", "search", "{:6.2f}"),
    ("actor/kl_ref", "KL", "{:8.2e}"), ("actor/entropy", "ent", "{:6.3f}"),
    ("actor/clipfrac", "clip", "{:5.3f}"), ("actor/grad_norm", "|g|", "{:6.2f}"),
    ("tokens_per_s", "tok/s", "{:6.0f}"), ("time/step", "time", _seconds),
    ("time/rollout", "roll", _seconds), ("time/rollout/retrieval_wait_per_traj", "retr", _seconds),
    ("time/judge", "judge", _seconds), ("time/old_logprobs", "logp", _seconds), ("time/update", "upd", _seconds),
    ("time/colocate/sync_weights", "sync", _seconds),
)


def _cell(fmt, v) -> str:
    return fmt(v) if callable(fmt) else fmt.format(v)


def _width(title: str, fmt) -> int:
    return max(len(title), len(_cell(fmt, 0.0)))


# What a run writes into its output folder (generated data such as the toy world and the
# tiny tokenizer stays: it is keyed by what it was built from and reused).
RUN_FILES = ("config.yaml", "metrics.jsonl", "curves.png", "checkpoints", "tensorboard", "wandb")


def archive_previous_run(out_dir: str) -> Optional[str]:
    """Move an earlier run's files out of the way of a fresh (not resumed) one; returns where, or None.

    Appending to its metrics.jsonl would mix two runs in one curve, and its ``latest``
    checkpoint would be what a crash of the new run resumes from. Nothing is deleted.
    """
    present = [n for n in RUN_FILES if os.path.exists(os.path.join(out_dir, n))]
    if present in ([], ["config.yaml"]):  # a config alone: a run that stopped before its first step
        return None
    dest = os.path.join(out_dir, "previous", time.strftime("%Y%m%d-%H%M%S"))
    while os.path.exists(dest):
        dest += "_"
    os.makedirs(dest)
    for name in present:
        os.replace(os.path.join(out_dir, name), os.path.join(dest, name))
    return dest


def write_line(text: str) -> None:
    """Print a line to stdout above any progress bar (tqdm clears and redraws the bar around it)."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class MetricLogger:
    """Writes step metrics to the enabled sinks (``logging.*`` of the config)."""

    def __init__(self, output_dir: str, jsonl: bool = True, tensorboard: bool = False, wandb: bool = False,
                 run_name: str = "fastcredit", config: Optional[dict] = None, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(output_dir, "metrics.jsonl") if jsonl else None
        self._tb = self._wandb = None
        self._header_printed, self._columns = False, set()
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        if wandb:
            try:
                import wandb as wandb_mod
            except ImportError as exc:
                raise RuntimeError("logging.wandb=true but the wandb package is not installed "
                                   "(pip install wandb, or set logging.wandb=false)") from exc
            self._wandb = wandb_mod.init(project="fastcredit", name=run_name, config=config or {},
                                         dir=output_dir, mode=os.environ.get("WANDB_MODE", "offline"))

    def truncate_after(self, step: int) -> None:
        """Drop the lines of steps after ``step`` (written by a run that died before its next checkpoint), and a
        last line the dying run left half-written."""
        if not self.enabled or not self.path or not os.path.exists(self.path):
            return
        with open(self.path) as f:
            keep = [line.rstrip("\n") + "\n" for line, row in _parsed(f) if row.get("step", 0) <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict, console: bool = True) -> None:
        if not self.enabled:
            return
        flat = {k: float(v) for k, v in metrics.items() if _finite(v)}
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **flat}) + "\n")
        if self._tb is not None:
            for k, v in flat.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(flat, step=step)
        if console:
            write_line(self.console_line(step, flat))

    def console_line(self, step: int, flat: dict) -> str:
        """The step's row of the console table, the header above it on the first row and whenever a column
        joins (a metric first logged at a later step, as the weight sync is); an absent value shows ``-``."""
        present = {key for key, _, _ in CONSOLE_KEYS if key in flat}
        cols = [c for c in CONSOLE_KEYS if c[0] in self._columns | present]
        row = f"{step:>5d} " + " ".join((_cell(fmt, flat[key]) if key in flat else "-").rjust(_width(title, fmt))
                                       for key, title, fmt in cols)
        if self._header_printed and present <= self._columns:
            return row
        self._header_printed, self._columns = True, self._columns | present
        return " step " + " ".join(title.rjust(_width(title, fmt)) for _, title, fmt in cols) + "\n" + row

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _parsed(lines: Iterable[str]) -> list[tuple[str, dict]]:
    """``(line, row)`` of each non-blank line of ``metrics.jsonl``. An unparsable last line is skipped: the write
    of a run killed mid-line, or of a step being logged while the file is read. One earlier in the file is not."""
    lines = [line for line in lines if line.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            out.append((line, json.loads(line)))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise
    return out


def read_metrics(path: str) -> list[dict]:
    """The rows of ``metrics.jsonl`` (``{"step": n, key: value, …}``), a torn last line skipped."""
    with open(path) as f:
        return [row for _, row in _parsed(f)]


# The panels of curves.png: (title, keys on the left axis, keys on a right axis of their own). ``prefix/*`` is
# every logged key one level below ``prefix``; "time/*" is drawn stacked (the step's phases), the other time
# keys as lines over it. A panel with nothing logged is left out.
PANELS = (
    ("reward and exact match", ("reward", "em", "eval/em", "eval/em/*"), ()),
    ("KL to reference | entropy", ("actor/kl_ref",), ("actor/entropy",)),
    ("gradient norm | clip fraction", ("actor/grad_norm", "critic/grad_norm"), ("actor/clipfrac",)),
    ("seconds per step", ("time/*", "time/step", "time/rollout/retrieval_wait_per_traj",
                          "time/colocate/sync_weights"), ()),
    ("throughput | turns per trajectory", ("tokens_per_s",), ("turns_per_traj", "searches_per_traj")),
)
LABELS = {"em": "train EM", "eval/em": "held-out EM", "time/step": "step (total)", "tokens_per_s": "tokens/s",
          "time/rollout/retrieval_wait_per_traj": "retrieval wait per trajectory",
          "time/colocate/sync_weights": "weight sync", "turns_per_traj": "turns / traj",
          "searches_per_traj": "searches / traj", "actor/kl_ref": "KL", "actor/entropy": "entropy",
          "actor/grad_norm": "policy grad norm", "critic/grad_norm": "critic grad norm",
          "actor/clipfrac": "clip fraction"}
# The stacked phases in the order a step runs them (others after, by name).
PHASES = ("rollout", "reward", "judge", "old_logprobs", "ref_logprobs", "values", "advantage", "update", "checkpoint",
          "eval")


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in rows if _finite(r.get(key)) and _finite(r.get("step"))]
    return [x for x, _ in pts], [y for _, y in pts]


def _expand(keys: Iterable[str], logged: set) -> list[str]:
    """``keys`` with each ``prefix/*`` replaced by the logged keys one level below ``prefix``, kept if logged."""
    out = []
    for key in keys:
        if key.endswith("/*"):
            below = sorted(k for k in logged if k.startswith(key[:-1]) and "/" not in k[len(key) - 1:])
            if key == "time/*":
                below = sorted((k for k in below if k != "time/step"),
                               key=lambda k: (PHASES.index(k[5:]) if k[5:] in PHASES else len(PHASES), k))
            out += below
        elif key in logged:
            out.append(key)
    return out


def _stack(ax, rows: list[dict], keys: list[str], colour) -> None:
    """The phases' seconds stacked per step (bars for a short run, areas for a long one)."""
    by_step: dict = {}  # a step's rows merged (its checkpoint and evaluation seconds come on rows of their own)
    for r in rows:
        if _finite(r.get("step")) and any(k in r for k in keys):
            by_step.setdefault(r["step"], {}).update(r)
    steps = sorted(by_step)
    ys = [[by_step[s][k] if _finite(by_step[s].get(k)) else 0.0 for s in steps] for k in keys]
    if len(steps) > 40:
        ax.stackplot(steps, ys, labels=[_label(k) for k in keys], colors=[colour(k) for k in keys], alpha=0.7)
        return
    width = 0.8 * min((b - a for a, b in zip(steps, steps[1:])), default=1)
    bottom = [0.0] * len(steps)
    for k, y in zip(keys, ys):
        ax.bar(steps, y, bottom=bottom, width=width, label=_label(k), color=colour(k), alpha=0.7)
        bottom = [b + v for b, v in zip(bottom, y)]


def _label(key: str) -> str:
    if key.startswith("eval/em/"):
        return f"held-out EM: {key[8:]}"
    return LABELS.get(key, key[5:] if key.startswith("time/") and key.count("/") == 1 else key)


def _lines(ax, rows: list[dict], keys: list[str], colour, style: str = "-") -> None:
    for key in keys:
        xs, ys = _series(rows, key)
        few = len(xs) < 30 or key.startswith("eval/")  # held-out points are sparse: mark each
        ax.plot(xs, ys, ":" if key.startswith("eval/em/") else style, marker="o" if few else None, markersize=3,
                label=_label(key), color=colour(key))
    if all(v >= 0 for k in keys for v in _series(rows, k)[1]):
        ax.set_ylim(bottom=0)


def _panel(ax, rows: list[dict], name: str, left: list[str], right: list[str]) -> None:
    keys = left + right
    colour = lambda k: f"C{keys.index(k) % 10}"  # noqa: E731  (the right axis continues the left's colours)
    stacked = [k for k in left if k.startswith("time/") and k.count("/") == 1 and k != "time/step"]
    if stacked:
        _stack(ax, rows, stacked, colour)
    _lines(ax, rows, [k for k in left if k not in stacked], colour)
    top, (handles, labels) = ax, ax.get_legend_handles_labels()
    phases = {_label(k) for k in stacked}
    first = sorted(range(len(labels)), key=lambda i: labels[i] not in phases)  # the stacked phases first
    handles, labels = [handles[i] for i in first], [labels[i] for i in first]
    if right:
        top = ax.twinx()
        _lines(top, rows, right, colour, style="--")
        more = top.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.set_title(name, fontsize=10, loc="left")
    ax.grid(alpha=0.3)
    top.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.1 if right else 1.01, 1.0))


def metrics_figure(rows: list[dict], first: Optional[Iterable[str]] = None, title: str = "",
                   panels: Optional[Sequence] = None):
    """A matplotlib figure of ``rows`` (:func:`read_metrics`): one panel per entry of ``panels`` (default
    :data:`PANELS`: ``(name, left keys, right keys)``, ``prefix/*`` for every key below it) that has data,
    over a shared step axis; ``first`` replaces the first panel's keys. Each panel's own axes carry its
    title (a right axis does not)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = list(PANELS if panels is None else panels)
    if first is not None:
        specs[0] = (specs[0][0], tuple(first), ())
    logged = {k for r in rows for k, v in r.items() if k != "step" and _finite(v)}
    panels = [(name, _expand(left, logged), _expand(right, logged)) for name, left, right in specs]
    panels = [p for p in panels if p[1] or p[2]]
    n = max(len(panels), 1)
    fig, axes = plt.subplots(n, 1, sharex=True, squeeze=False, figsize=(10, 0.6 + 2.4 * n), dpi=110)
    for panel, (ax,) in zip(panels, axes):
        _panel(ax, rows, *panel)
    if not panels:
        axes[0][0].text(0.5, 0.5, "no metrics logged yet", ha="center", va="center")
    axes[-1][0].set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_metrics(path: str, png: str, keys: Optional[Iterable[str]] = None, title: str = "") -> str:
    """Write ``png``, the curves of the ``metrics.jsonl`` at ``path`` (:func:`metrics_figure`; ``keys`` replaces
    the first panel's keys); returns ``png``."""
    fig = metrics_figure(read_metrics(path), keys, title)
    fig.savefig(png)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return png
