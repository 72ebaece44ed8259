"""DeepSpeed ZeRO on two gloo ranks gives the same update as one plain process (tests/distributed/fsdp_update.py).

Two PPO epochs (two optimizer steps, the second with ratio clipping active) over the
same global batch: the reference is one process without any engine wrapping; the
DeepSpeed run partitions every parameter (ZeRO-3) or the gradients and optimizer state
(ZeRO-2), recomputes the decoder layers (activation checkpointing) and moves its state
through the colocation offload / reload first.
"""
import os
import sys

import pytest
import torch

from tests.commands import run_main, run_process

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "fsdp_update.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "EPOCHS": "2"}


def _run(cmd, env):
    """``cmd``: the script's argv (its ``main`` in this process, on one process) or a torchrun's command line."""
    proc = run_process(cmd, timeout=600, env=env) if cmd[0] == sys.executable else \
        run_main("tests.distributed.fsdp_update", cmd, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.fixture(scope="module")
def updates(tmp_path_factory):
    """The update on one process, and on two DeepSpeed ranks at ZeRO-3 and ZeRO-2 (one torchrun, a fresh engine
    each)."""
    tmp = tmp_path_factory.mktemp("deepspeed_update")
    one, two = tmp / "one.pt", tmp / "two.pt"
    _run([str(one)], ENV)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT, str(two)],
         {**ENV, "ENGINE": "deepspeed", "ZERO": "3,2"})
    return torch.load(one), torch.load(two)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3, 2])
def test_two_deepspeed_ranks_match_one_process(updates, stage):
    a, b = updates[0], updates[1][f"zero{stage}"]
    assert sorted(b["params"]) == sorted(a["params"])  # the HF names the weight sync streams
    # The same bounds as the FSDP2 test: fp32 sums in another order (two ranks' halves,
    # reduce-scatter, ZeRO's flat partitions) round differently, ~1e-8 here; with SGD at lr 1
    # a parameter's change is its gradient, so a wrongly scaled or dropped micro-batch or
    # rank (a factor of 2 somewhere) is off by 1e-2 or more, far outside 1e-6.
    for k in a["params"]:
        torch.testing.assert_close(b["params"][k], a["params"][k], rtol=0, atol=1e-6, msg=k)
    assert a["metrics"]["actor/clipfrac"] > 0  # the second epoch really clips
    for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/clipfrac", "actor/approx_kl"):
        assert abs(a["metrics"][k] - b["metrics"][k]) < 1e-5, k
