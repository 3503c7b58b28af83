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
byte loads as a wrong weight). So the archive also holds ``extra/blade_records.txt``, the SHA-256
of every other record (cpp/archive_check.h), and ``blade.load`` checks, before loading anything:
the zip structure and every record's CRC-32 (pure Python: no damaged header reaches torch's C++
reader), then the records' SHA-256s (``blade._C.verify_archive``, which C++ servers call before
``torch::jit::load``, see examples/cpp). Damage is a ``CorruptArtifact`` naming the record. Each
Engine also carries SHA-256s of its .so, constants and fields, checked before its .so is loaded,
so a plain ``torch.jit.load`` still never runs a damaged engine (engine_state.h).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import secrets
import warnings
import zipfile

import torch
import torch.fx

import blade._C as _C
from blade.aot import CorruptArtifact, check_stamps, make_stamps
from blade.config import Config, current
from blade.pipeline import CompiledModule, compile_fx

METADATA_FILE = "blade_metadata.json"
RECORDS_FILE = "blade_records.txt"     # "<sha256> <record>" per record but UNLISTED_RECORDS
# Not hashed: the list itself, and torch's id of the archive, which torch derives from all records
# (the list included) and reads back only as an id. cpp/archive_check.cpp skips the same two.
UNLISTED_RECORDS = (f"extra/{RECORDS_FILE}", ".data/serialization_id")


class ExportError(RuntimeError):
    """The model cannot be exported as a single graph (the message names the graph break)."""


def capture_graph(model, example_inputs: tuple) -> torch.fx.GraphModule:
    """One FX graph for the whole model, with flat tensor inputs and outputs."""
    try:
        with torch.no_grad(), warnings.catch_warnings(), _tensor_attributes_kept(model):
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


@contextlib.contextmanager
def _tensor_attributes_kept(model):
    """torch._dynamo.export leaves a buffer the model writes (``self.count += 1``) rebound to the
    fake tensor it traced with; bind every buffer and parameter back to the model's own tensor."""
    modules = list(model.modules()) if isinstance(model, torch.nn.Module) else []
    before = [(slots, name, tensor) for module in modules
              for slots in (module._buffers, module._parameters) for name, tensor in list(slots.items())]
    try:
        yield
    finally:
        for slots, name, tensor in before:
            slots[name] = tensor


def compile_model(model, example_inputs: tuple, config: Config | None = None) -> CompiledModule:
    """Capture and compile a model without dynamo guards: the CompiledModule behind export."""
    gm = capture_graph(model, tuple(example_inputs))
    flat_inputs = torch.utils._pytree.tree_leaves(tuple(example_inputs))
    return compile_fx(gm, flat_inputs, config or current())


def _atomic_jit_save(module, path: str, extra_files: dict, check=lambda tmp: None) -> None:
    """torch.jit.save to a temp file beside path, check(tmp), then os.replace: readers never see
    half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".blade-export-{secrets.token_hex(8)}.tmp")
    # Mode 0666 less the umask, like open(): tempfile.mkstemp's 0600 would hide the archive from a
    # server running as another user.
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        torch.jit.save(module, tmp, _extra_files=extra_files)
        check(tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _read_through(record):
    """The SHA-256 of an open zip record, read in chunks (zipfile checks its CRC-32 at the end)."""
    digest = hashlib.sha256()
    for chunk in iter(lambda: record.read(1 << 20), b""):
        digest.update(chunk)
    return digest


def record_digests(archive) -> dict:
    """Record name (without the archive's top dir) -> SHA-256 hex, for every record but
    UNLISTED_RECORDS. archive: a path or a binary file object."""
    digests = {}
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            name = info.filename.split("/", 1)[1]
            if name in UNLISTED_RECORDS:
                continue
            with zf.open(info) as record:
                digests[name] = _read_through(record).hexdigest()
    return digests


def _save_with_record_digests(module, path: str, extra_files: dict) -> None:
    """Saves the archive with extra/blade_records.txt listing the SHA-256 of every other record.
    torch.jit.save writes the records in one go, so a first save into memory learns them; the
    second (to disk) must write the same bytes, which is checked before it is published."""
    first = io.BytesIO()
    torch.jit.save(module, first, _extra_files=extra_files)
    digests = record_digests(first)
    records = "".join(f"{digest} {name}\n" for name, digest in sorted(digests.items()))

    def same_records(tmp: str) -> None:
        if record_digests(tmp) != digests:
            raise RuntimeError("blade.export: torch.jit.save wrote different records on two saves of one module, "
                               "so their hashes cannot be recorded")
    _atomic_jit_save(module, path, dict(extra_files, **{RECORDS_FILE: records}), check=same_records)


def export(model, example_inputs: tuple, path: str, config: Config | None = None) -> CompiledModule:
    """Capture ``model`` as one graph, compile it, and save the archive at ``path``."""
    config = config or current()
    compiled = compile_model(model, example_inputs, config)
    stamps = make_stamps(compiled.report, config.fallback)
    if not stamps["engines"]:
        warnings.warn(f"blade.export: no cluster of the model compiled to an engine; {path} is plain "
                      f"TorchScript")
    _save_with_record_digests(compiled.module, path, {METADATA_FILE: json.dumps(stamps)})
    return compiled


def read_stamps(path: str) -> dict | None:
    """The archive's stamps, or None when it is not a blade archive. Read from the zip directly:
    torch.jit.load would build the Engines (and fail on a mismatch) before we could check."""
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if n.endswith(f"/extra/{METADATA_FILE}")]
        return json.loads(archive.read(names[0])) if names else None


def check_zip(path: str) -> None:
    """CorruptArtifact unless the zip structure is sound and every record matches its CRC-32.
    Pure Python, so no damaged header reaches torch's C++ zip reader."""
    with open(path, "rb") as file:  # a missing or unreadable file is an OSError, not damage
        try:
            with zipfile.ZipFile(file) as archive:
                for info in archive.infolist():
                    with archive.open(info) as record:
                        _read_through(record)
        except Exception as err:  # noqa: BLE001 - whatever zipfile trips over in damaged bytes
            raise CorruptArtifact(f"blade archive {path} is damaged ({type(err).__name__}: {err}); nothing "
                                  f"of it was loaded. Restore a good copy or re-export the model") from err


def check_records(path: str) -> None:
    """CorruptArtifact unless every record matches its SHA-256 in extra/blade_records.txt (the
    check C++ servers run before torch::jit::load)."""
    try:
        _C.verify_archive(path)
    except RuntimeError as err:
        raise CorruptArtifact(str(err)) from err


def load(path: str) -> torch.jit.ScriptModule:
    """The exported module, after checking its bytes (CorruptArtifact) and its stamps against this
    process (clear error if they do not match; only a warning when the archive's engines carry
    their fallback)."""
    check_zip(path)
    stamps = read_stamps(path)
    if stamps is None:
        raise ValueError(f"{path} is not a blade archive (no {METADATA_FILE}); use torch.jit.load")
    check_stamps(stamps, f"blade archive {path}")
    check_records(path)
    return torch.jit.load(path)
