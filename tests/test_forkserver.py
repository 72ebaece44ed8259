"""tests/forkserver.py: a forked ``python -m fastcredit.<command>`` gives what a fresh one gives: output, exit
status, files in its own folder; a run past its timeout is killed."""
import json
import os
import subprocess
import sys

import pytest

from tests import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = [sys.executable, "-m", "fastcredit.data.toyworld", "--out", "w", "--num-people", "40", "--num-cities", "8",
         "--num-countries", "4", "--num-universities", "4", "--num-companies", "10", "--num-bands", "5",
         "--num-questions", "30"]


def test_output_exit_status_folder_and_environment_are_the_commands_own(tmp_path):
    fresh, forked = tmp_path / "fresh", tmp_path / "forked"
    fresh.mkdir()
    forked.mkdir()
    env = {**os.environ, "PYTHONPATH": ROOT}
    a = subprocess.run(WORLD, capture_output=True, text=True, cwd=fresh, env=env, timeout=300)
    b = forkserver.run(WORLD, capture_output=True, text=True, cwd=str(forked), env=env, timeout=300)
    assert a.returncode == b.returncode == 0, b.stderr[-2000:]
    assert json.loads(a.stdout) == json.loads(b.stdout)  # the summary the command prints
    assert (forked / "w" / "world.json").read_bytes() == (fresh / "w" / "world.json").read_bytes()  # in its cwd
    bad = forkserver.run(WORLD + ["--num-cities", "3", "--num-countries", "5"], cwd=str(forked), env=env,
                         timeout=300)
    assert bad.returncode == 2 and "num_cities (3) must be at least num_countries (5)" in bad.stderr


def test_a_run_past_its_timeout_is_killed_and_the_server_goes_on(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        forkserver.run(WORLD, cwd=str(tmp_path), timeout=0.001)
    again = forkserver.run(WORLD, cwd=str(tmp_path), timeout=300)
    assert again.returncode == 0 and (tmp_path / "w" / "world.json").exists()


def test_what_is_not_a_fastcredit_command_runs_as_a_subprocess():
    proc = forkserver.run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"], timeout=60)
    assert proc.stdout.strip() == "False"  # a fresh interpreter: nothing preloaded
