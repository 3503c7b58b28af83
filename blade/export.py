"""Ahead-of-time export for serving: one TorchScript archive with the engines inside.

    blade.export(model, (ids, mask), "bert.blade.pt")     # traces, compiles, saves
    m = blade.load("bert.blade.pt")                        # fresh process: no tracing, no compiling
    outputs = m(ids, mask)                                 # a flat tuple of tensors

The archive is a plain TorchScript module: ``torch.jit.load`` works too once ``import blade`` has
registered the Engine class. Its inputs are the model's tensor arguments, flattened in order; its
outputs are the model's output tensors, flattened (pytree order).
"""
from __future__ import annotations

import json
import platform
import warnings

import torch
import torch.fx

import blade._C as _C
from blade.config import Config, current
from blade.engine.manifest import MANIFEST_FORMAT
from blade.pipeline import CompiledModule, compile_fx

ARCHIVE_FORMAT = 1
METADATA_FILE = "blade_metadata.json"


class ExportError(RuntimeError):
    """The model cannot be exported as a single graph (the message names the graph break)."""


def capture_graph(model, example_inputs: tuple) -> torch.fx.GraphModule:
    """One FX graph for the whole model, with flat tensor inputs and outputs."""
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch._dynamo.export's notice
            gm, _guards = torch._dynamo.export(model, *example_inputs)
    except Exception as err:  # dynamo's Unsupported / UserError name the break
        raise ExportError(f"blade.export needs one graph, but dynamo could not capture the model "
                          f"whole: {err}") from err
    gm.graph._codegen = torch.fx.graph.CodeGen()  # flat positional inputs, flat tuple output
    gm.recompile()
    return gm


def compile_model(model, example_inputs: tuple, config: Config | None = None) -> CompiledModule:
    """Capture and compile a model without dynamo guards: the CompiledModule behind export."""
    gm = capture_graph(model, tuple(example_inputs))
    flat_inputs = torch.utils._pytree.tree_leaves(tuple(example_inputs))
    return compile_fx(gm, flat_inputs, config or current())


def export(model, example_inputs: tuple, path: str, config: Config | None = None) -> CompiledModule:
    compiled = compile_model(model, example_inputs, config)
    metadata = {
        "archive_format": ARCHIVE_FORMAT,
        "manifest_format": MANIFEST_FORMAT,
        "abi_version": _C.abi_version(),
        "torch_version": torch.__version__,
        "isa": sorted({c.isa for c in compiled.report.clusters if c.isa}),
        "machine": platform.machine(),
        "coverage": compiled.report.coverage,
    }
    torch.jit.save(compiled.module, path, _extra_files={METADATA_FILE: json.dumps(metadata)})
    return compiled


def load(path: str) -> torch.jit.ScriptModule:
    return torch.jit.load(path)
