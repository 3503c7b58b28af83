"""Ahead-of-time export for serving: one TorchScript archive with the engines inside.

    blade.export(model, (ids, mask), "bert.blade.pt")     # captures, compiles, saves
    m = blade.load("bert.blade.pt")                        # any process: no tracing, no compiling
    outputs = m(ids, mask)                                 # a flat tuple of tensors

The archive is a plain TorchScript module: ``torch.jit.load`` works too once ``import blade`` has
registered the Engine class (and so does ``torch::jit::load`` in C++ with blade's runtime library
linked, see examples/cpp). Its inputs are the model's tensor arguments, flattened in order; its
outputs are the model's output tensors, flattened (pytree order). The archive carries the stamps of
blade.aot (torch version, formats, ABI, ISA) as the extra file ``blade_metadata.json``;
``blade.load`` checks them first and names every mismatch.

Integrity: torch.jit.load reads records without checking the zip's CRC-32s (a flipped weight
byte loads as a wrong weight), so ``blade.load`` first reads every record back against its CRC-32
(any damage of up to 32 bits in a row is caught for sure, longer damage but for a 2**-32 chance)
and raises ``CorruptArtifact`` naming the record. Each Engine also carries SHA-256 hashes of its
.so, constants and fields, checked before its .so is loaded, which protects ``torch.jit.load`` and
C++ loaders too (engine_state.h); the rest of the archive (code, pickles, TorchScript constants)
is protected only by ``blade.load``'s check.
"""
from __future__ import annotations

import json
import os
import secrets
import warnings
import zipfile

import torch
import torch.fx

from blade.aot import CorruptArtifact, check_stamps, make_stamps
from blade.config import Config, current
from blade.pipeline import CompiledModule, compile_fx

METADATA_FILE = "blade_metadata.json"


class ExportError(RuntimeError):
    """The model cannot be exported as a single graph (the message names the graph break)."""


def capture_graph(model, example_inputs: tuple) -> torch.fx.GraphModule:
    """One FX graph for the whole model, with flat tensor inputs and outputs."""
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch._dynamo.export's notice
            # Static shapes (engines are specialized to them anyway): dynamo's dim-constraint
            # solver has nothing to do, and on some models (transformers' ResNet) it logs a
            # page of sympy tracebacks while failing to print a constraint it never needed.
            gm, _guards = torch._dynamo.export(model, *example_inputs, assume_static_by_default=True,
                                               disable_constraint_solver=True)
    except Exception as err:  # dynamo's Unsupported / UserError name the break and its source line
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


def _atomic_jit_save(module, path: str, extra_files: dict) -> None:
    """torch.jit.save to a temp file beside path, then os.replace: readers never see half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".blade-export-{secrets.token_hex(8)}.tmp")
    # Mode 0666 less the umask, like open(): tempfile.mkstemp's 0600 would hide the archive from a
    # server running as another user.
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        torch.jit.save(module, tmp, _extra_files=extra_files)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def export(model, example_inputs: tuple, path: str, config: Config | None = None) -> CompiledModule:
    """Capture ``model`` as one graph, compile it, and save the archive at ``path``."""
    config = config or current()
    compiled = compile_model(model, example_inputs, config)
    stamps = make_stamps(compiled.report, config.fallback)
    if not stamps["engines"]:
        warnings.warn(f"blade.export: no cluster of the model compiled to an engine; {path} is plain "
                      f"TorchScript")
    _atomic_jit_save(compiled.module, path, {METADATA_FILE: json.dumps(stamps)})
    return compiled


def read_stamps(path: str) -> dict | None:
    """The archive's stamps, or None when it is not a blade archive. Read from the zip directly:
    torch.jit.load would build the Engines (and fail on a mismatch) before we could check."""
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if n.endswith(f"/extra/{METADATA_FILE}")]
        return json.loads(archive.read(names[0])) if names else None


def verify_archive(path: str) -> None:
    """Read every record of the archive back against its CRC-32; CorruptArtifact if one differs or
    the zip structure itself is damaged."""
    with open(path, "rb") as file:  # a missing or unreadable file is an OSError, not damage
        try:
            with zipfile.ZipFile(file) as archive:
                for info in archive.infolist():
                    with archive.open(info) as record:  # raises at the end on a CRC mismatch
                        while record.read(1 << 20):
                            pass
        except Exception as err:  # noqa: BLE001 - whatever zipfile trips over in damaged bytes
            raise CorruptArtifact(f"blade archive {path} is damaged ({type(err).__name__}: {err}); nothing "
                                  f"of it was loaded. Restore a good copy or re-export the model") from err


def load(path: str) -> torch.jit.ScriptModule:
    """The exported module, after checking its bytes (CorruptArtifact) and its stamps against this
    process (clear error if they do not match; only a warning when the archive's engines carry
    their fallback)."""
    verify_archive(path)
    stamps = read_stamps(path)
    if stamps is None:
        raise ValueError(f"{path} is not a blade archive (no {METADATA_FILE}); use torch.jit.load")
    check_stamps(stamps, f"blade archive {path}")
    return torch.jit.load(path)
