"""The guard of the README's demo figure: the warm-started held-out EM a demo run logged (step 0 of its
``metrics.jsonl``: configs/demo.yaml's seed, its whole 500-question test split) must lie within the tolerance the
README states beside the figure. ``make demo`` runs it after training, so every demo run checks the figure at no
extra cost; tests/test_demo_figure.py runs the demo's warm start for it alone.

    python -m bench.check_demo_figure runs/demo        # exit 0: within; 1: outside (the message says by how much)

The figure moved once without anyone noticing why (a 200-question sample changed; docs/results.md): this fails
when anything that shapes the warm-started policy or its evaluation moves it (the toy world, the tokenizer, the
oracle demonstrations, the supervised pass, the agent loop, the retriever or the scoring).
"""
from __future__ import annotations

import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURE = re.compile(r"warm-started held-out EM \*\*([01]\.\d+) ± (0\.\d+)\*\*")


def readme_figure(readme: str = os.path.join(ROOT, "README.md")) -> tuple[float, float]:
    """``(EM, tolerance)`` as the README states them, once: ``warm-started held-out EM **0.xxx ± 0.0x**``."""
    found = FIGURE.findall(open(readme, encoding="utf-8").read())
    if len(found) != 1:
        raise ValueError(f"{readme} must state the demo's warm-started held-out EM exactly once, as "
                         f"'warm-started held-out EM **0.xxx ± 0.0x**' ({len(found)} found)")
    return float(found[0][0]), float(found[0][1])


def logged_figure(run: str) -> float:
    """The held-out EM the run logged before its first step (``eval/em`` of step 0 in ``metrics.jsonl``)."""
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file (is {run} a training run's folder?)")
    rows = []
    with open(path, encoding="utf-8") as f:
        for k, line in enumerate(f, 1):
            try:
                row = json.loads(line)
            except ValueError:
                raise ValueError(f"{path} line {k}: not JSON") from None
            if row.get("step") == 0 and "eval/em" in row:
                rows.append(row["eval/em"])
    if len(rows) != 1:
        raise ValueError(f"{path}: {len(rows)} held-out evaluations at step 0, expected one (a run resumed past "
                         "step 0 has none; the check needs the run's own start)")
    return float(rows[0])


def check(run: str, readme: str = os.path.join(ROOT, "README.md")) -> tuple[bool, str]:
    """``(within, message)`` for the run in ``run`` against the README's figure."""
    want, tol = readme_figure(readme)
    got = logged_figure(run)
    if abs(got - want) <= tol:
        return True, f"demo figure: warm-started held-out EM {got:.3f}, README {want:.3f} ± {tol:.3f}: within"
    return False, (f"demo figure: warm-started held-out EM {got:.3f} is {abs(got - want):.3f} away from the "
                   f"README's {want:.3f} ± {tol:.3f}. Find what moved it (the world, tokenizer, warm start, agent "
                   "loop, retriever or scoring), or measure it again and correct README.md and docs/results.md")


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        ok, message = check(argv[0])
    except ValueError as exc:
        print(f"check_demo_figure: {exc}", file=sys.stderr)
        return 2
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
