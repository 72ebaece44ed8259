"""A rank for tests/test_forkserver.py under torchrun: reports what it is (pid, session, environment, whether it
started warm), sums its rank over gloo, then does what MODE says (exit 0, exit 3 on rank 1, SIGKILL rank 1, hang)."""
import json
import os
import signal
import sys
import time

warm = "transformers" in sys.modules  # a forked rank has the server's preloaded modules; a cold one has none yet
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

out, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"pid": os.getpid(), "session": os.getsid(0) == os.getpid(), "warm": warm, "argv": sys.argv[1:],
               "local_rank": os.environ["LOCAL_RANK"], "path0": sys.path[0], "cwd": os.getcwd()}, f)
dist.init_process_group("gloo")
x = torch.tensor([float(rank + 1)])
dist.all_reduce(x)
print(f"rank {rank} sum {x.item():g}", flush=True)
dist.barrier()  # both have printed before either ends (a rank that fails ends the other: torchrun's SIGTERM)
dist.destroy_process_group()
if rank == 1 and mode == "exit3":
    sys.exit(3)
if rank == 1 and mode == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "hang":
    time.sleep(600)
