"""Units of the memory report: bytes inside, GiB (2**30 bytes) and token counts in the text."""
from __future__ import annotations

GIB = 2 ** 30


def gib_text(num_bytes: float) -> str:
    """Bytes as GiB with one decimal, as every table cell and message shows them."""
    return f"{num_bytes / GIB:.1f}"


def tokens_text(count: float) -> str:
    """A token count: 1.87M, 655.4k or 812."""
    if count >= 1e6:
        return f"{count / 1e6:.2f}M"
    if count >= 1e3:
        return f"{count / 1e3:.1f}k"
    return f"{int(count)}"
