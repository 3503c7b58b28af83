"""Calling a TorchScript forward of blade's without the graph executor's optimization.

A forward that is more than one engine call (an archive's size dispatch between captures, a
torch.compile graph with glue ops between engines) runs through TorchScript's profiling graph
executor, which profiles the graph on its first call and optimizes it on its second: 19 of the
22 ms of a served BERT archive's first call (two captures, 1 thread), against 3.5 ms without.
Its optimizations have nothing to do on these graphs (the work is in the engines, and torch's
CPU fusion is off by default), and the unoptimized plan runs as fast from then on (1 thread,
medians: 1.84 against 1.85 ms at 2x33; GPT-2 through torch.compile, glue ops between its
engines: 1.07 against 1.28 ms at 1x17, 12.0 against 12.1 ms at 4x65).

``torch.jit.optimized_execution(False)`` says so per thread (the flag is thread-local in torch),
so each call sets it for its own duration and restores the caller's value: the user's other
TorchScript modules are optimized as before. A C++ server (torch::jit::load) keeps the executor's
default.
"""
from __future__ import annotations

import torch

# torch._C._get_graph_executor_optimize(value) sets the thread's flag and returns its old value
_swap_optimize = torch._C._get_graph_executor_optimize
_set_optimize = torch._C._set_graph_executor_optimize


def unoptimized(method):
    """method (a ScriptMethod, or any callable) called with the graph executor's optimization off."""
    def call(*args, **kwargs):
        was = _swap_optimize(False)
        try:
            return method(*args, **kwargs)
        finally:
            _set_optimize(was)
    return call
