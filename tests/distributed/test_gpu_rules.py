"""The GPU path's distributed rules, checked on two gloo ranks (tests/distributed/gpu_rules.py under torchrun).

Each check fails on the code before issue 29: the group was a bare ``nccl`` (no backend for the
CPU tensors of the reductions), whitening used each rank's own statistics, and every rank read
the policy's fp32 weights.
"""
import json
import os
import sys

import pytest
import torch

from fastcredit.distributed import process_group as pg
from tests.commands import run_process

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "gpu_rules.py")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from fastcredit.data.tokenizer import build_tiny_tokenizer
    from fastcredit.models.tiny import build_tiny_policy, save_tiny_policy

    tmp = tmp_path_factory.mktemp("gpu_rules")
    tok = build_tiny_tokenizer(["<search>where is the river</search> <answer>Paris</answer>"] * 20, vocab_size=300)
    folder = save_tiny_policy(build_tiny_policy(tok, hidden=32, layers=2, heads=2, seed=4), tok, str(tmp / "policy"))
    out = tmp / "out.json"
    env = {**os.environ, pg.EMULATE_NCCL_ENV: "1", "OMP_NUM_THREADS": "1"}
    proc = run_process([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        SCRIPT, str(out), folder], timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_group_built_as_on_gpus_serves_cpu_tensors(result):
    g = result["groups"]
    assert g["backend"] == "cpu:gloo,cuda:gloo" and g["serves_cpu"] and g["serves_cuda"]
    assert (g["max"], g["mean"], g["sum"]) == (6, 0.5, 2.0)
    assert g["uneven"] == {"x": 0.5, "a": 3.0} and g["empty"] == {"y": 2.0}


def test_a_bare_nccl_group_has_no_backend_for_cpu_tensors(result):
    # what the trainer's reductions met on GPUs with init_process_group("nccl"): the emulation reproduces it
    assert "No backend type associated with device type cpu" in result["groups"]["bare_nccl_cpu"]


@pytest.mark.parametrize("case", ["ppo_closed", "ppo_scan", "pica_turn"])
def test_whitening_over_ranks_matches_one_process(result, case):
    w = result["whitening"][case]
    assert w["max_err"] < 1e-6, w
    assert w["local_err"] > 1e-3, "each rank's own statistics must differ, or the check proves nothing"


def test_policy_read_on_rank0_only(result):
    ranks = result["rank0_loading"]["ranks"]
    assert [r["meta_on_this_rank"] for r in ranks] == [False, True]
    for r in ranks:
        assert all(err == 0.0 for err in r["errors"].values()), r["errors"]
    assert ranks[0]["inv_freq"] is not None and ranks[1]["inv_freq"] == ranks[0]["inv_freq"]
    assert ranks[1]["params"] == ranks[0]["params"] and ranks[0]["tied"] and ranks[1]["tied"]  # ties kept


def test_backend_for_each_device_and_request(monkeypatch):
    monkeypatch.delenv(pg.EMULATE_NCCL_ENV, raising=False)
    assert pg.backend_for("cuda") == pg.backend_for("cuda", "nccl") == "cpu:gloo,cuda:nccl"
    assert pg.backend_for("cuda", "gloo") == pg.backend_for("cpu") == "gloo"
    monkeypatch.setenv(pg.EMULATE_NCCL_ENV, "1")
    assert pg.backend_for("cpu") == "cpu:gloo,cuda:gloo" and pg.backend_for("cpu", "gloo") == "gloo"
    with pytest.raises(ValueError, match="distributed.backend"):
        pg.backend_for("cuda", "mpi")


def test_init_distributed_on_a_gpu_rank(monkeypatch):
    """Rank 3 of 8 on a (simulated) CUDA machine: its device, and the group it asks torch for."""
    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("device", torch.device(d)))
    monkeypatch.setattr(pg.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(pg.dist, "init_process_group", lambda backend, **kw: seen.setdefault("backend", backend))
    import torch.distributed.device_mesh as dm

    monkeypatch.setattr(dm, "init_device_mesh", lambda dev, shape, **kw: (dev, shape))
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    info = pg.init_distributed("auto")
    assert seen == {"device": torch.device("cuda", 3), "backend": "cpu:gloo,cuda:nccl"}
    assert info.device == torch.device("cuda", 3) and info.mesh == ("cuda", (8,))
