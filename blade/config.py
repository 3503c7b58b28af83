"""blade's configuration: one dataclass, and every environment variable that feeds it.

Precedence: explicit fields (``Config(...)``, ``torch.compile(..., options={...})``) over the
environment over the defaults below. ``with Config(...):`` makes a config current for the calling
thread only, so concurrent compiles in other threads keep their own.
"""
from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass, field, fields

FALLBACK_MODES = ("off", "fallback", "check", "eager")
DYNAMIC_MODES = ("symbolic", "specialize")  # graphs with symbolic sizes: one compile, or one per shape


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "blade")


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _parse_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _env_or(name: str, default):
    """A field default read from the field's environment variable at construction time."""
    def make():
        env, parse = ENV_VARS[name]
        if env not in os.environ:
            return default() if callable(default) else default
        try:
            return parse(os.environ[env])
        except ValueError as err:
            raise ValueError(f"bad value for {env}: {err}") from None
    return field(default_factory=make)


@dataclass
class Config:
    """Every knob of blade; the environment variable of each field is in ``ENV_VARS`` below."""

    min_cluster_size: int = _env_or("min_cluster_size", 2)      # smaller clusters stay in TorchScript
    excluded_ops: tuple = _env_or("excluded_ops", ())            # kinds never clustered, e.g. ("aten::softmax",)
    compile_parallelism: int = _env_or("compile_parallelism", lambda: os.cpu_count() or 1)
    compile_timeout_s: float = _env_or("compile_timeout_s", 300.0)  # per cluster
    cache_dir: str = _env_or("cache_dir", _default_cache_dir)
    use_cache: bool = _env_or("use_cache", True)
    cache_max_bytes: int = _env_or("cache_max_bytes", 2 << 30)  # LRU eviction above this size (0 = unbounded)
    dump_dir: str = _env_or("dump_dir", "")                     # "" = artifacts in a temp dir only
    fallback: str = _env_or("fallback", "off")                  # one of FALLBACK_MODES
    rtol: float = _env_or("rtol", 1e-4)                         # tolerances of fallback="check"
    atol: float = _env_or("atol", 1e-5)
    target_isa: str = _env_or("target_isa", "native")           # "native" or an -march level
    freeze_params: bool = _env_or("freeze_params", True)        # parameters/buffers become constants
    cxx: str = _env_or("cxx", "g++")                            # the C++ compiler engines are built with
    progress: bool = _env_or("progress", True)                  # "compiled N/M clusters" on stderr (long compiles)
    profile: bool = _env_or("profile", False)                   # engines time their kernels (blade.profile)
    dynamic_shapes: str = _env_or("dynamic_shapes", "symbolic")  # one of DYNAMIC_MODES (blade/dynamic.py)
    # The maxima of size symbols dynamo leaves unbounded (blade/dynamic.py): engines plan scratch at
    # the maxima, so one cap for all of them is halved from dynamic_max_size until the graph's peak
    # of live tensor bytes at the maxima fits dynamic_memory_budget. Larger sizes compile per shape.
    dynamic_max_size: int = _env_or("dynamic_max_size", 4096)
    dynamic_memory_budget: int = _env_or("dynamic_memory_budget", 1 << 30)
    # blade.load: glibc maps blocks of at least this many bytes and unmaps them on free, so a
    # server's peak RSS stays at the largest shape's, at the price of page faults on every call
    # for every large tensor in the process (blade/malloc.py); 0 (the default) leaves malloc alone
    mmap_threshold: int = _env_or("mmap_threshold", 0)

    def __post_init__(self) -> None:
        if self.fallback not in FALLBACK_MODES:
            raise ValueError(f"fallback must be one of {FALLBACK_MODES}, got {self.fallback!r}")
        if self.dynamic_shapes not in DYNAMIC_MODES:
            raise ValueError(f"dynamic_shapes must be one of {DYNAMIC_MODES}, got {self.dynamic_shapes!r}")
        if self.dynamic_max_size < 2:
            raise ValueError("dynamic_max_size must be >= 2")
        if isinstance(self.excluded_ops, str):
            self.excluded_ops = _parse_list(self.excluded_ops)
        self.excluded_ops = tuple(op if "::" in op else f"aten::{op}" for op in self.excluded_ops)
        if self.min_cluster_size < 1 or self.compile_parallelism < 1:
            raise ValueError("min_cluster_size and compile_parallelism must be >= 1")

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_options(cls, options: dict | None) -> "Config":
        """The config for ``torch.compile(..., options=...)``: current config + these keys."""
        options = dict(options or {})
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - valid)
        if unknown:
            raise ValueError(f"unknown blade option(s) {unknown}; valid options: {sorted(valid)}")
        return dataclasses.replace(current(), **options)

    # -- context manager -------------------------------------------------------------------------
    def __enter__(self) -> "Config":
        _stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _stack().pop()


ENV_VARS = {
    "min_cluster_size": ("BLADE_MIN_CLUSTER_SIZE", int),
    "excluded_ops": ("BLADE_EXCLUDED_OPS", _parse_list),
    "compile_parallelism": ("COMPILE_PARALLELISM", int),
    "compile_timeout_s": ("BLADE_COMPILE_TIMEOUT", float),
    "cache_dir": ("BLADE_CACHE_DIR", str),
    "use_cache": ("BLADE_USE_CACHE", _parse_bool),
    "cache_max_bytes": ("BLADE_CACHE_MAX_BYTES", int),
    "dump_dir": ("BLADE_DUMP_DIR", str),
    "fallback": ("BLADE_FALLBACK", str),
    "rtol": ("BLADE_RTOL", float),
    "atol": ("BLADE_ATOL", float),
    "target_isa": ("BLADE_TARGET_ISA", str),
    "freeze_params": ("BLADE_FREEZE_PARAMS", _parse_bool),
    "cxx": ("CXX", str),
    "progress": ("BLADE_PROGRESS", _parse_bool),
    "profile": ("BLADE_PROFILE", _parse_bool),
    "dynamic_shapes": ("BLADE_DYNAMIC_SHAPES", str),
    "dynamic_max_size": ("BLADE_DYNAMIC_MAX_SIZE", int),
    "dynamic_memory_budget": ("BLADE_DYNAMIC_MEMORY_BUDGET", int),
    "mmap_threshold": ("BLADE_MMAP_THRESHOLD", int),
}

_local = threading.local()


def _stack() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def current() -> Config:
    """The innermost ``with Config(...)`` of this thread, else the defaults and environment."""
    stack = _stack()
    return stack[-1] if stack else Config()
