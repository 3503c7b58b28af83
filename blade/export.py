"""Ahead-of-time export for serving: one TorchScript archive with the engines inside.

    blade.export(model, (ids,), "bert.blade.pt", kwargs={"attention_mask": mask})  # captures, compiles, saves
    m = blade.load("bert.blade.pt")                        # any process: no tracing, no compiling
    out = m(ids, attention_mask=mask)                      # the model's own output structure

The archive is a plain TorchScript module: ``torch.jit.load`` works too once ``import blade`` has
registered the Engine class (and so does ``torch::jit::load`` in C++ with blade's runtime library
linked, see examples/cpp). Its inputs are the model's tensor arguments, flattened in order (pytree
order of (args, kwargs)); its outputs are the model's output tensors, flattened (pytree order).
``blade.load`` wraps it so that it is called like the model (blade/signature.py: the structure of
inputs and outputs is saved as the extra file ``blade_signature.json``). The archive carries the
stamps of blade.aot (torch version, formats, ABI, ISA) as the extra file ``blade_metadata.json``;
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
import dataclasses
import hashlib
import inspect
import io
import json
import os
import re
import secrets
import warnings
import zipfile

import torch
import torch.fx
from torch._dynamo.functional_export import _dynamo_graph_capture_for_export
from torch.export.dynamic_shapes import _combine_args, _process_dynamic_shapes

import blade._C as _C
from blade.aot import CorruptArtifact, check_stamps, make_stamps
from blade.config import Config, current
from blade.dynamic import NotSymbolic, SizeSymbols, arguments_at
from blade.heap import frozen_heap
from blade.malloc import bound_large_blocks
from blade.pipeline import CompiledModule, compile_fx
from blade.shared_constants import sharing_constants
from blade.signature import SIGNATURE_FILE, ExportedModule, Signature
from blade.size_variants import (MAX_CAPTURES, Capture, UncoverableRange, captured_ranges, declared_dims, dispatcher,
                                  excluded_values, has_dims, inputs_at, shapes_with_fixed)

METADATA_FILE = "blade_metadata.json"
RECORDS_FILE = "blade_records.txt"     # "<sha256> <record>" per record but UNLISTED_RECORDS
# Not hashed: the list itself, and torch's id of the archive, which torch derives from all records
# (the list included) and reads back only as an id. cpp/archive_check.cpp skips the same two.
UNLISTED_RECORDS = (f"extra/{RECORDS_FILE}", ".data/serialization_id")


class ExportError(RuntimeError):
    """The model cannot be exported as a single graph (the message names the graph break)."""


def capture_graph(model, example_inputs: tuple, example_kwargs: dict | None = None,
                  dynamic_shapes=None) -> torch.fx.GraphModule:
    """One FX graph for the whole model, with flat inputs and outputs; the structures they were
    flattened from are kept as ``gm.meta["pytree_info"]`` (in_spec of (args, kwargs), out_spec).
    dynamic_shapes: torch.export's (``torch.export.Dim`` per input and dim); None: all static."""
    try:
        # frozen_heap: dynamo's symbolic capture allocates enough for full collections to cost
        # a quarter of its time walking the process's older objects (blade/heap.py)
        with torch.no_grad(), warnings.catch_warnings(), _model_state_kept(model), frozen_heap():
            warnings.simplefilter("ignore", FutureWarning)  # torch._dynamo.export's notice
            # Static shapes unless dynamic_shapes says otherwise. Without dynamic dims dynamo's
            # dim-constraint solver has nothing to do, and on some models (transformers' ResNet)
            # it logs a page of sympy tracebacks while failing to print a constraint it never
            # needed; with them it names a dim the model specializes (torch.export's error).
            # backed_size_oblivious: a dim declared with min=1 keeps its symbol at 1 too (dynamo
            # would otherwise specialize sizes 0 and 1, and the graph would not serve batch 1);
            # compile_model checks the compiled graph against eager at the minima.
            with torch.fx.experimental._config.patch(backed_size_oblivious=dynamic_shapes is not None):
                if dynamic_shapes is not None:
                    gm = _symbolic_capture(model, example_inputs, example_kwargs or {}, dynamic_shapes)
                else:
                    gm, _guards = torch._dynamo.export(model, assume_static_by_default=True,
                                                       disable_constraint_solver=True)(
                        *example_inputs, **(example_kwargs or {}))
    except Exception as err:  # dynamo's Unsupported / UserError name the break and its source line
        raise ExportError(f"blade.export needs one graph, but dynamo could not capture the model "
                          f"whole: {err}") from err
    gm.meta["pytree_info"] = gm.graph._codegen.pytree_info
    gm.graph._codegen = torch.fx.graph.CodeGen()  # flat positional inputs, flat tuple output
    _sizes_as_methods(gm.graph)
    _drop_usage_logging(gm.graph)
    gm.recompile()
    return gm


def _symbolic_capture(model, args: tuple, kwargs: dict, dynamic_shapes) -> torch.fx.GraphModule:
    """The graph with the declared dims symbolic, captured as torch.export.export captures one
    with dynamic shapes (its torch-level graph, before the ATen lowering blade does not want):
    dynamo traces the model once and checks that the declared dims stayed symbolic (the same
    constraint solver and error as torch._dynamo.export). torch._dynamo.export also runs the whole
    graph again on fake tensors at the example's sizes, for the result of a guarded call blade never
    makes; with symbolic sizes every op of that run misses the fake-tensor cache (which holds the
    traced shapes). BERT 4L (bench/dynamic.py): the capture 4.0 -> 3.3 s CPU at 1 thread, the
    static capture 3.05 s. Like torch.export, it starts with torch._dynamo.reset(): functions
    torch.compile compiled before are compiled again at their next call."""
    constraints = _process_dynamic_shapes(_combine_args(model, args, kwargs), dynamic_shapes)
    gm = _dynamo_graph_capture_for_export(model, constraints=constraints, dynamic_shapes=dynamic_shapes)(*args, **kwargs)
    for key in ("fake_mode", "module_call_specs"):   # the capture's fake tensors and shape env: nothing reads them
        gm.meta.pop(key, None)
    # As torch._dynamo.export's graphs (the static captures one archive may dispatch between):
    # the flat outputs as a list, the inputs named after the model's arguments (blade/guards.py).
    output = next(node for node in gm.graph.nodes if node.op == "output")
    output.args = (list(output.args[0]),)
    gm.meta["blade_input_names"] = _input_names(model, args, kwargs)
    return gm


def _input_names(model, args: tuple, kwargs: dict) -> list[str]:
    """``l_<argument>_`` per flat input, as dynamo names the placeholders it reads them from
    (``l_inputs_ids_`` for ``inputs["ids"]``)."""
    forward = model.forward if isinstance(model, torch.nn.Module) else model
    try:
        positional = [p.name for p in inspect.signature(forward).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        positional = []
    names = []
    for path, _ in torch.utils._pytree.tree_flatten_with_path((args, kwargs))[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path[1:]]
        if path[0].idx == 0 and keys and int(keys[0]) < len(positional):
            keys[0] = positional[int(keys[0])]
        names.append("l_" + re.sub(r"\W", "_", "_".join(keys)) + "_")
    return names


_SIZE_OPS = {torch.ops.aten.sym_size.int: "size", torch.ops.aten.sym_numel.default: "numel"}


def _sizes_as_methods(graph: torch.fx.Graph) -> None:
    """dynamo's export reads a dynamic dim as ``aten.sym_size.int(x, d)``, which TorchScript cannot
    script; ``x.size(d)`` is the same size in the form torch.compile's graphs use."""
    for node in list(graph.nodes):
        method = _SIZE_OPS.get(node.target) if node.op == "call_function" else None
        if method is not None:
            with graph.inserting_before(node):
                replacement = graph.call_method(method, node.args, node.kwargs)
            replacement.meta = dict(node.meta)
            node.replace_all_uses_with(replacement)
            graph.erase_node(node)


# Calls dynamo's export records for their side effect only, none of which the compiled model needs:
# torch's API-usage logging (slicing an nn.ModuleList, as Llama's ``self.layers[:n]`` does, builds
# a new ModuleList that logs). TorchScript cannot script them.
_USAGE_LOGGING = (torch._C._log_api_usage_once,)


def _drop_usage_logging(graph: torch.fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _USAGE_LOGGING and not node.users:
            graph.erase_node(node)


@contextlib.contextmanager
def _model_state_kept(model):
    """torch._dynamo.export leaves what the model writes while traced bound to the fake tensors it
    traced with: a buffer it writes (``self.count += 1``), or a cache it fills (LeViT's
    ``attention_bias_cache`` dict: after blade.export every eager call of the user's model read a
    FakeTensor from it, 240 ms a call and a SymFloat for an answer). Everything is put back as it
    was before the capture, as torch.export's non-strict mode does: buffers and parameters and
    plain attributes rebound, dicts and lists among them refilled with their old contents,
    attributes the capture added dropped."""
    modules = list(model.modules()) if isinstance(model, torch.nn.Module) else []
    slots_before = [(slots, name, tensor) for module in modules
                    for slots in (module._buffers, module._parameters) for name, tensor in list(slots.items())]
    attributes_before = [(module, {k: v for k, v in vars(module).items() if k not in _MODULE_INTERNALS})
                         for module in modules]
    contents_before = [(value, dict(value) if isinstance(value, dict) else list(value))
                       for _, attributes in attributes_before for value in attributes.values()
                       if type(value) in (dict, list)]
    try:
        yield
    finally:
        for slots, name, tensor in slots_before:
            slots[name] = tensor
        for module, attributes in attributes_before:
            for name in [k for k in vars(module) if k not in attributes and k not in _MODULE_INTERNALS]:
                delattr(module, name)
            vars(module).update(attributes)
        for container, contents in contents_before:
            if isinstance(container, dict):
                container.clear()
                container.update(contents)
            else:
                container[:] = contents


# What every nn.Module keeps in its __dict__ (parameters, buffers, submodules, hooks, training):
# torch's own bookkeeping, which _model_state_kept leaves to torch.
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


def compile_model(model, example_inputs: tuple, config: Config | None = None, *,
                  kwargs: dict | None = None, dynamic_shapes=None) -> CompiledModule:
    """Capture and compile a model without dynamo guards: the CompiledModule behind export. It
    takes the flat leaves of (example_inputs, kwargs); its ``signature`` says how to call it like
    the model (blade/signature.py). dynamic_shapes: as torch.export's; values of a declared dim the
    capture leaves out (seq 1, where the model branches on it) get captures of their own, picked
    by the archive's forward at run time (blade/size_variants.py)."""
    config = config or current()
    args, kwargs = tuple(example_inputs), dict(kwargs or {})
    flat_inputs, in_spec = torch.utils._pytree.tree_flatten((args, kwargs))
    with sharing_constants():  # the engines (of every capture) hold one tensor per distinct weight
        gm, compiled = _compile(model, args, kwargs, in_spec, flat_inputs, dynamic_shapes, config)
    info = gm.meta["pytree_info"]
    compiled.signature = Signature.of(info.in_spec, info.out_spec, flat_inputs, compiled.runtime_inputs)
    return compiled


def _compile(model, args: tuple, kwargs: dict, in_spec, flat_inputs: list, dynamic_shapes, config: Config) -> tuple:
    """(the first capture's gm, the CompiledModule serving all captures)."""
    if dynamic_shapes is None:
        gm = capture_graph(model, args, kwargs)
        return gm, compile_fx(gm, flat_inputs, config)
    try:
        dims = declared_dims(model, args, kwargs, dynamic_shapes, flat_inputs)
    except Exception as err:  # torch.export's own message on a dynamic_shapes that does not fit
        raise ExportError(f"blade.export: the dynamic_shapes do not fit the inputs: {err}") from err
    captures = _compile_captures(model, in_spec, flat_inputs, dynamic_shapes, dims, config)
    gm, compiled = captures[0][1], captures[0][2]
    return gm, _dispatching(captures, dims) if len(captures) > 1 else compiled


def _compile_captures(model, in_spec, flat_inputs: list, dynamic_shapes, dims: dict, config: Config) -> list:
    """[(fixed dims, gm, CompiledModule)]: the capture of the declared ranges first, then one per
    value of a declared dim a capture left out (breadth first, with the dims fixed so far)."""
    pending, seen, captures = [{}], set(), []
    while pending:
        fixed = pending.pop(0)
        if len(captures) == MAX_CAPTURES:
            raise ExportError(f"blade.export: serving the declared ranges needs more than {MAX_CAPTURES} captures "
                              f"(next: {fixed}); declare narrower ranges")
        flat = inputs_at(flat_inputs, dims, fixed)
        args, kwargs = torch.utils._pytree.tree_unflatten(flat, in_spec)
        shapes = shapes_with_fixed(dynamic_shapes, fixed)
        gm = capture_graph(model, args, kwargs, shapes if has_dims(shapes) else None)
        if captures and gm.meta["pytree_info"].out_spec != captures[0][1].meta["pytree_info"].out_spec:
            raise ExportError(f"blade.export: the model's output structure at {fixed} differs from the one at the "
                              f"example's sizes; one archive cannot return both")
        try:  # before compiling: a range that cannot be served fails fast
            excluded = excluded_values(dims, captured_ranges(gm, dims), fixed)
        except UncoverableRange as err:
            raise ExportError(f"blade.export: the dynamic_shapes cannot be served: {err}") from err
        compiled = _compile_symbolic(model, gm, flat, config) if has_dims(shapes) else compile_fx(gm, flat, config)
        captures.append((fixed, gm, compiled))
        for name, values in excluded.items():
            for value in values:
                more = {**fixed, name: value}
                if frozenset(more.items()) not in seen:
                    seen.add(frozenset(more.items()))
                    pending.append(more)
    return captures


def _dispatching(captures: list, dims: dict) -> CompiledModule:
    """One CompiledModule whose forward picks the capture by the input sizes."""
    try:
        module, taken = dispatcher([Capture(fixed, c.module, list(c.runtime_inputs)) for fixed, _, c in captures], dims)
    except UncoverableRange as err:
        raise ExportError(f"blade.export: the dynamic_shapes cannot be served: {err}") from err
    reports = [c.report for _, _, c in captures]
    first = reports[0]
    report = dataclasses.replace(
        first, clusters=[cluster for r in reports for cluster in r.clusters],
        left_out_nodes=[node for r in reports for node in r.left_out_nodes],
        aten_total=sum(r.aten_total for r in reports), aten_in_engines=sum(r.aten_in_engines for r in reports),
        aten_in_graph=sum(r.aten_in_graph for r in reports), engine_calls=sum(r.engine_calls for r in reports),
        symbolic_refusals=[text for r in reports for text in r.symbolic_refusals],
        compile_wall_s=sum(r.compile_wall_s for r in reports), total_s=sum(r.total_s for r in reports),
        size_symbols="; ".join(f"{_fixed_label(fixed)}: {c.report.size_symbols or 'static'}"
                               for fixed, _, c in captures))
    return CompiledModule(module, taken, report)


def _fixed_label(fixed: dict) -> str:
    return ", ".join(f"{name}={value}" for name, value in sorted(fixed.items())) or "declared ranges"


def _compile_symbolic(model, gm, flat_inputs: list, config: Config) -> CompiledModule:
    """One compile whose engines take the declared dims at run time (blade/dynamic.py), checked
    against the model at each probe point (the symbols' minima included: the graph was captured
    assuming no declared dim is special at 1)."""
    try:
        symbols = SizeSymbols.of(gm, flat_inputs, config.dynamic_max_size)
    except NotSymbolic as err:
        raise ExportError(f"blade.export: the dynamic_shapes cannot be kept: {err}") from err
    compiled = compile_fx(gm, flat_inputs, config, symbols)
    for refusal in compiled.report.symbolic_refusals:
        warnings.warn(f"blade.export: a cluster stays in TorchScript: {refusal}")
    with torch.no_grad():
        for probe in symbols.probes + [_at_minima(gm, flat_inputs, symbols)]:
            expected, got = gm(*probe), compiled(*probe)
            for e, g in zip(torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(got)):
                if not _matches(e, g):
                    raise ExportError(f"blade.export: the graph compiled for dynamic shapes differs from the model at "
                                      f"input shapes {[tuple(p.shape) for p in probe if isinstance(p, torch.Tensor)]} "
                                      f"(output {tuple(e.shape)} vs {tuple(g.shape)}); declare min=2 for dims the model "
                                      f"treats specially at 1")
    return compiled


def _matches(expected, got) -> bool:
    """A compiled output against the model's: same shape and dtype, floats within 1e-4 of the
    largest magnitude (NaN where the model has NaN), others equal."""
    if not isinstance(expected, torch.Tensor):
        return expected == got
    if expected.shape != got.shape or expected.dtype != got.dtype:
        return False
    if not expected.is_floating_point() or expected.numel() == 0:
        return torch.equal(expected, got)
    finite = expected[expected.isfinite()]
    scale = max(1.0, finite.abs().max().item() if finite.numel() else 0.0)
    return torch.allclose(expected, got, rtol=1e-4, atol=1e-4 * scale, equal_nan=True)


def _at_minima(gm, flat_inputs: list, symbols: SizeSymbols) -> list:
    """The example's arguments cut down to every symbol's minimum (e.g. batch 1)."""
    placeholders = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    return arguments_at(placeholders, flat_inputs, {sym: lo for sym, (lo, _) in symbols.ranges.items()})


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


def export(model, example_inputs: tuple, path: str, config: Config | None = None, *,
           kwargs: dict | None = None, dynamic_shapes=None) -> CompiledModule:
    """Capture ``model(*example_inputs, **kwargs)`` as one graph, compile it, and save the archive
    at ``path``. dynamic_shapes: as torch.export's (``{"ids": {0: Dim("batch", max=16)}}``)."""
    config = config or current()
    compiled = compile_model(model, example_inputs, config, kwargs=kwargs, dynamic_shapes=dynamic_shapes)
    stamps = make_stamps(compiled.report, config.fallback)
    if not stamps["engines"]:
        warnings.warn(f"blade.export: no cluster of the model compiled to an engine; {path} is plain "
                      f"TorchScript")
    _save_with_record_digests(compiled.module, path, {METADATA_FILE: json.dumps(stamps),
                                                      SIGNATURE_FILE: compiled.signature.dumps(type(model).__name__)})
    return compiled


def read_extra(path: str, name: str) -> str | None:
    """The archive's extra file ``name``, or None. Read from the zip directly: torch.jit.load would
    build the Engines (and fail on a mismatch) before we could check."""
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if n.endswith(f"/extra/{name}")]
        return archive.read(names[0]).decode() if names else None


def read_stamps(path: str) -> dict | None:
    """The archive's stamps, or None when it is not a blade archive."""
    text = read_extra(path, METADATA_FILE)
    return json.loads(text) if text is not None else None


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


def load(path: str) -> ExportedModule:
    """The exported module, called like the model (``.script`` is the archive's flat TorchScript
    module), after checking its bytes (CorruptArtifact) and its stamps against this process (clear
    error if they do not match; only a warning when the archive's engines carry their fallback)."""
    check_zip(path)
    stamps = read_stamps(path)
    if stamps is None:
        raise ValueError(f"{path} is not a blade archive (no {METADATA_FILE}); use torch.jit.load")
    check_stamps(stamps, f"blade archive {path}")
    check_records(path)
    bound_large_blocks(current().mmap_threshold)  # opt-in: a flat peak for page faults per call
    signature = read_extra(path, SIGNATURE_FILE)
    what = f"blade archive {path}"
    return ExportedModule(torch.jit.load(path), Signature.loads(signature, what) if signature else None, what)
