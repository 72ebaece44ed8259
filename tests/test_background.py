"""tests/background.py: a job starts when its test is collected, the test gets its result, and a job that dies
without one, or is not started at all, is never taken for a result."""
import json
import types

import pytest

from tests import background

SCRIPT = """import json, os, sys, time
out = sys.argv[1]
time.sleep(float(sys.argv[2]))
if sys.argv[3] == "ok":
    json.dump({"answer": 42}, open(os.path.join(out, "result.json"), "w"))
else:
    sys.exit(3)
"""


@pytest.fixture
def jobs(tmp_path, monkeypatch):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    monkeypatch.setattr(background, "JOBS", {"ok": ("t.py::ok", [str(script), "0.5", "ok"]),
                                             "dies": ("t.py::dies", [str(script), "0", "die"])})
    monkeypatch.setattr(background, "RUNNING", {})
    config = types.SimpleNamespace()
    background.configure(config)
    yield config
    background.finish(config)
    assert not background.RUNNING


def test_a_collected_job_runs_in_the_background_and_its_test_waits_for_it(jobs, tmp_path):
    background.start_for(jobs, ["t.py::ok", "t.py::other"])
    assert set(background.RUNNING) == {"ok"}  # only the collected test's job
    assert background.result(jobs, "ok", tmp_path) == {"answer": 42}
    background.start_for(jobs, ["t.py::ok"])  # once per session
    assert len(background.RUNNING) == 1


def test_a_worker_finds_the_controllers_folder(jobs, tmp_path):
    background.start_for(jobs, ["t.py::ok"])
    worker = types.SimpleNamespace(workerinput={background.KEY: background.folder(jobs)})
    assert background.result(worker, "ok", tmp_path) == {"answer": 42}


def test_a_job_that_dies_without_a_result_fails_its_test(jobs, tmp_path):
    background.start_for(jobs, ["t.py::dies"])
    with pytest.raises(RuntimeError, match="ended without a result"):
        background.result(jobs, "dies", tmp_path, timeout=60)


def test_a_job_nobody_started_runs_in_place(tmp_path, jobs):
    worker = types.SimpleNamespace(workerinput={})  # a session without the hooks
    assert background.result(worker, "ok", tmp_path) == {"answer": 42}
    assert json.load(open(tmp_path / "ok" / "result.json")) == {"answer": 42}
    with pytest.raises(RuntimeError, match="exited 3"):
        background.result(worker, "dies", tmp_path)
