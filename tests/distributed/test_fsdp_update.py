"""The same global batch gives the same update on one process and on two FSDP2 ranks (gloo)."""
import os
import sys

import pytest
import torch

from tests.commands import run_main, run_process

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "fsdp_update.py")


def _run(cmd, env):
    """``cmd``: the script's argv (its ``main`` in this process, on one process) or a torchrun's command line."""
    proc = run_process(cmd, timeout=600, env=env) if cmd[0] == sys.executable else \
        run_main("tests.distributed.fsdp_update", cmd, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


AGGS = ("turn-mean", "seq-mean-token-mean")


@pytest.fixture(scope="module")
def updates(tmp_path_factory):
    """Each aggregation's update on one process and on two FSDP2 ranks (one run each, every aggregation in it)."""
    tmp = tmp_path_factory.mktemp("fsdp_update")
    env = {**os.environ, "AGG": ",".join(AGGS), "OMP_NUM_THREADS": "1"}
    one, two = tmp / "one.pt", tmp / "two.pt"
    _run([str(one)], env)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT, str(two)], env)
    return torch.load(one), torch.load(two)


@pytest.mark.parametrize("agg", AGGS)
def test_two_fsdp2_ranks_match_one_process(updates, agg):
    a, b = updates[0][agg], updates[1][agg]
    for k in a["params"]:
        torch.testing.assert_close(b["params"][k], a["params"][k], rtol=0, atol=1e-6, msg=k)
    for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert abs(a["metrics"][k] - b["metrics"][k]) < 1e-5, k
