"""Per-step metrics: a compact console table, ``metrics.jsonl``, TensorBoard, optional wandb, and a PNG;
and the run folder's own files (:func:`archive_previous_run` moves an earlier run's aside).

Only rank 0 writes. Every sink gets the same flat ``{name: float}`` dict; the console
shows a fixed selection (:data:`CONSOLE_KEYS`) so a line stays readable, the files keep
everything. ``metrics.jsonl`` is appended and flushed each step, so a crash loses nothing
already logged, and a resumed run appends after the last step it finished (lines of steps
past the checkpoint are dropped on resume: :meth:`MetricLogger.truncate_after`).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Iterable, Optional

# (metric key, column title, format)
CONSOLE_KEYS = (
    ("reward", "reward", "{:6.3f}"), ("em", "EM", "{:5.3f}"), ("f1", "F1", "{:5.3f}"),
    ("turns_per_traj", "turns", "{:5.2f}"), ("searches_per_traj", "search", "{:6.2f}"),
    ("actor/kl_ref", "KL", "{:8.2e}"), ("actor/entropy", "entropy", "{:7.3f}"),
    ("actor/clipfrac", "clip", "{:5.3f}"), ("actor/grad_norm", "|g|", "{:7.3f}"),
    ("tokens_per_s", "tok/s", "{:7.0f}"), ("time/step", "step s", "{:6.1f}"),
)


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
        self._header_printed = False
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
        """Drop the lines of steps after ``step`` (written by a run that died before its next checkpoint)."""
        if not self.enabled or not self.path or not os.path.exists(self.path):
            return
        with open(self.path) as f:
            keep = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
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
        cols = [(title, fmt) for key, title, fmt in CONSOLE_KEYS if key in flat]
        row = f"{step:>5d} " + " ".join(fmt.format(flat[key]).rjust(max(len(title), 5))
                                       for key, title, fmt in CONSOLE_KEYS if key in flat)
        if not self._header_printed:
            self._header_printed = True
            header = " step " + " ".join(title.rjust(max(len(title), 5)) for title, _ in
                                         [(t, f) for t, f in cols])
            return header + "\n" + row
        return row

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(path: str, png: str, keys: Iterable[str] = ("reward", "em"), title: str = "") -> str:
    """A PNG of ``keys`` against step from ``metrics.jsonl`` (held-out EM points included when logged)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(path)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, label=key)
    ax.set_xlabel("step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return png
