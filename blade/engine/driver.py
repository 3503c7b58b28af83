"""Compile many clusters: one subprocess per uncached job, a bounded number at once, per-job timeout.

A job's failure (error, crash, timeout, unusable artifacts) is its own ``CompileResult(ok=False)``
naming the job and its log; compile_many itself never raises for it. With a cache, jobs of one key
wait for each other (cache.compile_lock), and a cache that cannot be written is used read-only
(one warning per cache dir): a fresh engine is used from the job's own work dir without being stored. The subprocess never imports
``blade/__init__.py`` (which imports torch): it registers ``blade`` as a bare namespace package and
runs ``blade.engine.compile_main``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import cache, compiler
from .manifest import Manifest

BLADE_PKG_DIR = str(Path(__file__).resolve().parent.parent)
BLOCK_TORCH_ENV = "BLADE_ENGINE_BLOCK_TORCH"   # tests: make `import torch` fail in the compiler process
JOB_LOG = "compile_job.log"
STUB = (
    "import os, sys, types\n"
    f"if os.environ.get({BLOCK_TORCH_ENV!r}): sys.modules['torch'] = None\n"
    "p = types.ModuleType('blade'); p.__path__ = [sys.argv.pop(1)]; sys.modules['blade'] = p\n"
    "from blade.engine.compile_main import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@dataclass
class CompileResult:
    name: str
    ok: bool
    so_path: str | None
    manifest: Manifest | None
    work_dir: str
    log_path: str
    error: str | None
    seconds: float
    cache_hit: bool
    started: float = 0.0      # time.monotonic() at start / end of the job
    finished: float = 0.0


def _tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _read_artifacts(work_dir: Path):
    """(so_path, manifest) of a finished compile, or raise ValueError if they are unusable."""
    so_path = work_dir / "engine.so"
    if not so_path.is_file() or so_path.read_bytes()[:4] != b"\x7fELF":
        raise ValueError(f"{so_path} is missing or not a shared object")
    try:
        return so_path, Manifest.from_json((work_dir / "manifest.json").read_text())
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise ValueError(f"bad manifest.json: {err}") from None


def _run_subprocess(onnx_path: str, work_dir: Path, options: dict, timeout_s: float) -> tuple[int | None, Path]:
    """Exit code (None on timeout) and the log of one compile subprocess."""
    log_path = work_dir / JOB_LOG
    cmd = [sys.executable, "-c", STUB, BLADE_PKG_DIR, str(onnx_path), str(work_dir),
           "--options", json.dumps(options)]
    with open(log_path, "wb") as log:
        # A new session = a new process group, so a timeout kills g++ along with Python.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s), log_path
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, log_path


_read_only_warned: set = set()          # cache dirs already warned about, once per process
_read_only_lock = threading.Lock()


def _warn_read_only(cache_dir, err: OSError) -> None:
    with _read_only_lock:
        if str(cache_dir) in _read_only_warned:
            return
        _read_only_warned.add(str(cache_dir))
    warnings.warn(f"blade: the engine cache {cache_dir} cannot be written ({type(err).__name__}: {err}); "
                  f"using it read-only: cached engines are used, new ones are compiled into temporary "
                  f"dirs and not stored (warned once per cache dir)")


def _compile_one(job, options: dict, timeout_s: float, cache_dir, cache_max_bytes: int = 0) -> CompileResult:
    name, onnx_path, work_dir = job
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def result(ok, so_path=None, manifest=None, error=None, cache_hit=False, log_path=work_dir / JOB_LOG):
        now = time.monotonic()
        return CompileResult(name, ok, str(so_path) if so_path else None, manifest, str(work_dir),
                             str(log_path), error, now - started, cache_hit, started, now)

    def from_cache(key):
        hit = cache.fetch(cache_dir, key, work_dir)
        return hit and result(True, hit[0], hit[1], cache_hit=True, log_path=cache.entry_dir(cache_dir, key))

    key = None
    if cache_dir:
        try:
            key = cache.cache_key(Path(onnx_path).read_bytes(), options)
        except Exception:  # e.g. no compiler: compile uncached, and let the job report why it fails
            key = None
    if not key:
        return result(*_compile_fresh(name, onnx_path, work_dir, options, timeout_s))
    hit = from_cache(key)
    if hit:
        return hit
    # A cold model hit by several threads or processes: one compiles, the others wait and hit.
    with cache.compile_lock(cache_dir, key, timeout_s):
        hit = from_cache(key)
        if hit:
            return hit
        compiled = _compile_fresh(name, onnx_path, work_dir, options, timeout_s)
        if compiled[0]:
            try:
                cache.store(cache_dir, key, work_dir, cache_max_bytes)
            except OSError as err:  # read-only or full: the engine is good, only sharing is lost
                _warn_read_only(cache_dir, err)
    return result(*compiled)


def _compile_fresh(name: str, onnx_path, work_dir: Path, options: dict, timeout_s: float) -> tuple:
    """(ok, so_path, manifest, error) of one compile subprocess in work_dir. Every error carries the
    tail of the log: the work dir (and the log with it) is gone after the compile unless dumped."""
    code, log_path = _run_subprocess(onnx_path, work_dir, options, timeout_s)
    where = f"log: {log_path}\n{_tail(log_path)}"
    if code is None:
        return False, None, None, f"engine compile of {name!r} timed out after {timeout_s} s; {where}"
    if code != 0:
        return False, None, None, f"engine compile of {name!r} failed (exit {code}); {where}"
    try:
        so_path, manifest = _read_artifacts(work_dir)
    except ValueError as err:
        return False, None, None, f"engine compile of {name!r} produced unusable artifacts: {err}; {where}"
    return True, so_path, manifest, None


def compile_many(jobs, *, parallelism: int = 1, timeout_s: float = 300.0, options: dict | None = None,
                 cache_dir=None, cache_max_bytes: int = 0, on_result=None) -> list[CompileResult]:
    """jobs: iterable of (name, onnx_path, work_dir). Results come back in job order.
    cache_dir: None = no cache; cache_max_bytes: its size bound (0 = unbounded).
    on_result: called with each CompileResult as it finishes (from a worker thread; progress)."""
    jobs = list(jobs)
    options = compiler.resolve_options(options)  # concrete ISA and compiler: part of the cache key
    with ThreadPoolExecutor(max_workers=max(1, parallelism)) as pool:
        futures = [pool.submit(_contained, job, options, timeout_s, cache_dir, cache_max_bytes) for job in jobs]
        for future in futures if on_result else ():
            future.add_done_callback(lambda done: on_result(done.result()))
        return [f.result() for f in futures]


def _contained(job, options, timeout_s, cache_dir, cache_max_bytes) -> CompileResult:
    """_compile_one, with any unexpected error (disk full, ...) turned into that job's failure."""
    try:
        return _compile_one(job, options, timeout_s, cache_dir, cache_max_bytes)
    except Exception as err:
        name, _, work_dir = job
        return CompileResult(name, False, None, None, str(work_dir), str(Path(work_dir) / JOB_LOG),
                             f"engine compile of {name!r} failed in the driver: {type(err).__name__}: {err}",
                             0.0, False)
