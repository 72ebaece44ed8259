"""Two nodes on loopback: two torchrun agents (``--nnodes=2``, c10d rendezvous, one rank each; launched by
tests/distributed/two_nodes.py) train two steps of the debug config into one run folder, then one process resumes
their checkpoint for a third step (2 ranks -> 1). docs/multinode.md is the guide this test backs."""
import json
import os
import shutil
import sys

import pytest

from tests.commands import run_main, run_process

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LAUNCH = os.path.join(HERE, "two_nodes.py")
# the debug config on the small toy world of tests/test_train.py; no held-out evaluation, one checkpoint at the end
SMALL = ["data.toy.num_people=80", "data.toy.num_companies=20", "data.toy.num_questions=60", "eval.questions=0",
         "logging.checkpoint_every=0"]
TIMEOUT_S = 300  # above two_nodes.py's own deadline (240 s), so that it stops its agents itself
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def train_args(out, world) -> list:
    return ["--config", os.path.join(ROOT, "configs", "debug.yaml"), f"logging.output_dir={out}",
            f"data.world_dir={world}", *SMALL]


def metrics(out) -> list:
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def manifest(out, step: int) -> dict:
    return json.load(open(os.path.join(out, "checkpoints", f"step_{step:06d}", "manifest.json")))


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Two steps on two nodes: (run folder, toy world folder, the launcher's process, each node's output)."""
    base = tmp_path_factory.mktemp("multinode")
    out, world, logs = str(base / "run"), str(base / "world"), str(base / "logs")
    proc = run_process([sys.executable, LAUNCH, logs, "-m", "fastcredit.train", *train_args(out, world)],
                       timeout=TIMEOUT_S, env={**os.environ, **ENV})
    node_logs = []
    for n in (0, 1):
        with open(os.path.join(logs, f"node{n}.log"), encoding="utf-8", errors="replace") as f:
            node_logs.append(f.read())
    return out, world, proc, node_logs


@pytest.mark.slow
def test_two_nodes_train_two_steps_into_one_run_folder(two_nodes):
    out, _, proc, node_logs = two_nodes
    said = proc.stdout + proc.stderr + "".join(f"\n--- node{n}:\n{log[-3000:]}" for n, log in enumerate(node_logs))
    assert proc.returncode == 0, said
    assert json.loads(proc.stdout) == {"node0": 0, "node1": 0, "stopped": False}
    # rank 0 (on whichever node the rendezvous gave it) prints the header; the other node's rank prints nothing
    header = "fastcredit.train: debug · estimator grpo · 2 process(es) on cpu"
    assert sorted(header in log for log in node_logs) == [False, True], said
    assert [r["step"] for r in metrics(out) if "reward" in r] == [1, 2]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step_000002"]
    m = manifest(out, 2)
    assert m["world_size"] == 2 and m["step"] == 2
    # each rank's FSDP2 shard and RNG state, written from its own node into the one folder
    assert {"model/__0_0.distcp", "model/__1_0.distcp", "rng_rank0.pt", "rng_rank1.pt"} <= set(m["files"])


@pytest.mark.slow
def test_one_process_resumes_the_two_node_checkpoint(two_nodes, tmp_path):
    src, world, proc, _ = two_nodes
    if proc.returncode != 0:
        pytest.skip("the two-node run failed (test_two_nodes_train_two_steps_into_one_run_folder says why)")
    out = str(tmp_path / "resumed")  # a copy: the module's run stays as the two nodes left it
    shutil.copytree(src, out)
    resumed = run_main("fastcredit.train", [*train_args(out, world), "optim.total_steps=3", "--resume"],
                       env={**os.environ, **ENV})
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "· 1 process(es) on cpu" in resumed.stdout
    step2 = os.path.join(out, "checkpoints", "step_000002")
    assert f"resumed from {step2} (step 2)" in resumed.stdout, resumed.stdout[-3000:]
    rows = [r for r in metrics(out) if "reward" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["offpolicy/version_lag_max"] == 0.0  # the engine was synced to the resumed weights
    assert open(os.path.join(out, "checkpoints", "latest")).read().strip() == "step_000003"
    m = manifest(out, 3)
    assert m["world_size"] == 1 and "model/__0_0.distcp" in m["files"]
    assert not {"model/__1_0.distcp", "rng_rank1.pt"} & set(m["files"])
