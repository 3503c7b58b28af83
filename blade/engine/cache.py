"""Content-addressed on-disk cache of compiled engines (torch-free).

Key = sha256(ONNX bytes, resolved options, compiler path and --version, ABI version, ISA, source of
blade/engine/*.py and of the headers engines include: the ABI and the C++ prelude). An entry
``<cache_dir>/<key[:2]>/<key>/`` holds engine.so, manifest.json and checksums.json (sha256 of the
other two). It is built in a temp dir beside it and published with one ``os.replace``, so readers
see a whole entry or none; losing that race to another process is success.

Reading (``fetch``) verifies the checksums and copies the entry into the job's own work dir, so a
concurrent eviction or repair can never pull a file from under a reader. An entry that fails its
checksum is removed with a warning and counts as a miss (the caller recompiles and stores it again).
The cache is bounded: after each store, least-recently-used entries (mtime of checksums.json, touched
on every hit) are evicted until the total size is within ``max_bytes``.

A cache dir that cannot be written (read-only volume, container image, a file in its place) is a
read-only cache: hits are used (their last-use mark is skipped), ``store`` raises OSError and the
driver keeps the engine it compiled without storing it. ``compile_lock`` makes concurrent compiles
of one key (threads of one process, or processes sharing the dir) wait for a single compile: an
exclusive ``flock`` on ``<cache_dir>/locks/<key>.lock`` (flock locks belong to an open file, so
threads of one process exclude each other too), given up after a timeout.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

from . import compiler
from .manifest import Manifest

ENTRY_FILES = ("engine.so", "manifest.json")
KEPT_FILES = ENTRY_FILES + ("engine.cpp", "plan.txt")   # for dumps of cache hits
CHECKSUMS = "checksums.json"        # written last into the temp dir; its mtime is the last use
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 3600.0                # temp dirs older than this belong to a crashed writer
LOCK_DIR = "locks"                  # <cache_dir>/locks/<key>.lock; empty files, evicted with their entry
LOCK_POLL_S = (0.02, 0.5)           # first and longest wait between tries for a held lock
ENGINE_DIR = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    h = hashlib.sha256()
    headers = [compiler.include_dir() / name for name in compiler.ENGINE_HEADERS]
    for path in sorted(ENGINE_DIR.glob("*.py")) + headers:
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


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verify(entry: Path) -> Manifest:
    """The entry's manifest, or ValueError saying what is wrong with it."""
    try:
        expected = json.loads((entry / CHECKSUMS).read_text())
        for name in ENTRY_FILES:
            if _sha256(entry / name) != expected[name]:
                raise ValueError(f"{name} does not match its checksum")
        return Manifest.from_json((entry / "manifest.json").read_text())
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"{type(err).__name__}: {err}") from None


def _remove(path: Path) -> None:
    """Remove a directory atomically for readers: rename it aside first, then delete."""
    aside = path.parent / f"{TMP_PREFIX}removed-{path.name[:16]}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        path.replace(aside)
    except OSError:
        return  # already gone (another process removed or replaced it)
    shutil.rmtree(aside, ignore_errors=True)


def _checked(cache_dir, key: str) -> Path | None:
    """The entry dir if it exists and passes its checksums; a corrupt entry is removed (warning)."""
    entry = entry_dir(cache_dir, key)
    if not entry.is_dir():
        return None
    try:
        _verify(entry)
    except ValueError as err:
        warnings.warn(f"blade: engine cache entry {entry} is corrupt ({err}); removed, recompiling")
        _remove(entry)
        return None
    return entry


def lookup(cache_dir, key: str):
    """(so_path, Manifest) of a complete, verified entry in the cache, or None."""
    entry = _checked(cache_dir, key)
    return (entry / "engine.so", Manifest.from_json((entry / "manifest.json").read_text())) if entry else None


def fetch(cache_dir, key: str, work_dir):
    """A hit copied into work_dir: (so_path, Manifest) there, or None. Marks the entry used."""
    entry = _checked(cache_dir, key)
    if entry is None:
        return None
    work_dir = Path(work_dir)
    try:
        for name in ENTRY_FILES + (CHECKSUMS,):
            shutil.copyfile(entry / name, work_dir / name)
        manifest = _verify(work_dir)  # the copy is what the caller loads: check it, not the entry
    except (OSError, ValueError):
        return None  # evicted or replaced while copying: a miss
    with contextlib.suppress(OSError):  # a read-only cache keeps no LRU order, and still hits
        os.utime(entry / CHECKSUMS)     # LRU: an entry's last use is the mtime of its checksums.json
    return work_dir / "engine.so", manifest


def store(cache_dir, key: str, work_dir, max_bytes: int = 0) -> Path:
    """Publishes work_dir's artifacts as the entry for key, then evicts down to max_bytes (0 = no
    bound); returns the entry dir."""
    entry = entry_dir(cache_dir, key)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{key[:16]}-", dir=entry.parent))
    try:
        for name in KEPT_FILES:
            if (Path(work_dir) / name).is_file():
                shutil.copy2(Path(work_dir) / name, tmp / name)
        (tmp / CHECKSUMS).write_text(json.dumps({name: _sha256(tmp / name) for name in ENTRY_FILES}))
        _checked(cache_dir, key)  # removes a broken entry (e.g. copied in by hand) so ours can land
        try:
            tmp.replace(entry)
        except OSError:
            if lookup(cache_dir, key) is None:  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if max_bytes:
        evict(cache_dir, max_bytes, keep=entry)
    return entry


@contextlib.contextmanager
def compile_lock(cache_dir, key: str, timeout_s: float):
    """Holds the key's lock file while the block compiles; yields whether it got the lock (False
    after timeout_s, or when the lock file cannot be made: a read-only cache). Either way the
    block runs: a stuck or absent lock holder costs a duplicate compile, never a lost engine."""
    path = Path(cache_dir) / LOCK_DIR / f"{key}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        fd = None
    if fd is None:
        yield False
        return
    try:
        yield _acquire(fd, time.monotonic() + timeout_s)
    finally:
        os.close(fd)  # releases the lock


def _acquire(fd: int, deadline: float) -> bool:
    """flock(fd) exclusively, polling until the deadline (flock itself cannot time out)."""
    wait = LOCK_POLL_S[0]
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
            wait = min(wait * 2, LOCK_POLL_S[1])


def _entries(cache_dir: Path):
    """(last_used, bytes, path) of every published entry; stale temp dirs are removed on the way."""
    now = time.time()
    for shard in cache_dir.iterdir():
        if not shard.is_dir() or shard.name == LOCK_DIR:
            continue
        for path in shard.iterdir():
            try:
                if path.name.startswith(TMP_PREFIX):
                    if now - path.stat().st_mtime > STALE_TMP_S:
                        shutil.rmtree(path, ignore_errors=True)
                    continue
                size = sum(f.stat().st_size for f in path.iterdir())
                yield (path / CHECKSUMS).stat().st_mtime, size, path
            except OSError:
                continue  # removed by another process meanwhile, or half-repaired: not ours to count


def evict(cache_dir, max_bytes: int, keep: Path | None = None) -> list[Path]:
    """Remove least-recently-used entries until the cache holds at most max_bytes (never `keep`)."""
    entries = sorted(_entries(Path(cache_dir)))
    total = sum(size for _, size, _ in entries)
    removed = []
    for _, size, path in entries:
        if total <= max_bytes:
            break
        if path == keep:
            continue
        _remove(path)
        # Its lock goes too, so lock files stay as many as entries. Should another process hold
        # it right now, the worst is a second compile of that key, published atomically as ever.
        with contextlib.suppress(OSError):
            (Path(cache_dir) / LOCK_DIR / f"{path.name}.lock").unlink()
        total -= size
        removed.append(path)
    return removed
