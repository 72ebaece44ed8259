"""Damaged checkpoints beyond one process: two gloo ranks with FSDP2 shards agree on the checkpoint to resume
(each hashes its share of the files). The trainer's own resume past a damaged checkpoint is in tests/test_train.py,
on the run its resume tests share."""
import json
import os
import subprocess
import sys

import torch

from fastcredit.distributed.checkpoint import resume_checkpoint, save_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))


def _overwrite_4k(f):
    size = os.path.getsize(f)
    with open(f, "r+b") as h:
        h.seek(size // 2 - 2048)
        h.write(b"\xff" * 4096)


def _two_rank_worker(root: str, rank: int, store: str) -> None:
    """One of two gloo ranks: FSDP2-sharded steps 1-3 saved; rank 1's RNG file of step 3 deleted and 4 KiB of
    rank 1's shard of step 2 overwritten; the resume must land on step 1 on both ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    fully_shard(m, mesh=init_device_mesh("cpu", (2,)))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)

    def step():
        m(torch.randn(3, 8)).sum().backward()
        opt.step()
        opt.zero_grad()

    saved = {}
    for s in (1, 2, 3):
        step()
        save_checkpoint(root, s, {"policy": m}, {"policy": opt}, {"data": {"cursor": s}}, keep=3)
        saved[s] = [p.to_local().detach().clone() for p in m.parameters()]
    if rank == 0:
        os.remove(os.path.join(root, "step_000003", "rng_rank1.pt"))
        _overwrite_4k(os.path.join(root, "step_000002", "model", "__1_0.distcp"))
    dist.barrier()
    step()
    said = []
    path, state = resume_checkpoint(root, {"policy": m}, {"policy": opt}, say=said.append)
    same = all(torch.equal(a, p.to_local()) for a, p in zip(saved[1], m.parameters()))
    manifest = json.load(open(os.path.join(root, "step_000001", "manifest.json")))
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump({"path": path, "step": state["step"], "weights": same, "said": said,
                   "world_size": manifest["world_size"], "files": sorted(manifest["files"])}, f)
    dist.destroy_process_group()


def test_two_ranks_agree_on_the_checkpoint_that_verifies(tmp_path):
    root = str(tmp_path / "ckpt")
    procs = [subprocess.Popen([sys.executable, __file__, root, str(r), str(tmp_path / "store")], cwd=HERE,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    r0, r1 = (json.load(open(os.path.join(root, f"rank{r}.json"))) for r in (0, 1))
    first = os.path.join(root, "step_000001")
    assert r0["path"] == r1["path"] == first and r0["step"] == r1["step"] == 1 and r0["weights"] and r1["weights"]
    assert r0["world_size"] == 2 and r0["files"] == ["model/.metadata", "model/__0_0.distcp", "model/__1_0.distcp",
                                                     "rng_rank0.pt", "rng_rank1.pt", "trainer.json"]
    assert r1["said"] == [] and r0["said"] == [
        f"checkpoint {root}/step_000003 cannot be used:\n  {root}/step_000003/rng_rank1.pt: missing (listed in "
        "manifest.json)",
        r0["said"][1],
        f"falling back to {first}, the newest checkpoint that verifies"]
    assert r0["said"][1].startswith(f"checkpoint {root}/step_000002 cannot be used:\n  "
                                    f"{root}/step_000002/model/__1_0.distcp: contents differ from manifest.json")


if __name__ == "__main__":
    _two_rank_worker(sys.argv[1], int(sys.argv[2]), sys.argv[3])
