"""Whose RAM ``--memory-report`` judges a node by: --host-gib; else this machine's MemTotal when it is a node of the
plan (a GPU for each of the node's ranks); else an 8 x H100 DGX node's 2 TiB, said in the report. A laptop or a login
node without a GPU plans a cluster job without five host-RAM errors about itself."""
import os

import pytest

from fastcredit.trainer.memory import request
from fastcredit.train import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CRITIC = os.path.join(ROOT, "configs", "criticsearch.yaml")
REPORT = ["--config", CRITIC, "--memory-report", "--gpu-gib", "80", "--gpus", "8"]


@pytest.fixture
def machine(monkeypatch):
    """This machine as the test states it: ``machine(gpus, mem_gib)``; no torchrun variables."""
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def state(gpus: int, mem_gib: float):
        monkeypatch.setattr(request, "local_gpus", lambda: (gpus, 80.0 if gpus else None))
        monkeypatch.setattr("fastcredit.trainer.memory.machine_memory_gib", lambda: mem_gib)
    return state


def test_without_a_gpu_the_node_is_the_targets_default_and_the_report_says_so(machine, capsys):
    machine(0, 23.5)  # this project's CPU machines
    assert main(REPORT) == 0
    out = capsys.readouterr().out
    assert "2048.0 GiB of RAM a node (default: an 8 x H100 DGX node's 2 TiB (no GPU here" in out
    assert "--host-gib states the target's" in out and "problems: none" in out and "OVER" not in out


def test_with_the_nodes_gpus_here_this_machines_ram_is_the_nodes(machine, capsys):
    machine(8, 23.5)  # an 8-GPU node with too little RAM for the plan: judged by its own figures
    assert main(REPORT) == 2
    out = capsys.readouterr().out
    assert "23.5 GiB of RAM a node (MemTotal of this machine, /proc/meminfo)" in out
    assert out.count("ERROR: host: the ") >= 1 and "OVER" in out
    machine(8, 2048.0)
    assert main(REPORT) == 0


def test_a_workstation_with_fewer_gpus_than_a_node_plans_for_the_target(machine, capsys):
    machine(1, 64.0)
    assert main(REPORT) == 0
    assert "this machine has 1 GPU(s), the plan 8 a node" in capsys.readouterr().out
    assert main([*REPORT, "--gpus-per-node", "1"]) == 0  # one GPU a node: this machine is such a node
    assert "64.0 GiB of RAM a node (MemTotal of this machine" in capsys.readouterr().out


def test_host_gib_always_wins_and_a_plan_that_cannot_run_still_exits_2(machine, capsys):
    machine(0, 23.5)
    # the state offloaded, as these figures count it (auto keeps it on the GPU here, which needs no host RAM for it)
    assert main([*REPORT, "distributed.offload_state=true", "--host-gib", "100"]) == 2
    out = capsys.readouterr().out
    assert "100.0 GiB of RAM a node (--host-gib)" in out and "ERROR: host: the rollout phase needs" in out
