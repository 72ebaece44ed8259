"""fastcredit.distributed.weight_stream under torchrun (gloo): rank 0's weights arrive bit for bit in two other
ranks' engines over many small buckets of mixed dtypes, with their version; a sender that fails part-way raises
on every receiver instead of leaving it waiting."""
import os
import sys

import torch

from tests.commands import run_process

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weight_stream_ranks.py")


def test_weights_stream_to_every_rank_and_a_failed_sender_stops_them(tmp_path):
    proc = run_process([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                        SCRIPT, str(tmp_path)], timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    sender = torch.load(tmp_path / "rank0.pt")
    assert sender["sender_error"] == "the trainer's shard gather failed"
    for r in (1, 2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["equal"] and got["version"] == 5
        rest = got["rest"]
        assert set(rest) == {"scalar", "empty", "fp32"} and sender["sent"] == got["model_tensors"] + 3
        assert rest["scalar"].shape == () and float(rest["scalar"]) == 3.5 and rest["scalar"].dtype == torch.bfloat16
        assert rest["empty"].shape == (0, 4) and torch.equal(rest["fp32"], torch.arange(7, dtype=torch.float32))
        assert got["before_error"] == ["a"]
        assert "rank 0 failed while sending weights: ValueError: the trainer's shard gather failed" in \
            got["receiver_error"]
