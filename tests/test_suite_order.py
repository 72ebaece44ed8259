"""The suite's own schedule (tests/conftest.py): the long files go to `make test`'s workers first, in the order given,
and the Makefile keeps xdist from reordering them by their test counts."""
import os

from tests.conftest import LAST, LONGEST_FIRST

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_file_named_for_the_schedule_exists():
    missing = [p for p in (*LONGEST_FIRST, *LAST) if not os.path.isfile(os.path.join(ROOT, p))]
    assert not missing, f"tests/conftest.py names files that are not there (renamed or split?): {missing}"
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


def test_make_test_keeps_the_order():
    line = next(x for x in open(os.path.join(ROOT, "Makefile")) if "-m pytest tests" in x)
    assert "--dist loadfile" in line and "--no-loadscope-reorder" in line
