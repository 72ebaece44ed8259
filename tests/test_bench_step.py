"""bench/bench_step.py end to end on the CPU (one timed step of each design, frozen, from one warm start), and its
report's arithmetic (bench/step_report.py): the phase table, time per token, the workload and when the two designs
did the same work."""
import json
import os

import pytest

from tests.commands import run_main

from bench.bench_step import check_same_start, shape_overrides
from bench.step_report import DESIGNS, ROUND, comparability, headline, markdown, paired_rounds, phase_table, workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(n, **t):
    return {"step": n, **{f"time/{k}": v for k, v in t.items()}}


def test_the_table_partitions_the_step_and_takes_medians():
    a = [_row(s, step=10.0 + s, rollout=6.0, old_logprobs=1.0, update=2.0, **{"rollout/generating": 4.0,
                                                                            "rollout/retrieving": 3.0,
                                                                            "rollout/overlap": 1.0})
         for s in (1, 2, 3)]
    b = [_row(s, step=20.0, rollout=15.0, old_logprobs=2.0, update=s * 1.0, **{"rollout/generating": 9.0,
                                                                               "rollout/retrieving": 6.0,
                                                                               "rollout/overlap": 0.0,
                                                                               "colocate/sync_weights": 0.5})
         for s in (1, 2, 3)]
    table = {r["phase"]: r for r in phase_table({DESIGNS[0]: {"rows": a}, DESIGNS[1]: {"rows": b}})}
    assert table["step"][DESIGNS[0]] == 12.0 and table["step"]["ratio"] == pytest.approx(0.6)
    assert table["update"][DESIGNS[1]] == 2.0  # the median of 1, 2, 3
    # "other" is what the top-level phases leave of the step: 12 - 9 and 20 - 19
    assert table["other"][DESIGNS[0]] == pytest.approx(3.0) and table["other"][DESIGNS[1]] == pytest.approx(1.0)
    assert table["retrieval wait"][DESIGNS[0]] == 2.0 and table["retrieval wait"]["inside"]
    assert table["weight sync"][DESIGNS[0]] == 0.0 and table["weight sync"]["ratio"] == 0.0
    assert "judge" not in table and "values" not in table  # phases no design ran are left out


def test_time_per_token_divides_each_step_by_its_own_tokens():
    """Per trained token (prompt + response tokens of the step) for the phases; the generation per decoded token
    (trajectories x decoded tokens per trajectory, the cut ones included)."""
    a = [{**_row(s, step=2.0 * s, update=1.0 * s, **{"rollout/generating": 1.0}), "tokens/trained": 1000.0 * s,
          "decoded_tokens_per_traj": 50.0, "trajectories": 4} for s in (1, 2, 3)]
    b = [{**_row(s, step=4.0, update=2.0, **{"rollout/generating": 3.0}), "tokens/trained": 1000.0,
          "decoded_tokens_per_traj": 150.0, "trajectories": 4} for s in (1, 2, 3)]
    table = {r["phase"]: r for r in phase_table({DESIGNS[0]: {"rows": a}, DESIGNS[1]: {"rows": b}})}
    assert table["update"][f"{DESIGNS[0]}_us_per_token"] == pytest.approx(1000.0)  # 1 s per 1,000 tokens each step
    assert table["step"][f"{DESIGNS[1]}_us_per_token"] == pytest.approx(4000.0)
    assert table["step"]["ratio_per_token"] == pytest.approx(0.5) and table["step"]["ratio"] == pytest.approx(1.0)
    gen = table["generation"]
    assert gen["per"] == "decoded" and gen[f"{DESIGNS[0]}_us_per_token"] == pytest.approx(1e6 / 200)
    assert gen[f"{DESIGNS[1]}_us_per_token"] == pytest.approx(3e6 / 600) and gen["ratio_per_token"] == 1.0


def test_rounds_pair_the_designs_and_cancel_the_drift_between_rounds():
    """A machine twice as slow in round 1 moves both designs: each round's ratio is 0.9, and so is their geometric
    mean, with an interval of zero width; pooled medians would mix the rounds. Rounds that disagree widen the
    interval, and untagged rows (one process each) give no paired rows."""
    def rows(update, slow, old=0.0):
        return [{**_row(s, step=3.0 * slow, update=update * slow, old_logprobs=old), "tokens/trained": 1000.0,
                 ROUND: r} for r, slow in enumerate(slow) for s in (1, 2)]

    runs = {DESIGNS[0]: {"rows": rows(0.9, (1.0, 2.0), old=1e-5)}, DESIGNS[1]: {"rows": rows(1.0, (1.0, 2.0), 0.4)}}
    paired = {p["phase"]: p for p in paired_rounds(runs)}
    assert "old log-probs" not in paired  # a pass one design skips has no ratio to pair
    update = paired["update"]
    assert update["rounds"] == 2 and update["per_round"] == pytest.approx([0.9, 0.9])
    assert update["ratio"] == pytest.approx(0.9) and update["lo"] == pytest.approx(0.9) == update["hi"]
    runs[DESIGNS[0]]["rows"] = rows(0.9, (1.0, 2.4))  # round 1 slower for fastcredit only: ratios 0.9 and 1.08
    update = {p["phase"]: p for p in paired_rounds(runs)}["update"]
    assert update["ratio"] == pytest.approx((0.9 * 1.08) ** 0.5)
    assert update["lo"] < 0.9 and update["hi"] > 1.08  # t with one degree of freedom: 12.7 standard errors
    for run in runs.values():
        for r in run["rows"]:
            del r[ROUND]
    assert paired_rounds(runs) == []


def test_steps_of_different_work_are_not_compared():
    """Turns or response tokens per trajectory more than 5% apart: no speed-up, the reason instead."""
    def runs(turns_b, tokens_b):
        row = {"step": 1, "time/step": 1.0, "turns_per_traj": 2.0, "response_tokens_mean": 100.0}
        return {DESIGNS[0]: {"rows": [row]},
                DESIGNS[1]: {"rows": [{**row, "time/step": 2.0, "turns_per_traj": turns_b,
                                       "response_tokens_mean": tokens_b}]}}

    ok, why = comparability(workload(runs(2.08, 104.0)))
    assert ok and not why
    ok, why = comparability(workload(runs(2.97, 100.0)))
    assert not ok and why == ["turns / trajectory differ by 33% (2.00 against 2.97)"]
    report = {"table": phase_table(runs(2.97, 100.0)), "comparable": ok, "not_comparable": why}
    assert headline(report).startswith("not comparable: turns / trajectory differ by 33%")
    assert "no speed-up is claimed" in headline(report)
    fair = runs(2.0, 103.0)
    report = {"table": phase_table(fair), "comparable": True, "not_comparable": []}
    assert headline(report) == "equal-work step ratio fastcredit / Search-R1 design: 0.50"


def test_the_designs_must_start_from_one_policy_and_a_frozen_one_must_not_move():
    same = {d: {"start_weights": "abc", "end_weights": "abc"} for d in DESIGNS}
    assert check_same_start(same, frozen=True) == "abc"
    with pytest.raises(SystemExit, match="start from different weights"):
        check_same_start({**same, DESIGNS[1]: {"start_weights": "abd", "end_weights": "abd"}}, frozen=True)
    moved = {**same, DESIGNS[0]: {"start_weights": "abc", "end_weights": "xyz"}}
    with pytest.raises(SystemExit, match=r"optim.lr=0 but the weights of \['fastcredit'\] moved"):
        check_same_start(moved, frozen=True)
    assert check_same_start(moved, frozen=False) == "abc"  # --learning: the weights move, as they should


def test_the_workload_says_how_much_each_design_searched():
    """Medians over the timed steps; a step where no design searched says that its retrieval sat idle."""
    def rows(searches):
        return [{"step": k + 1, "searches_per_traj": s, "turns_per_traj": 1.0 + s, "response_tokens_mean": 50.0,
                 "format_ok": 0.5} for k, s in enumerate(searches)]

    runs = {DESIGNS[0]: {"rows": rows([0.0, 2.0, 1.0])}, DESIGNS[1]: {"rows": rows([3.0, 1.0, 2.0])}}
    got = {w["what"]: w for w in workload(runs)}
    assert got["searches / trajectory"][DESIGNS[0]] == 1.0 and got["searches / trajectory"][DESIGNS[1]] == 2.0
    assert got["turns / trajectory"][DESIGNS[1]] == 3.0 and got["format followed"][DESIGNS[0]] == 0.5
    for r in runs[DESIGNS[1]]["rows"]:
        del r["format_ok"]  # a key one design did not log is left out
    assert [w["what"] for w in workload(runs)] == ["searches / trajectory", "turns / trajectory",
                                                   "response tokens / trajectory"]
    report = {"device": "cpu", "shape": "tiny", "config": os.path.join(ROOT, "configs", "debug.yaml"),
              "overrides": [], "steps": 3, "warmup": 1, "table": phase_table(runs),
              "comparable": False, "not_comparable": ["turns / trajectory differ by 33% (2.00 against 3.00)"],
              "runs": {d: {"peak": {}, "wall_s": 1.0} for d in DESIGNS}, "workload": workload(runs)}
    md = markdown(report, ROOT)
    assert "| searches / trajectory | 1.00 | 2.00 |" in md and "No trajectory searched" not in md
    idle = {d: {"rows": rows([0.0, 0.0])} for d in DESIGNS}
    assert "No trajectory searched" in markdown({**report, "workload": workload(idle)}, ROOT)
    assert "**not comparable: turns / trajectory differ by 33%" in md


def test_child_processes_keep_the_inherited_pythonpath(monkeypatch):
    """The H100 run: the Search-R1 design's /retrieve server got PYTHONPATH=<repo> and lost the packages
    carried onto the bare image (faiss, the encoder), which lived on the inherited path."""
    from bench.results_io import child_env

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/carried/site", "/more"]))
    monkeypatch.setenv("FASTCREDIT_TEST_KEPT", "yes")
    env = child_env(ROOT, "/bench", OMP_NUM_THREADS="1")
    assert env["PYTHONPATH"].split(os.pathsep) == [ROOT, "/bench", "/carried/site", "/more"]
    assert env["OMP_NUM_THREADS"] == "1" and env["FASTCREDIT_TEST_KEPT"] == "yes"
    monkeypatch.delenv("PYTHONPATH")
    assert child_env(ROOT)["PYTHONPATH"] == ROOT


def test_shapes_come_from_the_memory_presets():
    got = dict(o.split("=") for o in shape_overrides("Qwen2.5-0.5B"))
    assert got == {"model.tiny_hidden": "896", "model.tiny_layers": "24", "model.tiny_heads": "14",
                   "model.tiny_kv_heads": "2", "model.tiny_intermediate": "4864", "model.tiny_vocab_rows": "151936"}
    assert shape_overrides("tiny") == []
    with pytest.raises(SystemExit, match="not a preset"):
        shape_overrides("gpt-5")


@pytest.mark.slow
def test_bench_step_runs_both_designs_and_writes_its_results(tmp_path):
    """One timed step per design (no warm-up) of a 4-trajectory batch, the Search-R1 design's retriever being the
    /retrieve server the script starts; the policy's vocabulary rows exceed its tokenizer's (ids past it decode
    to nothing). Both designs start from the one warm start fastcredit's run made (the Search-R1 design loads it:
    the cache key leaves out where searches go), and the policy is frozen: the same weights before and after."""
    out = tmp_path / "results"
    args = ["--steps", "1", "--warmup", "0", "--rounds", "1", "--work", str(tmp_path / "w"), "--out", str(out),
            "--tag", "t", "optim.batch_prompts=2", "rollout.n_samples=2", "rollout.mode=async",
            "optim.mini_batch_prompts=2", "data.toy.num_questions=40", "data.toy.num_people=80",
            "data.toy.num_companies=20", "model.tiny_vocab_rows=3000", "distributed.offload_state=false",
            "warmstart.enabled=true", "warmstart.epochs=1", "warmstart.questions=8"]
    proc = run_main("bench.bench_step", args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.load(open(next(out.glob("step_tiny_t_*.json"))))
    assert [w["what"] for w in report["workload"]][0] == "searches / trajectory"
    assert set(report["runs"]) == set(DESIGNS) and report["step_ratio"] > 0 and report["frozen"]
    assert {r["start_weights"] for r in report["runs"].values()} == {r["end_weights"] for r in
                                                                     report["runs"].values()} == \
        {report["start_weights"]}
    assert "warm start: loaded from" in proc.stdout.split("[searchr1_design]")[1]
    assert report["headline"].startswith(("equal-work step ratio", "not comparable"))
    assert {"decoded tokens / trajectory", "trained tokens / step", "invalid turns / trajectory"} <= \
        {w["what"] for w in report["workload"]}
    base = report["runs"]["searchr1_design"]["rows"][0]
    assert base["step"] == 1 and base["time/step"] > 0 and "time/rollout/generating" in base
    phases = {r["phase"] for r in report["table"]}
    assert {"rollout", "old log-probs", "reference log-probs", "update", "step", "generation"} <= phases
    assert (out / next(out.glob("step_tiny_*.md")).name).read_text().count("|") > 20
    assert next(out.glob("step_tiny_*.png")).stat().st_size > 0
    design = open(tmp_path / "w" / "searchr1_design" / "config.yaml").read()
    assert "mode: lockstep" in design and "backend: http" in design and "stop_at_tags: false" in design
    # an override goes to both designs, except what the Search-R1 design's overlay sets: its training state moves,
    # its turns stay lockstep
    assert "offload_state: true" in design
    own = open(tmp_path / "w" / "fastcredit" / "config.yaml").read()
    assert "offload_state: false" in own and "mode: async" in own
    # each design ran in a process of its own, which ends with no thread of the rollout left
    assert all(r["threads"]["python"] == ["MainThread"] for r in report["runs"].values())
