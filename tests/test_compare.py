"""``python -m fastcredit.compare`` end to end on the debug config: every run trains, a second start keeps the
finished runs, the report has a row per method and noisy variant, and one seed gives the same numbers twice."""
import json
import os
import re
import subprocess
import sys

import pytest

from fastcredit.compare.runs import summarize_run, train_command, variants
from fastcredit.config import load_config
from fastcredit.compare.report import (BEHAVIOUR_METRICS, CREDIT_METRICS, format_markdown, steps_to, summarize,
                                       write_report)
from fastcredit.runtime.stats import mean_interval
from tests.commands import run_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["data.toy.num_people=80", "data.toy.num_companies=20", "data.toy.num_questions=60", "eval.questions=4",
         "eval.every=1", "optim.total_steps=2", "logging.checkpoint_every=1", "warmstart.enabled=true",
         "warmstart.epochs=1", "warmstart.questions=8"]


def compare(tmp, runs, *args):
    args = ["--config", os.path.join(ROOT, "configs", "debug.yaml"), "--runs", str(runs), "--out", str(tmp / "out"),
            f"data.world_dir={tmp / 'world'}", *SMALL, *args]
    return run_main("fastcredit.compare", args, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_compare_runs_every_method_resumes_and_reproduces(tmp_path):
    runs = tmp_path / "runs"
    # two seeds of the critic and its noisy variant, seed by seed: a comparison stopped part-way has whole seeds to
    # pair (grpo's own run through this command is test_a_killed_compare_...'s)
    proc = compare(tmp_path, runs, "--methods", "criticsearch", "--seeds", "2", "--noise", "0.5")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    started = re.findall(r"^\[\d/4\] (\S+) seed (\d)$", proc.stdout, re.M)
    assert started == [("criticsearch", "0"), ("criticsearch+noise0.5", "0"), ("criticsearch", "1"),
                       ("criticsearch+noise0.5", "1")], proc.stdout
    labels = ["criticsearch", "criticsearch+noise0.5"]
    for label in labels:
        res = json.loads((runs / label / "seed0" / "result.json").read_text())
        # each run on one torch thread (--threads, default 1), whatever the machine's cores
        assert res["steps"] == 2 and set(res["eval_em"]) == {"0", "1", "2"} and "1 threads)" in res["device"]
        seed1 = json.loads((runs / label / "seed1" / "result.json").read_text())
        assert seed1["eval_em"]["0"] == res["eval_em"]["0"]  # the same warm start, the same held-out questions
        saved = load_config(str(runs / label / "seed1" / "config.yaml"))
        assert (saved.seed, saved.warmstart.seed, saved.eval.seed) == (1, 0, 0)
    # the judge column is the critic's requests per step (it is asked only about trajectories with a search turn,
    # which the untrained debug policy may not make: the count can be 0, but the critic phase ran every step)
    steps = [json.loads(x) for x in open(runs / "criticsearch" / "seed0" / "metrics.jsonl") if '"reward"' in x]
    assert len(steps) == 2 and all("critic/requests" in r for r in steps)
    assert json.loads((runs / "criticsearch" / "seed0" / "result.json").read_text())["judge_calls_per_step"] == \
        sum(r["critic/requests"] for r in steps) / 2
    md = next((tmp_path / "out").glob("compare_debug_*.md")).read_text()
    for label in labels:
        assert f"| {label} |" in md
    assert next((tmp_path / "out").glob("compare_debug_*.png")).stat().st_size > 0
    # A second start keeps every finished run (nothing retrains).
    again = compare(tmp_path, runs, "--methods", "criticsearch", "--seeds", "2", "--noise", "0.5")
    assert again.returncode == 0 and again.stdout.count("done before, kept") == 4
    # ... but not with other settings: a kept run must be the run this command would make.
    other_lr = compare(tmp_path, runs, "--methods", "criticsearch", "--seeds", "1", "optim.lr=0.5")
    assert other_lr.returncode == 2 and "criticsearch/seed0 holds a run made with other settings" in other_lr.stderr
    assert "optim.lr: 0.001 → 0.5" in other_lr.stderr
    # The same seed in a fresh folder reproduces the numbers (noisy judge included), with two runs side by side.
    other = tmp_path / "runs2"
    proc = compare(tmp_path, other, "--methods", "criticsearch", "--seeds", "1", "--noise", "0.5", "--jobs", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for label in labels:
        a = json.loads((runs / label / "seed0" / "result.json").read_text())
        b = json.loads((other / label / "seed0" / "result.json").read_text())
        assert a["eval_em"] == b["eval_em"] and a["judge_calls_per_step"] == b["judge_calls_per_step"]
    # The warm start was made once in each folder and shared by every run and seed.
    assert len(list((runs / "warmstart").glob("warmstart_*.pt"))) == 1
    assert len(list((other / "warmstart").glob("warmstart_*.pt"))) == 1
    assert (other / "warmstart" / next((runs / "warmstart").glob("*.pt")).name).exists()


def test_compare_rejects_bad_arguments(tmp_path, capsys):
    """In process (the command's own main): every refusal comes before a run, a lock or a signal handler."""
    from fastcredit.compare.runs import main

    def refused(*args) -> str:
        argv = ["--config", os.path.join(ROOT, "configs", "debug.yaml"), "--runs", str(tmp_path / "r"),
                "--out", str(tmp_path / "out"), f"data.world_dir={tmp_path / 'world'}", *SMALL, *args]
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse's refusals
            rc = exc.code
        err = capsys.readouterr().err
        assert rc == 2, (args, err)
        return err

    for args, needle in ((["--methods", "grpo,dpo"], "unknown dpo"), (["--seeds", "0"], "--seeds"),
                         (["--jobs", "0"], "--jobs"), (["--threads", "0"], "--threads"),
                         (["--noise", "1.5"], "--noise"), (["optim.lr"], "key=value")):
        assert needle in refused(*args), args
    assert "optim.total_steps" in refused("optim.total_steps=-1")
    assert not (tmp_path / "r").exists()


def test_help_shows_each_example_command_as_written(capsys):
    """``--help`` prints the docstring's examples: a command continued with a backslash keeps its backslash and its
    second line (a bare backslash in the docstring would join the lines)."""
    from fastcredit.compare.runs import main
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    lines = out.splitlines()
    continued = [i for i, line in enumerate(lines) if line.rstrip().endswith("\\")]
    assert len(continued) >= 2
    assert all(lines[i + 1].startswith("      --") for i in continued), [lines[i + 1] for i in continued]
    assert any(line.strip().startswith("--seeds 6 --noise 0 --jobs 2") for line in lines)


def test_igsearch_is_a_method_help_names_and_the_credit_table_reports_all_fail_groups(capsys):
    from fastcredit.compare.runs import main, parse_args

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "igsearch" in out[out.index("--methods"):] and "--methods grpo,gigpo,igsearch" in out
    args, _ = parse_args(["--methods", "grpo,gigpo,igsearch"])
    assert args.methods == ["grpo", "gigpo", "igsearch"]
    assert variants(["igsearch"], 0.2) == [("igsearch", ["credit.estimator=igsearch"])]  # no judge, no noisy variant
    s = summarize_run([{"step": 1, "reward": 0.5, "credit/all_fail_nonzero_frac": 0.25},
                       {"step": 2, "reward": 0.5, "credit/all_fail_nonzero_frac": 0.75}])
    assert s["credit"]["all_fail_nonzero_frac"] == pytest.approx(0.5)
    run = {"eval_em": {"0": 0.5, "20": 0.6}, "steps": 20, "seconds_per_step": 1.0, "judge_calls_per_step": 0.0}
    md = format_markdown(summarize({"igsearch": [{**s, **run, "seed": 0}]}, None), "cpu", "x")
    assert "all-fail groups with A ≠ 0 |" in md and md.count("| igsearch | – | – | – | – | – | – | – | 0.500 |") == 1


def test_default_and_relative_paths_name_the_checkouts_files(tmp_path, monkeypatch):
    """The defaults are the checkout's configs/compare.yaml and bench/results; paths given relative to where the
    command starts are made whole (its runs start in the checkout's folder)."""
    from fastcredit.compare.runs import ROOT as root, parse_args

    args, _ = parse_args([])
    assert os.path.isfile(args.config) and args.config == os.path.join(ROOT, "configs", "compare.yaml")
    assert root == ROOT and args.out == os.path.join(ROOT, "bench", "results") and args.runs is None
    monkeypatch.chdir(tmp_path)
    args, _ = parse_args(["--config", "c.yaml", "--runs", "r", "--out", "o"])
    assert (args.config, args.runs, args.out) == tuple(str(tmp_path / n) for n in ("c.yaml", "r", "o"))


def test_variants_and_summaries():
    assert [v for v, _ in variants(["grpo", "pica"], 0.2)] == ["grpo", "pica", "pica+noise0.2"]
    assert "judges.oracle_noise=0.2" in dict(variants(["pica"], 0.2))["pica+noise0.2"]
    assert [v for v, _ in variants(["grpo", "pica"], 0.0)] == ["grpo", "pica"]
    split = dict(variants(["grpo"], 0.0, (0, 2)))
    assert list(split) == ["grpo", "grpo+split-k0", "grpo+split-k2"]
    assert split["grpo+split-k2"][-2:] == ["distributed.placement=split", "rollout.max_staleness=2"]
    assert train_command("c.yaml", split["grpo+split-k2"])[1:6] == ["-m", "torch.distributed.run", "--standalone",
                                                                     "--nproc_per_node=2", "-m"]
    assert train_command("c.yaml", split["grpo"])[1:3] == ["-m", "fastcredit.train"]
    # seconds per step: the median (step 3 was paused for ten minutes)
    rows = [{"step": 0, "eval/em": 0.1}, {"step": 1, "reward": 0.5, "critic/requests": 8, "time/step": 2.0},
            {"step": 2, "reward": 0.5, "critic/requests": 4, "proceed/critiqued_steps": 2, "time/step": 4.0,
             "credit/against_outcome_frac": 0.25}, {"step": 3, "reward": 0.5, "time/step": 600.0},
            {"step": 3, "eval/em": 0.4}]
    s = summarize_run(rows)
    no_credit = {name: None for name in CREDIT_METRICS}
    no_behaviour = {name: None for name in BEHAVIOUR_METRICS}
    assert s == {"eval_em": {"0": 0.1, "3": 0.4}, "steps": 3, "seconds_per_step": 4.0, "ig_score_share": None,
                 "judge_calls_per_step": 14 / 3, "against_outcome_frac": 0.25, "credit": no_credit,
                 "credit_labels": None, "behaviour_start": no_behaviour, "behaviour": no_behaviour}
    # IG-Search's scoring share: its phase over the step, step by step, the median (the paused step moves it least)
    rows[1]["time/ig_score"], rows[2]["time/ig_score"], rows[3]["time/ig_score"] = 0.5, 2.0, 6.0
    assert summarize_run(rows)["ig_score_share"] == pytest.approx(0.25)
    mean, half = mean_interval([0.2, 0.4, 0.6])
    assert mean == pytest.approx(0.4) and half == pytest.approx(4.303 * 0.2 / 3 ** 0.5, rel=1e-3)
    assert mean_interval([0.5]) == (0.5, None)
    run = {"eval_em": {"0": 0.5, "10": 0.3, "20": 0.6}, "steps": 20, "seed": 0, "seconds_per_step": 1.0,
           "judge_calls_per_step": 0.0}
    assert steps_to(run, 0.5) == 20  # step 0 does not count
    table = summarize({"grpo": [run], "ppo": [{**run, "eval_em": {"0": 0.5, "20": 0.7}}]}, None)
    assert table["threshold"] == 0.6 and table["methods"]["ppo"]["vs_grpo"] == pytest.approx(0.1)
    # vs GRPO pairs the runs by seed: GRPO's seed 1 beats its seed 0 by the same 0.2 as the method's, so the
    # method is +0.1 on both seeds with no spread, and a seed GRPO lacks is left out
    seeds = lambda ems: [{**run, "seed": k, "eval_em": {"0": 0.5, "20": em}} for k, em in enumerate(ems)]  # noqa: E731
    t = summarize({"grpo": seeds([0.4, 0.6]), "pica": seeds([0.5, 0.7, 0.9])}, None)["methods"]
    assert t["pica"]["vs_grpo"] == pytest.approx(0.1) and t["pica"]["vs_grpo_ci95"] == pytest.approx(0.0, abs=1e-12)
    assert t["pica"]["vs_grpo_seeds"] == 2 and t["grpo"]["vs_grpo"] is None
    # learning speed: the mean EM over the evaluations after step 0, paired with GRPO's by seed the same way
    assert t["pica"]["mean_em"] == pytest.approx(0.7) and t["pica"]["mean_em_vs_grpo"] == pytest.approx(0.1)
    curve = lambda k, ems: {**run, "seed": k, "eval_em": dict(zip(("0", "10", "20"), ems))}  # noqa: E731
    t = summarize({"grpo": [curve(0, [0.5, 0.3, 0.6]), curve(1, [0.5, 0.4, 0.4])],
                   "gigpo": [curve(0, [0.5, 0.5, 0.6]), curve(1, [0.5, 0.7, 0.5])]}, 0.6)["methods"]
    assert t["grpo"]["mean_em"] == pytest.approx(0.425) and t["grpo"]["mean_em_vs_grpo"] is None
    assert t["gigpo"]["mean_em_vs_grpo"] == pytest.approx((0.1 + 0.2) / 2)  # (0.55-0.45, 0.6-0.4)
    assert t["gigpo"]["mean_em_vs_grpo_ci95"] == pytest.approx(12.706 * 0.05, rel=1e-3)  # sd 0.1/√2, n 2
    assert t["gigpo"]["vs_grpo"] == pytest.approx(0.05)  # the final EM: 0.6-0.6 and 0.5-0.4
    # steps to 0.6: GRPO's seed 0 at 20, its seed 1 never; GiGPO's seed 0 at 20, seed 1 at 10: one pair, 0 apart
    assert t["grpo"]["steps_to_threshold"] == 20 and t["gigpo"]["steps_to_threshold"] == 15
    assert t["gigpo"]["steps_to_threshold_vs_grpo"] == 0 and t["gigpo"]["steps_to_threshold_vs_grpo_seeds"] == 1
    t = summarize({"grpo": [curve(0, [0.5, 0.6, 0.6]), curve(1, [0.5, 0.4, 0.6])],
                   "gigpo": [curve(0, [0.5, 0.5, 0.6]), curve(1, [0.5, 0.7, 0.5])]}, 0.6)["methods"]
    assert t["gigpo"]["steps_to_threshold_vs_grpo"] == pytest.approx(0.0)  # +10 on seed 0, -10 on seed 1
    assert t["gigpo"]["steps_to_threshold_vs_grpo_ci95"] == pytest.approx(12.706 * 10)  # sd 10·√2, n 2
    md = format_markdown(summarize({"grpo": seeds([0.4, 0.6]), "pica": seeds([0.5, 0.7, 0.9])}, None), "cpu", "x")
    assert "| pica | 3 | 0.500 | 0.700 ± 0.497 | +0.100 ± 0.000 | 0.700 ± 0.497 | +0.100 ± 0.000 |" in md


def test_runs_without_held_out_evaluations_report_their_other_columns(tmp_path):
    """eval.every=0 eval.questions=0 (a timing comparison): the EM columns are empty, seconds per step, the IG
    share and the credit table are still the runs', and a run that did evaluate keeps its EM beside them."""
    silent = {"eval_em": {}, "steps": 60, "seconds_per_step": 3.0, "judge_calls_per_step": 0.0}
    t = summarize({"grpo": [{**silent, "seed": 0}, {**silent, "seed": 1}],
                   "igsearch": [{**silent, "seed": 0, "seconds_per_step": 5.0, "ig_score_share": 0.4}]}, None)
    assert t["threshold"] is None
    grpo, ig = t["methods"]["grpo"], t["methods"]["igsearch"]
    assert grpo["final_em"] is None and grpo["start_em"] is None and ig["vs_grpo"] is None
    assert ig["seconds_per_step"] == 5.0 and ig["ig_score_share"] == 0.4 and grpo["reached_threshold"] == "0/2"
    md = format_markdown(t, "cpu", "x")
    assert "| grpo | 2 | – | – | – |" in md and "| 5.0 | 40% |" in md
    mixed = summarize({"grpo": [{**silent, "seed": 0}], "ppo": [{**silent, "seed": 0, "eval_em": {"0": 0.5}}]},
                      None)
    assert mixed["threshold"] == 0.5 and mixed["methods"]["ppo"]["final_em"] == 0.5
    for k in (0, 1):  # the whole report, the plot included, from runs' folders
        folder = tmp_path / "runs" / "grpo" / f"seed{k}"
        folder.mkdir(parents=True)
        (folder / "result.json").write_text(json.dumps({**silent, "seed": k, "method": "grpo"}))
        (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5, "time/step": 3.0}) + "\n")
    paths = write_report(str(tmp_path / "runs"), ["grpo"], str(tmp_path / "out"), "x")
    assert len(paths) == 3 and all(os.path.exists(p) for p in paths)


def test_credit_metrics_are_averaged_over_steps_then_seeds_with_their_labels():
    # gold labels: plain names; a step without a metric (no wasted search in a success that step) is not a zero
    gold = [{"step": 1, "reward": 0.5, "credit/turn_auc": 0.6, "credit/miscredit_frac/wasted_in_success": 1.0,
             "credit/all_fail_group_frac": 0.5, "credit/turn_auc/critic": 0.1},
            {"step": 2, "reward": 0.5, "credit/turn_auc": 0.8, "credit/all_fail_group_frac": 0.25}]
    s = summarize_run(gold)
    assert s["credit_labels"] == "gold"  # the judge's names are ignored where gold labels exist
    assert s["credit"]["turn_auc"] == pytest.approx(0.7) and s["credit"]["all_fail_group_frac"] == pytest.approx(0.375)
    assert s["credit"]["miscredit_frac/wasted_in_success"] == 1.0 and s["credit"]["turn_auc_within"] is None
    # no gold labels: the judge's suffixed names, and the table says whose they are
    judged = summarize_run([{"step": 1, "reward": 0.5, "credit/turn_auc/critic": 0.9,
                             "credit/degenerate_adv_share": 0.4}])
    assert judged["credit_labels"] == "critic" and judged["credit"]["turn_auc"] == 0.9
    assert judged["credit"]["degenerate_adv_share"] == 0.4
    run = {"eval_em": {"0": 0.5, "20": 0.6}, "steps": 20, "seconds_per_step": 1.0, "judge_calls_per_step": 0.0}
    t = summarize({"grpo": [{**s, **run, "seed": 0}, {**summarize_run(gold[1:]), **run, "seed": 1}],
                   "pica": [{**judged, **run, "seed": 0}], "ppo": [{**run, "seed": 0}]}, None)["methods"]
    assert t["grpo"]["credit"]["turn_auc"] == pytest.approx(0.75)  # seeds 0.7 and 0.8
    assert t["grpo"]["credit_ci95"]["turn_auc"] == pytest.approx(12.706 * 0.05)  # sd 0.05·√2, n 2
    assert t["grpo"]["credit"]["miscredit_frac/wasted_in_success"] == 1.0  # one seed logged it: no interval
    assert t["grpo"]["credit_ci95"]["miscredit_frac/wasted_in_success"] is None
    assert t["ppo"]["credit_labels"] is None and t["ppo"]["credit"]["turn_auc"] is None  # an old result.json
    md = format_markdown({"threshold": 0.6, "methods": t}, "cpu", "x")
    assert "| grpo | gold | 0.750 ± 0.635 | – | 1.000 | – | – | 0.312 ± 0.794 |" in md
    assert "| pica | critic | 0.900 | – | – | – | 0.400 | – |" in md and "| ppo | – | – | – |" in md
    assert "difference to GRPO's run of the same seed ± its 95%" not in md  # no metric has a pair
    # paired with GRPO by seed, only against the same labels: PiCA's judge-labelled seed 0 has no pair for the
    # labelled metrics, but its degenerate share (not labelled) has none from GRPO either; a gold-labelled PiCA does
    assert t["pica"]["credit_vs_grpo_seeds"]["turn_auc"] == 0 and t["pica"]["credit_vs_grpo"]["turn_auc"] is None
    gold_pica = [{**summarize_run([{**gold[0], "credit/turn_auc": 0.9}]), **run, "seed": k} for k in (0, 1, 2)]
    t = summarize({"grpo": [{**s, **run, "seed": 0}, {**summarize_run(gold[1:]), **run, "seed": 1}],
                   "pica": gold_pica}, None)["methods"]
    assert t["pica"]["credit_vs_grpo"]["turn_auc"] == pytest.approx(0.15)  # 0.9-0.7 and 0.9-0.8; seed 2 unpaired
    assert t["pica"]["credit_vs_grpo_ci95"]["turn_auc"] == pytest.approx(12.706 * 0.05)
    assert t["pica"]["credit_vs_grpo_seeds"]["turn_auc"] == 2 and "credit_vs_grpo" not in t["grpo"]
    md = format_markdown({"threshold": 0.6, "methods": t}, "cpu", "x")
    assert "| pica | 2 | +0.150 ± 0.635 | – | +0.000 | – | – | +0.188 ± 0.794 |" in md


def test_behaviour_is_the_first_and_last_stretch_paired_with_grpo():
    # 25 training steps searching `step` times a trajectory: the first 10 average 5.5, the last 10 (16..25) 20.5;
    # an evaluation line is not a training step, and a step that did not log a metric is not a zero
    rows = [{"step": k, "reward": 0.5, "searches_per_traj": float(k), **({"em": 0.2} if k == 1 else {})}
            for k in range(1, 26)] + [{"step": 25, "eval/em": 0.5, "searches_per_traj": 99.0}]
    s = summarize_run(rows)
    assert s["behaviour_start"]["searches_per_traj"] == pytest.approx(5.5)
    assert s["behaviour"]["searches_per_traj"] == pytest.approx(20.5)
    assert s["behaviour_start"]["em"] == 0.2 and s["behaviour"]["em"] is None
    assert s["behaviour"]["turns_per_traj"] is None
    run = {"eval_em": {"0": 0.5, "20": 0.6}, "steps": 20, "seconds_per_step": 1.0, "judge_calls_per_step": 0.0}
    at = lambda k, start, end: {**run, "seed": k, "behaviour_start": {"searches_per_traj": start},  # noqa: E731
                                "behaviour": {"searches_per_traj": end}}
    t = summarize({"grpo": [at(0, 2.0, 2.6), at(1, 2.0, 2.8), at(2, 2.0, 2.7)],
                   "gigpo": [at(0, 2.1, 2.5), at(1, 2.1, 2.6), at(3, 2.1, 2.0)]}, None)["methods"]
    assert t["grpo"]["behaviour"]["searches_per_traj"] == pytest.approx(2.7)
    assert t["grpo"]["behaviour_ci95"]["searches_per_traj"] == pytest.approx(4.303 * 0.1 / 3 ** 0.5, rel=1e-3)
    assert t["gigpo"]["behaviour_start"]["searches_per_traj"] == pytest.approx(2.1)
    # paired by seed: seeds 0 and 1 (-0.1, -0.2); GiGPO's seed 3 has no GRPO run
    assert t["gigpo"]["behaviour_vs_grpo"]["searches_per_traj"] == pytest.approx(-0.15)
    assert t["gigpo"]["behaviour_vs_grpo_ci95"]["searches_per_traj"] == pytest.approx(12.706 * 0.05, rel=1e-3)
    assert t["gigpo"]["behaviour_vs_grpo_seeds"]["searches_per_traj"] == 2 and "behaviour_vs_grpo" not in t["grpo"]
    md = format_markdown({"threshold": 0.6, "methods": t}, "cpu", "x")
    assert "| grpo | 2.000 → 2.700 ± 0.248 | – → – | – → – |" in md
    assert "| gigpo | 2 | -0.150 ± 0.635 | – | – | – | – |" in md


def test_status_lines_of_a_run_are_relayed_and_its_step_table_is_not(tmp_path, capsys):
    from fastcredit.compare.runs import _LogTail

    log = tmp_path / "train.log"
    log.write_text("earlier run: not relayed\n")
    tail = _LogTail(str(log), "grpo")
    with open(log, "a", encoding="utf-8", newline="") as fh:
        fh.write("$ python -m fastcredit.train\nwarm start: epoch 1/3, loss 0.9 (60 s)\n"
                 " step reward    EM\n    1  0.531 0.438\nLoading: 0%|\rLoading: 100%|\nheld-out EM before tr")
        fh.flush()
        tail.relay()
        assert capsys.readouterr().out == "  grpo: warm start: epoch 1/3, loss 0.9 (60 s)\n"
        fh.write("aining: 0.440\n   12  0.5 0.4\nTraceback (most recent call last):")
        fh.flush()
        tail.relay(final=True)
    tail.close()
    assert capsys.readouterr().out == ("  grpo: held-out EM before training: 0.440\n"
                                       "  grpo: Traceback (most recent call last):\n")


def _processes_naming(text: str) -> list[str]:
    """Pids of live processes whose command line contains ``text``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if text.encode() in fh.read().replace(b"\0", b" "):
                    found.append(entry)
        except OSError:  # not a process, or gone
            continue
    return found


def test_a_killed_compare_stops_its_runs_holds_its_folder_and_resumes(tmp_path):
    import signal
    import time

    runs = tmp_path / "runs"
    # more steps than the test waits for: the run is still training whenever it is looked at
    args = ["--methods", "grpo", "--seeds", "1", "--noise", "0", "optim.total_steps=500"]
    cmd = [sys.executable, "-m", "fastcredit.compare", "--config", os.path.join(ROOT, "configs", "debug.yaml"),
           "--runs", str(runs), "--out", str(tmp_path / "out"), f"data.world_dir={tmp_path / 'world'}", *SMALL, *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    def start(log):
        return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)

    def wait_for(proc, done):
        deadline = time.time() + 600
        while not done():
            assert proc.poll() is None and time.time() < deadline, (proc.returncode, "gave up waiting")
            time.sleep(0.5)

    def stop(proc, log):
        assert _processes_naming(f"logging.output_dir={runs}"), "the training run should be alive here"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        out = log.read_text()
        assert proc.returncode == 143 and "grpo seed 0: stopped at step" in out, out[-3000:]
        assert not _processes_naming(f"logging.output_dir={runs}"), "a training run outlived its compare command"
        return out

    ckpt = runs / "grpo" / "seed0" / "checkpoints"
    first = start(tmp_path / "first.log")
    wait_for(first, lambda: ckpt.is_dir() and any(p.name.startswith("step_") and "." not in p.name
                                                   for p in ckpt.iterdir()))
    # while it runs, a second command on the same folder is refused
    second = compare(tmp_path, runs, *args)
    assert second.returncode == 2 and "in use by another" in second.stderr, second.stderr
    stop(first, tmp_path / "first.log")
    assert not (runs / "grpo" / "seed0" / "result.json").exists()
    # started again, the run resumes from its checkpoint (and is stopped again)
    again_log = tmp_path / "again.log"
    again = start(again_log)
    wait_for(again, lambda: "grpo seed 0: resumed from" in again_log.read_text())
    out = stop(again, again_log)
    assert "grpo seed 0 (resuming)" in out
