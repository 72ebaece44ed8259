"""Progress that suits where it goes (fastcredit.runtime.progress): a bar on a terminal; in a log, a plain line at most
every 30 s and one at the end, with the same figures. The trainer's own run with its output captured is checked in
tests/test_train.py (the grpo run)."""
import io

import pytest

from fastcredit.runtime import progress as P


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _lines(buf):
    return [x for x in buf.getvalue().split("\n") if x]


def test_lines_come_at_most_every_interval_and_once_at_the_end():
    clock, buf = Clock(), io.StringIO()
    bar = P.LineProgress(total=40, desc="train", unit="step", file=buf, clock=clock)
    for step in range(1, 41):
        clock.t += 5.0  # 5 s a step: a line every 6 steps (30 s), then the last one
        bar.update(1)
        bar.set_postfix(loss="0.4120", em="0.310")
    bar.close()
    bar.close()  # closing twice prints nothing more
    lines = _lines(buf)
    assert "\r" not in buf.getvalue()
    assert len(lines) == 40 * 5 // 30 + 1
    assert lines[0] == "train: 6/40 steps (15%), 30s elapsed, 5 s/step, loss=0.4120, em=0.310"
    assert lines[-1] == "train: 40/40 steps (100%), 3m20s elapsed, 5 s/step, loss=0.4120, em=0.310"


def test_the_last_line_has_the_last_steps_figures_whichever_order_they_are_set_in():
    """The trainer sets a step's figures, then counts the step; a caller that counts first and sets the figures after
    still ends with a line of the last step's figures (the update had printed the step before's)."""
    for figures_first in (True, False):
        clock, buf = Clock(), io.StringIO()
        bar = P.LineProgress(total=4, desc="train", unit="step", file=buf, clock=clock, every_s=10.0)
        for step in range(1, 5):
            clock.t += 5.0  # a line at steps 2 and 4 (10 s apart)
            if figures_first:
                bar.set_postfix(reward=f"0.{step}")
            bar.update(1)
            if not figures_first:
                bar.set_postfix(reward=f"0.{step}")
        bar.close()
        lines = _lines(buf)
        assert lines[-1] == "train: 4/4 steps (100%), 20s elapsed, 5 s/step, reward=0.4", figures_first
        assert len(lines) == (2 if figures_first else 3)  # counting first: the line of step 4 printed once more
        assert lines[0].endswith("reward=0.2" if figures_first else "reward=0.1")


def test_a_fast_bar_prints_its_rate_per_second_and_nothing_before_the_interval():
    clock, buf = Clock(), io.StringIO()
    with P.LineProgress(total=2_000_000, desc="embeddings", unit="passage", file=buf, clock=clock,
                        unit_scale=True) as bar:
        for _ in range(20):
            clock.t += 1.0
            bar.update(100_000)
    assert _lines(buf) == ["embeddings: 2.0M/2.0M passages (100%), 20s elapsed, 100k passage/s"]


def test_a_resumed_bar_counts_its_rate_from_where_it_started_and_a_bar_that_did_not_move_is_silent():
    clock, buf = Clock(), io.StringIO()
    bar = P.LineProgress(total=10, initial=8, desc="train", unit="step", file=buf, clock=clock)
    clock.t += 4.0
    bar.update(2)
    bar.close()
    assert _lines(buf) == ["train: 10/10 steps (100%), 4s elapsed, 2 s/step"]
    idle = io.StringIO()
    P.LineProgress(total=10, desc="x", file=idle, clock=clock).close()
    P.LineProgress(total=10, desc="y", file=idle, clock=clock, disable=True).update(3)
    assert idle.getvalue() == ""


def test_the_style_follows_the_stream_and_the_environment(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("FASTCREDIT_PROGRESS", raising=False)
    assert P.progress_style(Tty()) == "bar" and P.progress_style(io.StringIO()) == "lines"
    monkeypatch.setenv("FASTCREDIT_PROGRESS", "off")
    assert P.progress_style(Tty()) == "off"
    bar = P.progress_bar(total=3, desc="quiet")
    assert isinstance(bar, P.LineProgress) and bar.disable
    monkeypatch.setenv("FASTCREDIT_PROGRESS", "frames")
    with pytest.raises(ValueError, match="FASTCREDIT_PROGRESS='frames': valid: bar, lines, off"):
        P.progress_style()


def test_progress_bar_is_a_tqdm_on_a_terminal_and_lines_in_a_log(monkeypatch, capsys):
    from tqdm import tqdm

    monkeypatch.setenv("FASTCREDIT_PROGRESS", "bar")
    assert isinstance(P.progress_bar(total=3, disable=True), tqdm)
    monkeypatch.setenv("FASTCREDIT_PROGRESS", "lines")
    monkeypatch.setenv("FASTCREDIT_PROGRESS_EVERY_S", "0")
    bar = P.progress_bar(total=2, desc="eval", unit="q")
    bar.update(1)
    bar.update(1)
    bar.close()
    err = capsys.readouterr().err
    assert [x.split(",")[0] for x in err.splitlines()] == ["eval: 1/2 q (50%)", "eval: 2/2 q (100%)"]
    monkeypatch.setenv("FASTCREDIT_PROGRESS_EVERY_S", "soon")
    with pytest.raises(ValueError, match="not a number of seconds"):
        P.progress_bar(total=1)
