"""Statistics over repeated measurements that the comparison report and the benchmarks share.

    mean, half = mean_interval([0.41, 0.44, 0.39])   # the mean and the half-width of its 95% interval

A 95% interval over n values uses Student's t with n - 1 degrees of freedom (the table below, 1 to 10; 1.96
beyond): seeds of a comparison and rounds of a benchmark are few.
"""
from __future__ import annotations

import math
from typing import Optional

# Two-sided 97.5% quantiles of Student's t for 1..10 degrees of freedom; 1.96 beyond.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def mean_interval(xs: list[float]) -> tuple[float, Optional[float]]:
    """``(mean, half-width of the 95% interval)``; the half-width is None for fewer than two values."""
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return mean, None
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    return mean, (T975[n - 2] if n - 1 <= len(T975) else 1.96) * sd / math.sqrt(n)
