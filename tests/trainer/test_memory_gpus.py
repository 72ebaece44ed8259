"""How many GPUs ``--memory-report`` plans for: --gpus, else torchrun's WORLD_SIZE (LOCAL_WORLD_SIZE per node), else
the config's distributed.gpus (each paper config states its paper's count), else one; the report says which."""
import os
import re

import pytest

from fastcredit.config import ConfigError, load_config
from fastcredit.train import main
from fastcredit.trainer.memory.request import ReportRequest, report_gpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the GPUs each paper trained on, as its YAML comment cites: CriticSearch Appendix B (one node of 8 H100), CW-GRPO
# Appendix C and its script (4 training GPUs, a fifth serving the judge), PiCA Section 5.1 (8 x A800), ProCeedRL (no
# count: 8 assumed), Search-R1's v0.2 scripts (n_gpus_per_node=8, nnodes=1)
PAPERS = {"criticsearch": 8, "cwgrpo": 4, "pica": 8, "proceed": 8, "searchr1_grpo": 8, "searchr1_ppo": 8}
FIXED = ["--memory-report", "--gpu-gib", "80", "--host-gib", "1024"]  # nothing read from this machine


def config(name):
    return os.path.join(ROOT, "configs", f"{name}.yaml")


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def report(capsys, name, *extra):
    rc = main(["--config", config(name), *FIXED, *extra])
    out = capsys.readouterr()
    title = re.search(r"(\d+) GPU\(s\) x 80 GiB", out.out)
    return rc, int(title.group(1)) if title else None, out.out + out.err


@pytest.mark.parametrize("name", sorted(PAPERS))
def test_a_paper_config_plans_for_its_papers_gpus(name, no_torchrun, capsys):
    rc, gpus, out = report(capsys, name)
    assert gpus == PAPERS[name] == load_config(config(name)).distributed.gpus
    assert f"- GPUs: {gpus} (the config's distributed.gpus;" in out
    assert rc == 0 and "OVER" not in out  # each fits its paper's GPUs; on one GPU the train phase would not


def test_torchrun_world_size_comes_before_the_config(no_torchrun, capsys):
    no_torchrun.setenv("WORLD_SIZE", "8")
    rc, gpus, out = report(capsys, "cwgrpo")  # the config says 4
    assert gpus == 8 and "- GPUs: 8 (torchrun's WORLD_SIZE), 8 per node (the smaller of the GPUs and 8)" in out
    no_torchrun.setenv("WORLD_SIZE", "16")
    no_torchrun.setenv("LOCAL_WORLD_SIZE", "4")  # four nodes of four
    rc, gpus, out = report(capsys, "criticsearch")
    assert gpus == 16 and "- GPUs: 16 (torchrun's WORLD_SIZE), 4 per node (torchrun's LOCAL_WORLD_SIZE)" in out
    assert "host: 4 rank(s) per node" in out and "4 node(s)" in out


def test_the_flags_come_first(no_torchrun, capsys):
    no_torchrun.setenv("WORLD_SIZE", "16")
    no_torchrun.setenv("LOCAL_WORLD_SIZE", "4")
    rc, gpus, out = report(capsys, "cwgrpo", "--gpus", "2")  # the config says 4, torchrun 16 and 4 a node
    assert gpus == 2 and "- GPUs: 2 (--gpus), 2 per node (the smaller of the GPUs and 8)" in out
    rc, gpus, out = report(capsys, "cwgrpo", "--gpus-per-node", "2")
    assert gpus == 16 and "- GPUs: 16 (torchrun's WORLD_SIZE), 2 per node (--gpus-per-node)" in out


def test_with_no_count_anywhere_one_gpu_and_the_report_says_so(no_torchrun, capsys):
    rc, gpus, out = report(capsys, "debug")
    assert gpus == 1 and "- GPUs: 1 (none stated by --gpus, WORLD_SIZE or distributed.gpus: one)" in out
    rc, gpus, out = report(capsys, "criticsearch", "distributed.gpus=0")
    assert gpus == 1 and rc == 2 and "train phase needs 91.1 GiB of a 80 GiB GPU" in out


def test_counts_that_cannot_be_are_named(no_torchrun, capsys):
    rc, _, out = report(capsys, "debug", "--gpus", "0")
    assert rc == 2 and "memory report: --gpus 0 must be at least 1" in out
    rc, _, out = report(capsys, "debug", "distributed.gpus=-8")
    assert rc == 2 and "distributed.gpus must lie in [0, inf) (0: not stated, one GPU), got -8" in out
    no_torchrun.setenv("WORLD_SIZE", "eight")
    rc, _, out = report(capsys, "debug")
    assert rc == 2 and "WORLD_SIZE='eight' in the environment is not a number of GPUs" in out
    no_torchrun.setenv("WORLD_SIZE", "2")
    no_torchrun.setenv("LOCAL_WORLD_SIZE", "4")
    rc, _, out = report(capsys, "debug")
    assert rc == 2 and "LOCAL_WORLD_SIZE 4 must be between 1 and WORLD_SIZE (2)" in out


def test_report_gpus_precedence_without_the_report():
    cfg = load_config(config("pica"))
    torchrun = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    assert report_gpus(cfg, ReportRequest(gpus=4), torchrun)[:2] == (4, None)
    assert report_gpus(cfg, ReportRequest(), torchrun)[:2] == (16, 8)
    assert report_gpus(cfg, ReportRequest(), {})[:2] == (8, None)
    assert report_gpus(load_config(config("debug")), ReportRequest(), {})[:2] == (1, None)
    with pytest.raises(ConfigError, match=r"--gpus-per-node 9 must be between 1 and distributed.gpus \(8\)"):
        report_gpus(cfg, ReportRequest(gpus_per_node=9), {})
