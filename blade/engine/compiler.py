"""compile_onnx: one ONNX cluster -> IR -> plan -> engine.cpp -> g++ -> engine.so + manifest.json
(torch-free).

The pipeline is data (``STAGES``): each stage's output can be dumped next to the artifacts, and
every failure carries the command that reproduces it.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from . import codegen, ir, plan
from .ir import UnsupportedOnnxOp  # noqa: F401  (re-exported: the error users catch)
from .manifest import Manifest

DEFAULT_OPTIONS = {
    "isa": "native",            # "native" or a concrete -march level (x86-64, x86-64-v2/v3/v4)
    "cxx": None,                # compiler path; None: $CXX or g++
    "opt_level": "-O3",
    "extra_flags": [],          # appended to the command line
    "timeout_s": None,          # g++ wall-time limit inside one compile
}
# -fno-gnu-unique: inline/template statics would otherwise be process-wide unique symbols even
# under RTLD_LOCAL, shared between engines and pinning the .so in memory.
# -falign-loops=64: every loop starts a 64-byte block, so a loop of up to 64 bytes is fetched from
# one block an iteration. g++'s default (16-byte alignment) put relu's and int32 bitwise_not's
# 31- and 22-byte vector loops at [64, 4096] across a 64-byte boundary (neg's happened to fit in
# one block), and on 2 threads those ran 3-37% slower than eager and than neg in the same process,
# in 8 of 9 processes over three windows (1 thread: no difference; windows where the host slows all,
# eager too, hide it). The same relu loop moved by hand to offsets 0, 16 and 32 of a block ran at
# eager's speed, at 40 and 48 (across the boundary) ~20% slower: it is the 64-byte block, not the
# expression. A loop entered by falling through pays the padding (a few long nops) once per entry.
BASE_FLAGS = ["-std=c++17", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd",
              "-fno-gnu-unique", "-falign-loops=64"]


class EngineCompileError(RuntimeError):
    """A compile failed; the message names the command and the log that reproduce it."""


class CompilerNotFound(EngineCompileError):
    pass


def resolve_options(options: dict | None) -> dict:
    unknown = set(options or {}) - DEFAULT_OPTIONS.keys()
    if unknown:
        raise ValueError(f"unknown engine compile options {sorted(unknown)}; known: {sorted(DEFAULT_OPTIONS)}")
    merged = {**DEFAULT_OPTIONS, **(options or {})}
    merged["cxx"] = merged["cxx"] or os.environ.get("CXX") or "g++"
    merged["isa"] = resolve_isa(merged["isa"])
    return merged


# The headers generated engines include: the engine <-> runtime ABI and the C++ prelude.
ENGINE_HEADERS = ("blade_abi.h", "engine_prelude.h")


def include_dir() -> Path:
    """The directory holding ENGINE_HEADERS: a packaged copy (blade/include) or the repo's cpp/."""
    package = Path(__file__).resolve().parent.parent
    candidates = (package / "include", package.parent / "cpp")
    for candidate in candidates:
        if all((candidate / name).is_file() for name in ENGINE_HEADERS):
            return candidate
    raise FileNotFoundError(f"{' and '.join(ENGINE_HEADERS)} not found together in "
                            f"{' or '.join(map(str, candidates))}")


@functools.lru_cache(maxsize=None)
def abi_version() -> int:
    text = (include_dir() / "blade_abi.h").read_text()
    return int(re.search(r"#define\s+BLADE_ABI_VERSION\s+(\d+)", text).group(1))


# x86-64 micro-architecture levels by the cpuinfo flags they need, best first.
ISA_LEVELS = [
    ("x86-64-v4", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}),
    ("x86-64-v3", {"avx2", "fma", "bmi2", "f16c", "movbe"}),
    ("x86-64-v2", {"sse4_2", "popcnt", "ssse3"}),
    ("x86-64", set()),
]


@functools.lru_cache(maxsize=None)
def native_isa() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "x86-64"
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    flags = set(match.group(1).split()) if match else set()
    return next(level for level, needs in ISA_LEVELS if needs <= flags)


def resolve_isa(isa: str) -> str:
    return native_isa() if isa == "native" else isa


@functools.lru_cache(maxsize=None)
def compiler_version(cxx: str) -> str:
    """`cxx --version` (first line); raises CompilerNotFound if it does not run."""
    if shutil.which(cxx) is None:
        raise CompilerNotFound(f"C++ compiler {cxx!r} not found (set the engine option 'cxx' or $CXX)")
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.splitlines()[0] if out.stdout else ""


def compile_command(options: dict, source: Path, target: Path) -> list[str]:
    return [options["cxx"], options["opt_level"], f"-march={options['isa']}", *BASE_FLAGS,
            f"-I{include_dir()}", str(source), "-o", str(target), *options["extra_flags"]]


def load_constants(onnx_path_or_model, manifest: Manifest) -> list[np.ndarray]:
    """The run-time constants of an engine, in manifest order (contiguous, manifest dtypes)."""
    values = ir.constant_tensors(ir.load_model(onnx_path_or_model))
    out = []
    for spec in manifest.constants:
        value = np.require(np.asarray(values[spec.name], dtype=spec.dtype), requirements="C")
        if list(value.shape) != spec.shape:
            raise ValueError(f"constant {spec.name!r} has shape {value.shape}, manifest says {spec.shape}")
        out.append(value)
    return out


# The pipeline as data: name -> (function of the previous stage's output, (dump file, its text
# from the stage's output) or None).
STAGES = {
    "onnx": (ir.load_model, None),
    "ir": (ir.lower_onnx, None),
    "plan": (plan.make_plan, ("plan.txt", plan.Plan.describe)),
    "cpp": (codegen.generate, ("engine.cpp", lambda program: program.source)),
}


def _run_stage(name: str, stage, value, symbols: bool):
    """One stage. With run-time sizes (size symbols), a stage that meets a decision it cannot make
    on a symbolic size (a comparison or a truth value of an expression: TypeError; a division by a
    size that may be 0: ValueError) refuses the cluster rather than guessing."""
    if not symbols:
        return stage(value)
    try:
        return stage(value)
    except (TypeError, ValueError) as e:
        raise UnsupportedOnnxOp(f"the {name} stage does not handle this cluster with run-time sizes yet: "
                                f"{type(e).__name__}: {e}") from e


def compile_onnx(onnx_path, out_dir, options: dict | None = None) -> Manifest:
    """Compiles one cluster; writes plan.txt, engine.cpp, compile_command.txt, compile.log,
    engine.so and manifest.json into out_dir and returns the manifest."""
    options = resolve_options(options)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    value, symbols = onnx_path, False
    for name, (stage, dump) in STAGES.items():
        value = _run_stage(name, stage, value, symbols)
        # from the ONNX model on: its metadata declares run-time sizes (the ir stage's rules too
        # refuse what they cannot compute from a symbolic size)
        symbols = symbols or (name == "onnx" and any(p.key == ir.SIZE_RANGES_KEY for p in value.metadata_props))
        if dump:
            filename, text = dump
            (out_dir / filename).write_text(text(value))
    program = value
    version = compiler_version(options["cxx"])
    source, target, log = out_dir / "engine.cpp", out_dir / "engine.so", out_dir / "compile.log"
    command = compile_command(options, source, target)
    (out_dir / "compile_command.txt").write_text(" ".join(command) + "\n")
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=options["timeout_s"])
    except subprocess.TimeoutExpired:
        log.write_text(f"timed out after {options['timeout_s']} s\n")
        raise EngineCompileError(f"compiler timed out; reproduce with: {' '.join(command)}") from None
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[:20])
        raise EngineCompileError(f"compiler failed (exit {proc.returncode}); log {log}; "
                                 f"reproduce with: {' '.join(command)}\n{tail}")
    manifest = Manifest(abi_version=abi_version(), isa=options["isa"], inputs=program.inputs,
                        outputs=program.outputs, constants=program.constants,
                        scratch_bytes=program.scratch_bytes, symbols=program.symbols, compile_command=command,
                        compiler_version=version)
    (out_dir / "manifest.json").write_text(manifest.to_json())
    return manifest
