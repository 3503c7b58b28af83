"""Content-addressed on-disk cache of compiled engines (torch-free).

Key = sha256(ONNX bytes, resolved options, compiler path and --version, ABI version, ISA, source of
blade/engine/*.py and the ABI header). An entry ``<cache_dir>/<key[:2]>/<key>/`` holds engine.so and
manifest.json; it is built in a temp dir beside it and published with one ``os.replace``, so readers
see a whole entry or none. Losing that race to another process is success.
"""
from __future__ import annotations

import functools
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from . import compiler
from .manifest import Manifest

ENTRY_FILES = ("engine.so", "manifest.json")
KEPT_FILES = ENTRY_FILES + ("engine.cpp",)
ENGINE_DIR = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(ENGINE_DIR.glob("*.py")) + [compiler.abi_header_dir() / "blade_abi.h"]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def cache_key(onnx_bytes: bytes, options: dict) -> str:
    """options must be resolved (compiler.resolve_options): the concrete ISA and compiler path."""
    h = hashlib.sha256()
    for part in (onnx_bytes, json.dumps(options, sort_keys=True).encode(),
                 compiler.compiler_version(options["cxx"]).encode(), str(compiler.abi_version()).encode(),
                 options["isa"].encode(), source_digest().encode()):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()


def entry_dir(cache_dir, key: str) -> Path:
    return Path(cache_dir) / key[:2] / key


def lookup(cache_dir, key: str):
    """(so_path, Manifest) of a complete entry, or None."""
    entry = entry_dir(cache_dir, key)
    if not all((entry / name).is_file() for name in ENTRY_FILES):
        return None
    try:
        return entry / "engine.so", Manifest.from_json((entry / "manifest.json").read_text())
    except (ValueError, TypeError, KeyError):
        return None  # unreadable: treat as a miss; store() replaces it


def store(cache_dir, key: str, work_dir) -> Path:
    """Publishes work_dir's artifacts as the entry for key; returns the entry dir."""
    entry = entry_dir(cache_dir, key)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key[:16]}-", dir=entry.parent))
    try:
        for name in KEPT_FILES:
            if (Path(work_dir) / name).is_file():
                shutil.copy2(Path(work_dir) / name, tmp / name)
        if entry.exists() and lookup(cache_dir, key) is None:
            shutil.rmtree(entry, ignore_errors=True)  # a broken entry (e.g. copied in by hand)
        try:
            tmp.replace(entry)
        except OSError:
            if lookup(cache_dir, key) is None:  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return entry
