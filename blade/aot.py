"""Serving without tracing or compiling: portability stamps and dynamo's AOT precompile.

``tt_infer`` returns a ``PrecompiledModule``: a CompiledModule that torch's AOT precompile can
serialize (torch/_dynamo/aot_compile_types.py, ``SerializableCallable``). Its bytes are the spliced
ScriptModule (``torch.jit.save``: engines and their .so inside), which inputs of dynamo's call it
takes, the compile report, and the stamps below; loading is ``torch.jit.load``, no g++ involved.

    with torch.no_grad():
        fn = torch.compile(m.forward, backend="tt_infer", fullgraph=True).aot_compile(((x,), {}))
        fn.save_compiled_function(path, external_data={"model": m})
    # serving process (dynamo still checks its guards on every call); like the function it was
    # made from, a method's precompiled function takes the module first:
    fn = torch.compiler.load_compiled_function(open(path, "rb"), external_data={"model": m})
    y = fn(m, x)

``blade.precompile(m, (x,), path)`` is the first two lines; ``fn = blade.load_precompiled(path, m)``
the last, with the model bound (``fn(x)``) and the outputs as one flat tuple of tensors.

Integrity: the serialized bytes are ``PRECOMPILED_MAGIC``, the SHA-256 of the payload, then the
payload (a pickle); loading checks the hash before unpickling anything, so damage anywhere in
blade's part is a ``CorruptArtifact`` (the engines inside carry their own hashes as well, checked
by the Engine before its .so is loaded). torch's container around it (dynamo's guards and
bytecode, pickled) has no check of its own: ``blade.precompile`` appends ``FILE_TRAILER`` and the
SHA-256 of the whole file, which ``blade.load_precompiled`` checks before handing the bytes to
torch. torch's unpickler stops at the pickle's end, so ``torch.compiler.load_compiled_function``
still reads such a file (a test holds torch to that).

Stamps: an artifact records the torch version, blade's archive format, the engine ABI and the ISA
levels its engines need. ``check_stamps`` turns a mismatch into one clear error before anything is
loaded — except an ISA the host lacks when engines carry their TorchScript fallback (then the
Engine runs the fallback and only a warning is given here).
"""
from __future__ import annotations

import functools
import hashlib
import io
import pickle
import platform
import warnings

import torch
from torch._dynamo.aot_compile_types import SerializableCallable

import blade._C as _C
from blade.pipeline import CompiledModule, CompileReport

ARCHIVE_FORMAT = 3          # bumped when the stamps or the archive layout change (3: hashed engines)
PRECOMPILED_FORMAT = 2      # the layout of PrecompiledModule's serialized bytes (2: sealed)
PRECOMPILED_MAGIC = b"blade-precompiled-2\n"
FILE_TRAILER = b"\nblade-sha256:"   # + 64 hex digits: the end of a file blade.precompile wrote
FILE_TRAILER_SIZE = len(FILE_TRAILER) + 64


class IncompatibleArtifact(RuntimeError):
    """A saved blade artifact cannot run in this process (the message says why and what to do)."""


class CorruptArtifact(IncompatibleArtifact):
    """A saved blade artifact's bytes are not the bytes that were saved (damaged or modified)."""


def seal(payload: bytes) -> bytes:
    """payload behind a magic and its SHA-256, for unseal to check."""
    return PRECOMPILED_MAGIC + hashlib.sha256(payload).digest() + payload


def unseal(data: bytes, what: str) -> bytes:
    """The payload seal wrapped, or IncompatibleArtifact / CorruptArtifact saying why not."""
    if not data.startswith(PRECOMPILED_MAGIC):
        raise IncompatibleArtifact(f"{what} is not of blade precompiled format {PRECOMPILED_FORMAT} (saved by an "
                                   f"older blade, or damaged): re-run aot_compile with this blade")
    start = len(PRECOMPILED_MAGIC) + hashlib.sha256().digest_size
    digest, payload = data[len(PRECOMPILED_MAGIC):start], data[start:]
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptArtifact(f"{what} is damaged: the SHA-256 of its {len(payload)} bytes differs from the one "
                              f"saved with them; nothing of it was loaded. Restore a good copy or re-run "
                              f"aot_compile")
    return payload


def torch_release(version: str) -> str:
    """"2.13.0+cpu" -> "2.13": TorchScript archives are read by the same torch release."""
    return ".".join(version.split("+")[0].split(".")[:2])


def make_stamps(report: CompileReport, fallback: str) -> dict:
    return {
        "archive_format": ARCHIVE_FORMAT,
        "torch_version": torch.__version__,
        "abi_version": _C.abi_version(),
        "isa": sorted({c.isa for c in report.clusters if c.status == "compiled" and c.isa}),
        "machine": platform.machine(),
        "fallback": fallback,
        "engines": sum(c.status == "compiled" for c in report.clusters),
        "coverage": report.coverage,
    }


def _mismatches(stamps: dict) -> list[tuple[str, bool]]:
    """(what is wrong, whether the engines' fallback subgraphs can cover it)."""
    problems = []
    if stamps.get("archive_format") != ARCHIVE_FORMAT:
        problems.append((f"blade archive format {stamps.get('archive_format')}, this blade reads "
                         f"{ARCHIVE_FORMAT}", False))
    if torch_release(stamps.get("torch_version", "?")) != torch_release(torch.__version__):
        problems.append((f"saved with torch {stamps.get('torch_version')}, this is torch "
                         f"{torch.__version__}", False))
    if stamps.get("abi_version") != _C.abi_version():
        problems.append((f"engines built for blade ABI {stamps.get('abi_version')}, this runtime is "
                         f"ABI {_C.abi_version()}", True))
    missing = [isa for isa in stamps.get("isa", []) if not _C.isa_supported(isa)]
    if missing:
        problems.append((f"engines need ISA {', '.join(missing)}, this CPU supports up to "
                         f"{_C.host_isa()}", True))
    return problems


def check_stamps(stamps: dict, what: str) -> None:
    """Raise IncompatibleArtifact naming every mismatch; warn instead when fallback covers it."""
    has_fallback = stamps.get("fallback", "off") != "off"
    problems = _mismatches(stamps)
    fatal = [text for text, coverable in problems if not (coverable and has_fallback)]
    if fatal:
        raise IncompatibleArtifact(f"{what} cannot run here: {'; '.join(fatal)}. Re-export it on "
                                   f"this machine/version (or export with fallback='fallback' to run "
                                   f"its TorchScript subgraphs where engines cannot load).")
    for text, _ in problems:
        warnings.warn(f"blade: {what}: {text}; its engines fall back to TorchScript")


class PrecompiledModule(CompiledModule, SerializableCallable):
    """A CompiledModule that dynamo's AOT precompile can save and load."""

    def __init__(self, module, runtime_inputs: list, report: CompileReport, stamps: dict, source=None):
        super().__init__(module, runtime_inputs, report, source)
        self.stamps = stamps

    @classmethod
    def wrap(cls, compiled: CompiledModule, fallback: str) -> "PrecompiledModule":
        return cls(compiled.module, compiled.runtime_inputs, compiled.report,
                   make_stamps(compiled.report, fallback), compiled.source)

    @classmethod
    def serialize_compile_artifacts(cls, fn: "PrecompiledModule") -> bytes:
        archive = io.BytesIO()
        torch.jit.save(fn.module, archive)
        return seal(pickle.dumps({"format": PRECOMPILED_FORMAT, "stamps": fn.stamps,
                                  "module": archive.getvalue(), "runtime_inputs": list(fn.runtime_inputs),
                                  "report": fn.report}))

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "PrecompiledModule":
        state = pickle.loads(unseal(data, "blade precompiled function"))
        if state.get("format") != PRECOMPILED_FORMAT:
            raise IncompatibleArtifact(f"blade precompiled function of format {state.get('format')}; "
                                       f"this blade reads format {PRECOMPILED_FORMAT}: re-run aot_compile")
        check_stamps(state["stamps"], "blade precompiled function")
        module = torch.jit.load(io.BytesIO(state["module"]))
        return cls(module, state["runtime_inputs"], state["report"], state["stamps"])


class _Forward(torch.nn.Module):
    """The model behind a plain method that returns its output tensors as one flat tuple (like
    blade.export's archives). torch's precompile pickles the traced function by reference,
    which fails for a forward wrapped by decorators (transformers' models), and rebuilding output
    containers such as ModelOutput needs globals a fresh process lacks; this forward has neither
    problem, and the same signature (self, *args) for every model."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return _leaves(self.model(*args))


def _leaves(out) -> tuple:
    """A model's outputs as a flat tuple (containers in order; dicts such as transformers'
    ModelOutput by value). Plain Python on purpose: torch.utils._pytree would add guards on the
    torch module that dynamo cannot load again."""
    if isinstance(out, (tuple, list)):
        return tuple(leaf for item in out for leaf in _leaves(item))
    if isinstance(out, dict):
        return _leaves(tuple(out.values()))
    return (out,)


def precompile(model: torch.nn.Module, example_inputs: tuple, path: str, *, guard_filter_fn=None,
               **options):
    """Precompile ``model(*example_inputs)`` with tt_infer and save it at ``path`` (torch's AOT
    precompile; the model itself stays external). Returns the compiled function (model bound).

    guard_filter_fn: torch's hook choosing which dynamo guards are saved. Some model code gets
    guards dynamo cannot serialize (``PackageError: ID_MATCH guard cannot be serialized``, e.g.
    transformers' BERT: identity of decorated methods and closures); for a fixed model served as
    saved, ``torch.compiler.keep_portable_guards_unsafe`` keeps the tensor, shape and grad-mode
    guards only. options: blade Config fields. The function returns the model's output tensors as
    a flat tuple."""
    served = _Forward(model)
    compile_options = dict(options, **({"guard_filter_fn": guard_filter_fn} if guard_filter_fn else {}))
    ones = _dims_from_one(example_inputs)
    # backed_size_oblivious: a dim marked dynamic with min=1 keeps its symbol at 1 too (dynamo
    # would otherwise specialize sizes 0 and 1, and a saved function has its one graph only)
    with torch.no_grad(), torch.fx.experimental._config.patch(backed_size_oblivious=bool(ones)):
        fn = torch.compile(served.forward, backend="tt_infer", fullgraph=True,
                           options=compile_options or None).aot_compile((tuple(example_inputs), {}))
        if ones:
            _check_at_size_one(functools.partial(fn, served), served, example_inputs, ones)
        fn.save_compiled_function(path, external_data={"model": served})
    with open(path, "rb+") as f:
        f.write(_trailer(f.read()))  # reading left the position at the end: the trailer goes after
    return functools.partial(fn, served)  # a method's precompiled function takes self first


def _dims_from_one(example_inputs) -> list:
    """(argument position, dim) of each dim marked dynamic with a declared min of 1 (or 0)."""
    return [(position, r.dim) for position, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)
            for r in sorted(getattr(x, "_dynamo_dynamic_range", ()), key=lambda r: r.dim)
            if r.min is not None and r.min <= 1]


def _check_at_size_one(fn, served, example_inputs: tuple, dims: list) -> None:
    """The saved function against the model with those dims at 1. Where the model branches on a
    dim, dynamo's guards refuse size 1 (a call error, never a wrong value: declare min=2 to say
    so); what they let through must be the model's values, as size-oblivious tracing assumes
    sizes >= 2 without guarding some shape decisions."""
    inputs = list(example_inputs)
    for position, dim in dims:
        inputs[position] = inputs[position].narrow(dim, 0, 1)
    try:
        got = fn(*inputs)
    except RuntimeError as err:
        if "guard" in str(err).lower():
            return
        raise
    for g, want in zip(got, served(*inputs)):
        if g.shape != want.shape or not torch.allclose(g, want, rtol=1e-4, atol=1e-4 * max(1.0, want.abs().max().item())):
            raise RuntimeError(f"blade.precompile: the function compiled for dynamic shapes differs from the model "
                               f"with the dims marked min=1 at 1 (output {tuple(g.shape)} vs {tuple(want.shape)}); "
                               f"mark them with min=2")


def _trailer(data: bytes) -> bytes:
    return FILE_TRAILER + hashlib.sha256(data).hexdigest().encode()


def _checked_file(path: str) -> bytes:
    """torch's bytes of a file blade.precompile wrote, after checking its trailer's SHA-256."""
    with open(path, "rb") as f:
        data = f.read()
    body, trailer = data[:-FILE_TRAILER_SIZE], data[-FILE_TRAILER_SIZE:]
    if not trailer.startswith(FILE_TRAILER):
        raise IncompatibleArtifact(f"{path} does not end in blade's hash (not written by blade.precompile, by an "
                                   f"older blade, or damaged); load it with torch.compiler.load_compiled_function "
                                   f"or precompile it again")
    if trailer != _trailer(body):
        raise CorruptArtifact(f"{path} is damaged: the SHA-256 of its {len(body)} bytes differs from the one saved "
                              f"with them; nothing of it was loaded. Restore a good copy or precompile again")
    return body


def load_precompiled(path: str, model: torch.nn.Module):
    """The function ``precompile`` saved, bound to ``model``: call it with the inputs only (under
    ``torch.no_grad()`` like at precompile time; dynamo checks its guards on every call)."""
    served = _Forward(model)
    fn = torch.compiler.load_compiled_function(io.BytesIO(_checked_file(path)), external_data={"model": served})
    return functools.partial(fn, served)
