"""tests/forkserver.py: a forked ``python -m fastcredit.<command>`` gives what a fresh one gives: output, exit
status, files in its own folder; a run past its timeout is killed."""
import json
import re
import os
import subprocess
import sys
import time

import pytest

from tests import forkserver, zygote

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


RANKS = os.path.join(ROOT, "tests", "zygote_ranks.py")


def _torchrun(out, mode, timeout=120):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", RANKS, str(out), mode]
    return forkserver.run(cmd, cwd=ROOT, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _ranks(out) -> list:
    return [json.load(open(out / f"rank{r}.json")) for r in range(2)]


def test_a_torchruns_ranks_are_forked_warm_and_run_as_torchrun_starts_them(tmp_path):
    """Each rank: its own process and session (the agent signals its group), torchrun's environment, the script's
    folder first on sys.path, the arguments; started warm (the server's modules: a cold interpreter has not imported
    transformers when the script starts)."""
    proc = _torchrun(tmp_path, "ok")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(re.findall(r"rank (\d) sum (\d+)", proc.stdout)) == [("0", "3"), ("1", "3")]
    ranks = _ranks(tmp_path)
    assert [r["local_rank"] for r in ranks] == ["0", "1"] and len({r["pid"] for r in ranks}) == 2
    assert all(r["session"] and r["warm"] and r["argv"] == [str(tmp_path), "ok"] for r in ranks)
    assert all(r["path0"] == os.path.dirname(RANKS) and r["cwd"] == ROOT for r in ranks)


@pytest.mark.parametrize("mode,code", [("exit3", "exitcode  : 3"), ("sigkill", "exitcode  : -9")])
def test_a_ranks_exit_status_reaches_torchrun(tmp_path, mode, code):
    proc = _torchrun(tmp_path, mode)
    assert proc.returncode != 0 and code in proc.stderr, proc.stderr[-3000:]
    assert "rank 0 sum 3" in proc.stdout


def test_a_torchrun_past_its_timeout_is_killed_with_its_ranks(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        _torchrun(tmp_path, "hang", timeout=10)
    pids = [r["pid"] for r in _ranks(tmp_path)]
    deadline = time.time() + 10
    while any(zygote.running(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(zygote.running(p) for p in pids)


def test_what_a_forked_command_starts_is_forked_too_and_behaves_as_popens(tmp_path):
    """A command forked by the server starts python commands through ``subprocess``: each is forked warm from the
    command's zygote with the Popen's pipes, file, folder, environment and session; exit status, poll, and a
    SIGTERM come back as Popen's (``-N`` for signal N); ``-c`` still starts a fresh interpreter."""
    proc = forkserver.run([sys.executable, os.path.join(ROOT, "tests", "zygote_popen.py"), str(tmp_path)],
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.load(open(tmp_path / "report.json"))
    assert report["popen_class"] == "WarmPopen"
    echo = report["echo"]
    assert echo["rc"] == 0 and echo["stderr"] == "to stderr\n"
    assert echo["child"]["warm"] and echo["child"]["stdin"] == "hello" and echo["child"]["env"] == "1"
    assert echo["child"]["cwd"] == str(tmp_path) and not echo["child"]["session"]
    assert report["exit5"]["rc"] == 5 and report["exit5"]["log"].endswith("to stderr\n")
    assert json.loads(report["exit5"]["log"].splitlines()[0])["warm"]
    sleep = report["sleep"]
    assert sleep["pid_matches"] and sleep["poll"] is None and sleep["child"]["session"] and sleep["rc"] == -15
    assert report["dash_c_warm"] == "False"
