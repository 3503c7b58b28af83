"""A served process's peak memory stays where the largest shape put it: glibc's mmap threshold.

glibc's malloc serves a block above its mmap threshold (128 KiB at start) with an mmap of its own
and unmaps it on free, but each such free raises the threshold to the freed block's size (up to
32 MiB on 64-bit), and the trim threshold to twice that. From then on blocks of that size come
from the heap, which keeps its pages: a server that has run its largest shape once (BERT 4L-256
at 16x512: 8 MiB outputs, mapped then unmapped) then holds the next such blocks in heap pages
next to the pages it already had. A served BERT archive (batch 1-16, seq 1-512; bench/dynamic.py's
order: the largest point three times, the grid, 30 random shapes) rose +8 MiB of peak RSS after
the largest shape in this probe, +56 MiB in the bench's run; with the threshold fixed at 128 KiB
+0.2 MiB, and the peak itself 648 against 701-742 MiB (two runs each). Steady latency at 1x16,
4x128, 16x512 did not move beyond the noise (the engines' intermediates live in their scratch
arenas, not in malloc; a mapped block is only an output or a glue op's tensor).

Setting the threshold once (mallopt M_MMAP_THRESHOLD) also turns glibc's adjustment off. It is
process-wide, so blade sets it only when asked (BLADE_MMAP_THRESHOLD, in bytes; 0, the default,
leaves malloc alone) and only when it loads an archive to serve (blade.load), never when the user
has set one (MALLOC_MMAP_THRESHOLD_ in the environment) or off glibc.

It is off by default because the flat peak is paid on every call: each block above the threshold
is a fresh mapping whose pages fault in again, for every large tensor of the process (eager's and
other libraries' too, not only blade's). A served pointwise [64, 4096] archive (1 MiB output), one
thread, CPU time: 0.82 ms with malloc left alone, 1.42 ms at 128 KiB (ONNX Runtime, with its own
arena, 1.02); eager in the same process 2.0 -> 7 ms.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_applied = False


def bound_large_blocks(threshold: int) -> bool:
    """Blocks of at least ``threshold`` bytes mapped on allocation and unmapped on free from now
    on, in the whole process; whether it was set (once per process; 0, a user's own setting or
    a libc that is not glibc leave malloc as it is)."""
    global _applied
    if _applied or threshold <= 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return _applied
    libc = _glibc()
    if libc is None:
        return False
    _applied = bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))
    return _applied


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (and this meaning of mallopt)
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc
