"""A served process's peak memory can stay at the largest shape's (issue 12): with
BLADE_MMAP_THRESHOLD set, blade.load fixes glibc's mmap threshold (blade/malloc.py), so a block as
large as one already freed is mapped and unmapped again instead of coming from heap pages the
process then keeps. Off by default (page faults on every call), so malloc is left alone then."""
from __future__ import annotations

import pytest
import torch

import blade
from aot_testing import make_model_and_inputs, run_python

# In a fresh process: load the archive, free one 4 MiB tensor (glibc, left alone, raises its mmap
# threshold to 4 MiB here), then how much RSS a second one of that size leaves behind.
SCRIPT = """
import os, torch, blade
page = os.sysconf("SC_PAGE_SIZE")
def rss(): return int(open("/proc/self/statm").read().split()[1]) * page
served = blade.load({path!r})
torch.ones(1 << 20)
before = rss()
torch.ones(1 << 20)
print((rss() - before) / 2**20)
"""


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    model, inputs = make_model_and_inputs()
    path = tmp_path_factory.mktemp("served") / "block.blade.pt"
    blade.export(model, inputs, str(path))
    return path


def _kept_mib(path, **env) -> float:
    import os
    inherited = {k: v for k, v in os.environ.items() if k != "BLADE_MMAP_THRESHOLD"}  # the default
    return float(run_python(SCRIPT.format(path=str(path)), env={**inherited, **env}).strip().splitlines()[-1])


def test_a_freed_large_block_is_not_kept_after_load_with_the_threshold_set(archive):
    assert _kept_mib(archive, BLADE_MMAP_THRESHOLD=str(128 << 10)) < 0.5


def test_malloc_is_left_alone_by_default(archive):
    # (what the test above measures: glibc's own adjustment keeps the second block's pages)
    assert _kept_mib(archive) > 3
