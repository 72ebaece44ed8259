"""python -m fastcredit.compare.sweep: the gap to GRPO of each method at each setting, from comparison reports."""
import json

from fastcredit.compare.sweep import gaps, main


def report(path, grpo, others):
    methods = {"grpo": {"final_em": grpo, "final_em_ci95": 0.01, "vs_grpo": None}}
    methods["grpo"].update(mean_em=grpo - 0.1, mean_em_ci95=0.02)
    methods.update({m: {"final_em": grpo + d, "vs_grpo": d, "vs_grpo_ci95": ci, "vs_grpo_seeds": 6,
                        "mean_em": grpo - 0.1 + 2 * d, "mean_em_vs_grpo": 2 * d, "mean_em_vs_grpo_ci95": ci / 2}
                    for m, (d, ci) in others.items()})
    path.write_text(json.dumps({"device": "cpu", "name": path.stem, "methods": methods}))
    return str(path)


def test_the_sweep_lines_up_each_methods_gap_by_setting(tmp_path):
    a = report(tmp_path / "k1.json", 0.8, {"gigpo": (0.01, 0.02)})
    b = report(tmp_path / "k3.json", 0.4, {"gigpo": (0.05, 0.03), "criticsearch": (-0.02, 0.04)})
    rc = main(["--point", f"3={b}", "--point", f"1={a}", "--name", "t", "--out", str(tmp_path / "out")])
    assert rc == 0
    md = (tmp_path / "out" / "sweep_t.md").read_text()
    assert "| grpo (final EM) | 0.800 ± 0.010 | 0.400 ± 0.010 |" in md
    assert "| gigpo | +0.010 ± 0.020 | +0.050 ± 0.030 |" in md and "| criticsearch | – | -0.020 ± 0.040 |" in md
    mean = md[md.index("Mean EM"):]
    assert "| grpo (mean EM) | 0.700 ± 0.020 | 0.300 ± 0.020 |" in mean
    assert "| gigpo | +0.020 ± 0.010 | +0.100 ± 0.015 |" in mean and "| criticsearch | – | -0.040 ± 0.020 |" in mean
    assert (tmp_path / "out" / "sweep_t.png").stat().st_size > 0
    from fastcredit.compare.sweep import read_point
    assert gaps([read_point(f"1={a}"), read_point(f"3={b}")])["gigpo"] == [(1.0, 0.01, 0.02, 6), (3.0, 0.05, 0.03, 6)]
    assert gaps([read_point(f"3={b}")], "mean")["criticsearch"] == [(3.0, -0.04, 0.02, 6)]


def test_bad_points_are_refused_naming_them(tmp_path, capsys):
    good = report(tmp_path / "k1.json", 0.8, {})
    assert main(["--point", "x=" + good, "--out", str(tmp_path)]) == 2
    assert "expected X=REPORT.json with a number X" in capsys.readouterr().err
    assert main(["--point", f"1={tmp_path / 'missing.json'}", "--out", str(tmp_path)]) == 2
    assert "missing.json: cannot read a comparison report" in capsys.readouterr().err
    assert main(["--point", f"1={good}", "--point", f"1={good}", "--out", str(tmp_path)]) == 2
