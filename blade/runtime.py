"""Torch-side construction of ``torch.classes.blade.Engine`` from a compiled cluster."""
from __future__ import annotations

import json

import numpy as np
import torch

import blade._C  # noqa: F401  (registers torch.classes.blade.Engine)
from blade.engine.compiler import load_constants
from blade.engine.manifest import Manifest
from blade.shared_constants import shared


def make_engine(name: str, so_bytes: bytes, manifest: Manifest, onnx_model, info: dict, *,
                fallback_module: bytes = b"", fallback_mode: str = "off", rtol: float = 1e-4,
                atol: float = 1e-5, ops_source: str = ""):
    """An Engine holding the .so bytes, its tensor specs and its run-time constants; with
    fallback_module (a torch.jit.save'd subgraph, blade.subgraph) it can run in a debugging mode.
    Inside blade.shared_constants.sharing_constants(), equal constants of its engines are one tensor."""
    constants = [shared(torch.from_numpy(np.array(c, order="C"))) for c in load_constants(onnx_model, manifest)]
    so_tensor = torch.frombuffer(bytearray(so_bytes), dtype=torch.uint8)
    return torch.classes.blade.Engine(
        name, so_tensor, manifest.isa, manifest.abi_version,
        [t.name for t in manifest.inputs], [t.dtype for t in manifest.inputs],
        [manifest.shape_codes(t) for t in manifest.inputs],
        [t.name for t in manifest.outputs], [t.dtype for t in manifest.outputs],
        [manifest.shape_codes(t) for t in manifest.outputs],
        constants, manifest.scratch_bytes, json.dumps(info),
        torch.frombuffer(bytearray(fallback_module), dtype=torch.uint8) if fallback_module
        else torch.empty(0, dtype=torch.uint8),
        fallback_mode, rtol, atol, ops_source,
        [s.name for s in manifest.symbols], [[s.min, s.max] for s in manifest.symbols])
