"""What the gpu-check stages share: where the repository is, whether CUDA is there, and a stage's result file."""
from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def record(out: str, stage: str, status: str, reason: str = "", **extra) -> None:
    with open(os.path.join(out, f"stage_{stage}.json"), "w") as f:
        json.dump({"stage": stage, "status": status, "reason": reason, **extra}, f, indent=1)
    print(f"[gpu-check] {stage}: {status}{' (' + reason + ')' if reason else ''}", flush=True)


def cuda_available() -> bool:
    """Whether CUDA is there. gpu_check.sh asks torch once and passes the answer on (``GPU_CHECK_CUDA``), so that a
    stage that does not run without CUDA does not import torch again to learn it."""
    told = os.environ.get("GPU_CHECK_CUDA")
    if told in ("0", "1"):
        return told == "1"
    import torch

    return torch.cuda.is_available()
