"""Host memory that torch frees stays in the process on a CPU run: the next pass reuses it instead of faulting in
fresh zeroed pages.

    note = keep_freed_memory()      # glibc: large blocks from the heap, never trimmed; None where it did so

Torch's CPU allocator is the C library's ``malloc``. glibc serves a block above its mmap threshold (128 KiB at
first, rising with what was freed to at most 32 MiB) with a fresh ``mmap`` and gives it back with ``munmap`` when
it is freed, and trims the heap's free top above a threshold. A training pass allocates its activations, logits
and gradients again every micro-batch, so every pass touches fresh pages, and the kernel faults and zeroes each
one. Measured on the demo config (2-core Intel Xeon, torch 2.13): the update took 120-200 thousand minor page
faults a step, and how many varied by a factor of two between processes (the threshold's history), so the phase's
time varied between processes with it. With large blocks kept on the heap and no trimming it takes 21-29
thousand, and the update's median was 0.88x (four pairs of alternating processes, 0.77-0.98x).

The heap takes a few passes to settle: a block freed next to a small one that is still in use cannot hold the
same aligned block again, so the heap grows until such holes coalesce; after that nothing faults (a 64 MiB block
written and freed 40 times: faults on 7 of the first 9 rounds, none after; the resident size settles 128 MiB above
the default's). It is process-wide and one-way (``mallopt`` has no read-back): the resident size stays at its
peak. A GPU run's large buffers are the CUDA allocator's, which already keeps what it frees, so ``auto`` keeps
host memory only where training runs on the CPU.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Optional

# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
NEVER_TRIM = 2**31 - 1  # mallopt takes a C int: the heap's free top is trimmed only past 2 GiB


def glibc() -> Optional[ctypes.CDLL]:
    """The process's C library when it is glibc (the one whose ``mallopt`` this sets), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc's own symbol: musl and macOS have no such allocator knobs
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory() -> Optional[str]:
    """Tell glibc's ``malloc`` to serve large blocks from the heap (no ``mmap``, so none is unmapped when freed)
    and never to trim the heap. Returns None when done, else why not (another C library, or ``mallopt`` refused)."""
    libc = glibc()
    if libc is None:
        return "the C library is not glibc"
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)):
        return "glibc's mallopt refused the setting"
    return None


def host_memory_note(setting, on_cpu: bool) -> Optional[str]:
    """Apply ``distributed.keep_host_memory`` (``auto``: where training runs on the CPU) and return the console
    line that says what it came to, or None when it is off and nothing changed."""
    if setting is False or (setting == "auto" and not on_cpu):
        return None
    why = keep_freed_memory()
    if why is not None:
        return f"distributed.keep_host_memory: not applied ({why})"
    return "distributed.keep_host_memory: freed host memory stays in the process (glibc: no mmap, no trim)"
