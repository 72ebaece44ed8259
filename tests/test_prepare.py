"""The main-job pipeline end to end on the debug config (toy world → files → oracle replay)."""
import json
import os

from fastcredit.config import load_config
from fastcredit.prepare import format_observation, run
from tests.commands import run_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_observation_format_matches_searchr1():
    # Search-R1: titles keep the corpus's quotes, the passages string is stripped inside the tags.
    assert format_observation([("A", "x."), ("B", "y.")]) == (
        '\n\n<information>Doc 1(Title: "A") x.\nDoc 2(Title: "B") y.</information>\n\n')


def test_pipeline_on_the_debug_config(tmp_path):
    cfg = load_config(os.path.join(ROOT, "configs", "debug.yaml"), [
        f"logging.output_dir={tmp_path}/run", f"data.world_dir={tmp_path}/world",
        "data.toy.num_people=80", "data.toy.num_companies=20", "data.toy.num_questions=60",
    ])
    summary = run(cfg)
    assert summary["test_questions"] == 6 and summary["oracle_trajectories"] == 6
    assert summary["oracle_em"] == 1.0 and summary["oracle_format_ok"] == 1.0
    assert summary["no_search_guess_em"] == 0.0
    assert load_config(f"{tmp_path}/run/config.yaml") == cfg  # the merged config is saved with the run
    assert json.load(open(f"{tmp_path}/run/summary.json")) == summary


def test_command_line_errors_name_the_key(tmp_path):
    out = run_main("fastcredit.prepare", ["rollout.max_turn=2"])
    assert out.returncode == 2 and "did you mean 'rollout.max_turns'" in out.stderr
