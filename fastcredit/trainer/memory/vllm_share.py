"""vLLM's share of the GPU (``rollout.gpu_memory_utilization``), auto or fixed, checked before the engine starts.

    util = engine_memory_utilization(free, total, margin, weight_bytes, min_kv_bytes)   # 0: auto
    check_fixed_utilization(0.7, free, total)                                           # a fixed share

vLLM's share with gpu_memory_utilization=0 (auto) is (free - margin) / total rounded down to
0.01, free being measured with the training state offloaded; a fixed share above what is free
makes vLLM refuse to start.
"""
from __future__ import annotations

import math

from fastcredit.trainer.memory.units import GIB


class MemoryBudgetError(ValueError):
    """The GPU cannot hold what vLLM needs; the message gives the numbers in GiB."""


def auto_share(free_bytes: float, total_bytes: float, margin_bytes: float) -> float:
    """``(free - margin) / total`` rounded down to 0.01 (it may be negative: nothing is free)."""
    return math.floor((free_bytes - margin_bytes) / total_bytes * 100 + 1e-9) / 100


def engine_memory_utilization(free_bytes: float, total_bytes: float, margin_bytes: float, weight_bytes: float,
                              min_kv_bytes: float) -> float:
    """rollout.gpu_memory_utilization=0: ``(free - margin) / total`` rounded down to 0.01.

    Raises MemoryBudgetError when that share cannot hold the weights and ``min_kv_bytes``
    (the KV cache of one sequence at the longest context)."""
    util = auto_share(free_bytes, total_bytes, margin_bytes)
    need = weight_bytes + min_kv_bytes
    if util <= 0 or util * total_bytes < need:
        share = max(util, 0)
        raise MemoryBudgetError(
            f"vLLM would get {share:.2f} x {total_bytes / GIB:.1f} GiB = {share * total_bytes / GIB:.1f} GiB "
            f"({free_bytes / GIB:.1f} GiB free minus a {margin_bytes / GIB:.1f} GiB margin), but its weights "
            f"({weight_bytes / GIB:.1f} GiB) and the KV cache of one longest sequence ({min_kv_bytes / GIB:.2f} GiB) "
            f"need {need / GIB:.1f} GiB: free GPU memory (retrieval index off the GPU, more GPUs) or lower "
            "rollout.memory_margin_gib")
    return util


def check_fixed_utilization(util: float, free_bytes: float, total_bytes: float) -> None:
    """A fixed rollout.gpu_memory_utilization asks for ``util x total``; vLLM v1 refuses to start when that is
    more than is free. Raises MemoryBudgetError saying so in GiB."""
    if util * total_bytes > free_bytes:
        auto = max(0.0, auto_share(free_bytes, total_bytes, 0))
        raise MemoryBudgetError(
            f"rollout.gpu_memory_utilization={util:g} asks vLLM for {util * total_bytes / GIB:.1f} GiB of the "
            f"{total_bytes / GIB:.1f} GiB GPU, but only {free_bytes / GIB:.1f} GiB are free: lower it, or set it to 0 "
            f"(auto: {auto:.2f} minus rollout.memory_margin_gib)")
