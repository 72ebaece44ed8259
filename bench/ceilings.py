"""The device's measured ceilings that throughput is reported against (CUDA only).

``time_ms(fn)`` is the caller's timer (median milliseconds of one call).
"""
from __future__ import annotations

from typing import Callable

import torch


def copy_bandwidth_gbps(time_ms: Callable[[Callable], float]) -> float:
    """GB/s of a 1 GiB device-to-device copy, read + write counted."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def bf16_matmul_tflops(time_ms: Callable[[Callable], float], n: int = 8192) -> float:
    """TFLOP/s of an n³ bf16 cuBLAS GEMM."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12
