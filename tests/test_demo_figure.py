"""The guard of the README's demo figure (bench/check_demo_figure.py): the warm-started held-out EM a demo run
logged must lie within the tolerance the README states beside it. ``make demo`` runs the check after every demo
(free: the figure is the demo's first evaluation); here the check itself is tested on logged figures inside and
outside the tolerance, and, with FASTCREDIT_DEMO_FIGURE=1, on the demo's own warm start (about 5 CPU-minutes: the
demo's world, index and supervised pass, then one evaluation of the whole test split; too long for CI's budget)."""
import json
import os

import pytest

from bench.check_demo_figure import check, main, readme_figure
from tests.commands import run_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, rows, name="run"):
    run = tmp_path / name
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(run)


def test_the_readme_states_the_figure_once_with_a_tolerance():
    em, tol = readme_figure()
    assert 0 < em < 1 and 0 < tol <= 0.05


def test_the_check_passes_within_the_tolerance_and_fails_outside(tmp_path, capsys):
    em, tol = readme_figure()
    inside = _run(tmp_path, [{"step": 0, "eval/em": em + 0.9 * tol}, {"step": 1, "reward": 0.5},
                             {"step": 40, "eval/em": 0.99}], "inside")
    assert check(inside)[0] and main([inside]) == 0
    outside = _run(tmp_path, [{"step": 0, "eval/em": em - 1.5 * tol}], "outside")
    ok, message = check(outside)
    assert not ok and f"{em:.3f} ± {tol:.3f}" in message and main([outside]) == 1
    assert "is " + f"{1.5 * tol:.3f}" + " away" in capsys.readouterr().err


def test_the_check_names_what_it_cannot_read(tmp_path, capsys):
    resumed = _run(tmp_path, [{"step": 3, "eval/em": 0.5}], "resumed")
    assert main([resumed]) == 2 and "0 held-out evaluations at step 0" in capsys.readouterr().err
    torn = _run(tmp_path, [], "torn")
    with open(os.path.join(torn, "metrics.jsonl"), "w") as f:
        f.write('{"step": 0, "eval/em": 0.7}\n{"step": 1, "rew\n')
    assert main([torn]) == 2 and "metrics.jsonl line 2: not JSON" in capsys.readouterr().err
    assert main([str(tmp_path / "none")]) == 2 and "no such file" in capsys.readouterr().err
    readme = tmp_path / "README.md"
    readme.write_text("no figure here")
    with pytest.raises(ValueError, match="exactly once"):
        check(resumed, str(readme))


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FASTCREDIT_DEMO_FIGURE") != "1",
                    reason="the demo's warm start takes about 5 CPU-minutes: FASTCREDIT_DEMO_FIGURE=1 runs it "
                           "(make demo checks the same figure after every demo)")
def test_the_demos_warm_start_scores_the_readme_figure(tmp_path):
    out = tmp_path / "demo"
    args = ["--config", os.path.join(ROOT, "configs", "demo.yaml"), f"logging.output_dir={out}",
            f"data.world_dir={tmp_path / 'world'}", "optim.total_steps=0", "logging.progress=false"]
    proc = run_main("fastcredit.train", args, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ok, message = check(str(out))
    assert ok, message
