"""distributed.keep_host_memory: once applied, a freed large block is reused instead of being unmapped, so allocating
it again takes no fresh page faults. Measured in a fresh interpreter (the allocator's setting is process-wide and
one-way, and the test's own process may already have it), by page-fault counts, not time."""
import json
import subprocess
import sys

import pytest

from fastcredit.runtime.host_memory import glibc, host_memory_note

PROBE = r"""
import json, resource, torch
from fastcredit.runtime.host_memory import keep_freed_memory

def faults(rounds=6, mib=64):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):  # what a training pass does with its logits: a large block, written, freed
        x = torch.empty(mib * 2**20 // 4)
        x.fill_(1.0)
        del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = faults()
why = keep_freed_memory()
faults(20)  # the heap settles: a few rounds grow it, until what was freed around small blocks coalesces
print(json.dumps({"default": default, "kept": faults(), "why": why}))
"""


@pytest.mark.skipif(glibc() is None, reason="the C library is not glibc, whose allocator this setting tunes")
def test_kept_host_memory_is_reused_without_page_faults():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    pages = 64 * 2**20 // 4096  # one 64 MiB block's 4 KiB pages
    assert got["why"] is None
    assert got["default"] >= 5 * pages  # glibc maps each block afresh, every round faults its pages in
    # the same block again and again from the settled heap: less than one block's pages in the six rounds
    assert got["kept"] < pages


def test_the_setting_says_what_it_came_to():
    assert host_memory_note(False, on_cpu=True) is None
    assert host_memory_note("auto", on_cpu=False) is None  # a GPU run: the CUDA allocator keeps its own
    if glibc() is not None:
        assert "stays in the process" in host_memory_note("auto", on_cpu=True)
        assert "stays in the process" in host_memory_note(True, on_cpu=False)
