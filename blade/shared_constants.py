"""``sharing_constants()``: the engines made inside it hold one tensor per distinct constant.

An export with several captures (blade/size_variants.py: e.g. BERT's seq-1 capture) compiles the
model once per capture, and each capture's engines load their weights from their own ONNX model:
equal bytes in separate tensors. torch.jit.save writes one record per storage (its pickler memoizes
storages by identity, not by content) and torch.jit.load restores one storage per record, so without
sharing the archive held every weight once per capture, on disk and in the loaded process (measured
on bench/dynamic.py's BERT with seq from 1: 84 MiB archive instead of 42). Inside the scope, a
constant equal to one an earlier engine took (dtype, shape and bytes: SHA-256, then compared byte
for byte, so a hash collision cannot merge different weights) is that earlier tensor; the runtime
then also packs such a weight once for all engines (cpp/runtime.cpp, packs shared by address).
Constants are never written by engines, so sharing them changes no result. compile_fx opens a
scope per graph (engines of one graph share too), export's compile_model one over all captures.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib

import numpy as np
import torch

_pool: contextvars.ContextVar[dict | None] = contextvars.ContextVar("blade_constant_pool", default=None)


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


@contextlib.contextmanager
def sharing_constants():
    """Engines made inside share equal constants (nested scopes share the outer one's)."""
    if _pool.get() is not None:
        yield
        return
    token = _pool.set({})
    try:
        yield
    finally:
        _pool.reset(token)


def shared(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor an earlier engine of the scope took with the same dtype, shape and bytes, else
    ``tensor`` (remembered for the next ones). Outside a scope: ``tensor``. The tensor itself, not
    an equal one: torch.jit.save shares a record between tensors of one storage only."""
    pool = _pool.get()
    if pool is None:
        return tensor
    data = _bytes(tensor)
    key = (str(tensor.dtype), tuple(tensor.shape), hashlib.sha256(memoryview(data)).hexdigest())
    earlier = pool.setdefault(key, tensor)
    return earlier if earlier is tensor or np.array_equal(_bytes(earlier), data) else tensor
