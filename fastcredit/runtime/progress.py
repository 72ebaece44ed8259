"""Progress that suits where it goes: a tqdm bar on a terminal, plain lines in a log.

    bar = progress_bar(total=40, desc="train", unit="step")
    bar.set_postfix(loss="0.412", em="0.31"); bar.update(1)  # the figures first: a line printed by the update has them
    bar.close()

A bar redraws itself with carriage returns several times a second: on a terminal that is one line that moves, but
in a file (CI, a scheduler, ``nohup``, ``make demo > demo.log 2>&1``) every frame stays, and a long run's log
becomes one line of thousands of frames. So where the bar's stream (stderr) is not a terminal,
:class:`LineProgress` prints instead a plain line with the same figures, at most every ``LINE_EVERY_S`` seconds
and once at the end:

    train: 12/40 steps (30%), 1m02s elapsed, 5.15 s/step, loss=0.412, em=0.31

``FASTCREDIT_PROGRESS`` chooses against the guess: ``bar``, ``lines`` or ``off``; ``FASTCREDIT_PROGRESS_EVERY_S``
sets the lines' interval (default 30). :func:`quiet_library_bars` turns the libraries' own bars (transformers'
"Loading weights") off where lines are chosen.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable, Optional, TextIO

LINE_EVERY_S = 30.0
STYLES = ("bar", "lines", "off")


def progress_style(stream: Optional[TextIO] = None) -> str:
    """``bar`` where ``stream`` (default stderr, where the bars go) is a terminal, else ``lines``; the environment's
    ``FASTCREDIT_PROGRESS`` wins when set."""
    chosen = os.environ.get("FASTCREDIT_PROGRESS", "").strip().lower()
    if chosen:
        if chosen not in STYLES:
            raise ValueError(f"FASTCREDIT_PROGRESS={chosen!r}: valid: {', '.join(STYLES)}")
        return chosen
    stream = sys.stderr if stream is None else stream
    try:
        return "bar" if stream.isatty() else "lines"
    except (AttributeError, ValueError):  # a closed or foreign stream
        return "lines"


def quiet_library_bars() -> None:
    """Turn off the bars that libraries draw themselves (transformers' weight loading) unless bars are chosen."""
    if progress_style() == "bar":
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _count(x: float, scale: bool) -> str:
    """A count as tqdm shows it: whole, or with a k / M / G suffix (``unit_scale``)."""
    if not scale:
        return f"{x:g}" if isinstance(x, float) and not x.is_integer() else f"{int(x)}"
    for unit in ("", "k", "M", "G", "T"):
        if abs(x) < 1000:
            return f"{x:.1f}{unit}" if unit else f"{x:.0f}"
        x /= 1000
    return f"{x:.1f}P"


def _rate(x: float) -> str:
    """Three significant digits, a k / M / G suffix past a thousand."""
    for unit in ("", "k", "M", "G"):
        if abs(x) < 999.5:
            return f"{x:.3g}{unit}"
        x /= 1000
    return f"{x:.3g}T"


class LineProgress:
    """The part of tqdm's interface this project uses (``update``, ``set_postfix``, ``close``, ``n``, ``total``, a
    context manager), printing a plain line at most every ``every_s`` seconds and one at the end."""

    def __init__(self, total: Optional[float] = None, desc: str = "", unit: str = "it", initial: float = 0,
                 unit_scale: bool = False, disable: bool = False, file: Optional[TextIO] = None,
                 every_s: float = LINE_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.total, self.desc, self.unit, self.unit_scale = total, desc, unit, unit_scale
        self.n = self.start_n = initial
        self.disable, self.file, self.every_s, self.clock = disable, file, every_s, clock
        self.postfix = ""
        self.start = self.last = clock()
        self.printed: Optional[tuple] = None  # (n, postfix) of the last line printed
        self.closed = False

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        if not self.disable and self.clock() - self.last >= self.every_s:
            self._print()

    def set_postfix(self, ordered_dict: Optional[dict] = None, refresh: bool = True, **kwargs) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        """The last line (unless nothing moved, or the newest count and figures were just printed: a postfix set
        after the update that printed its line still gets a line)."""
        if self.closed:
            return
        self.closed = True
        if not self.disable and self.n != self.start_n and self.printed != (self.n, self.postfix):
            self._print()

    def line(self) -> str:
        """``desc: n/total unit (pct), elapsed, rate, postfix``."""
        elapsed = self.clock() - self.start
        unit = self.unit if self.unit.endswith("s") or len(self.unit) < 3 else self.unit + "s"  # q, B, it stay
        done = _count(self.n, self.unit_scale)
        if self.total:
            done += f"/{_count(self.total, self.unit_scale)} {unit} ({100 * self.n / self.total:.0f}%)"
        else:
            done += f" {unit}"
        parts = [done, f"{_duration(elapsed)} elapsed"]
        moved = self.n - self.start_n
        if moved > 0 and elapsed > 0:
            per = elapsed / moved
            parts.append(f"{per:.3g} s/{self.unit}" if per >= 1 else f"{_rate(moved / elapsed)} {self.unit}/s")
        if self.postfix:
            parts.append(self.postfix)
        return (f"{self.desc}: " if self.desc else "") + ", ".join(parts)

    def _print(self) -> None:
        stream = self.file if self.file is not None else sys.stderr
        print(self.line(), file=stream, flush=True)
        self.last, self.printed = self.clock(), (self.n, self.postfix)


def progress_bar(total: Optional[float] = None, desc: str = "", unit: str = "it", initial: float = 0,
                 unit_scale: bool = False, disable: bool = False, leave: bool = True, **tqdm_kwargs):
    """A tqdm bar where stderr is a terminal (:func:`progress_style`), else a :class:`LineProgress`; ``disable``
    silences either (``logging.progress: false``, or a rank other than 0)."""
    style = progress_style()
    if style == "bar":
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, initial=initial, unit_scale=unit_scale, disable=disable,
                    leave=leave, **tqdm_kwargs)
    every = os.environ.get("FASTCREDIT_PROGRESS_EVERY_S", "").strip()
    try:
        every_s = float(every) if every else LINE_EVERY_S
    except ValueError:
        raise ValueError(f"FASTCREDIT_PROGRESS_EVERY_S={every!r}: not a number of seconds") from None
    return LineProgress(total, desc, unit, initial, unit_scale, disable=disable or style == "off", every_s=every_s)
