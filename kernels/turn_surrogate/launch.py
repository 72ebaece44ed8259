"""Launch choices of the turn-surrogate kernels: tokens per program, the kernel variant, the persistent grid.

Derivations and the measurements that chose each: README.md ("Launch", "Variants").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .._dispatch import interpreted

VARIANTS = ("masked", "stream", "persistent")


@dataclass(frozen=True)
class SurrogateLaunch:
    """How the kernels run (README.md, "Variants"); the results agree to fp32 rounding whatever the choice.

    ``variant``: ``masked`` (the default) loads a token's inputs under its counted-token mask; ``stream`` loads
    every in-bounds token (128-bit loads, issued without waiting for seg_id) and zeroes the rest; ``persistent``
    is ``stream`` with a grid of ``programs_per_sm`` programs per SM that walk the blocks in a fixed order, so
    the partial-sum buffer has one row per program and the finish kernel one step.
    """

    variant: str = "masked"
    num_warps: int = 8
    programs_per_sm: int = 2

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown turn-surrogate variant {self.variant!r}; valid: {', '.join(VARIANTS)}")


def resident_programs(device: torch.device, per_sm: int) -> int:
    """Programs of a persistent grid: ``per_sm`` per SM of a CUDA device (132 SMs, an H100's, elsewhere) and 3
    on the interpreter, so that small test batches still walk several blocks per program."""
    if interpreted():
        return 3
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return sms * per_sm


def gpu_block(n: int) -> int:
    """Tokens per program on a GPU (8 warps: 8 tokens a thread), whether or not Triton is interpreted."""
    return 2048


def default_block(n: int) -> int:
    """Tokens per program: :func:`gpu_block` on a GPU; on the interpreter few, large programs (it pays per program)."""
    if interpreted():
        return max(128, min(4096, triton.next_power_of_2(max(n, 1))))
    return gpu_block(n)


