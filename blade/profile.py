"""blade.profile(model, *example_inputs): where a compiled model's time goes.

The model is compiled with ``Config(profile=True)``: every engine is built with -DBLADE_PROFILE, so
each of its kernels (one GEMM, one convolution, one fused loop nest) adds its wall time to a
counter. The report splits a model call into time in kernels, engine-call overhead (input checks,
output allocation, scratch) and time outside engines (TorchScript, dynamo's guards, glue ops), and
lists the kernels that take the most, with their share, then the GEMM kernel the runtime chose per
call shape (MKL or oneDNN, by timing them on the first call of each shape; BLADE_GEMM pins one) with
what each candidate took.

Profiled engines are separate cache entries (the flag is part of the cache key); timings are wall
time, so on a busy machine they include waiting for the CPU.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

import blade._C
from blade.config import Config
from blade.debug import CapturingBackend

# What a kernel is, by the comment the code generator gives it (blade/engine/loops.py, calls.py).
CATEGORIES = (("= matmul", "GEMM"), ("= fused attention", "attention"), ("= conv", "convolution"),
              ("contiguous copy", "copy"), ("", "loops"))


@dataclass
class KernelTime:
    engine: str
    index: int
    name: str
    ms_per_run: float

    @property
    def category(self) -> str:
        return next(label for marker, label in CATEGORIES if marker in self.name)


@dataclass
class Profile:
    model_ms: float                   # one model call through torch.compile, mean (as the counters)
    engine_ms: float                  # inside Engine::run_engine, per model call
    kernels: list = field(default_factory=list)  # KernelTime, per model call
    top: int = 15                     # kernels listed by __str__
    gemm_choices: list = field(default_factory=list)  # blade._C.gemm_choices(): this process's so far

    @property
    def kernel_ms(self) -> float:
        return sum(k.ms_per_run for k in self.kernels)

    def by_category(self) -> dict:
        totals: dict = {}
        for k in self.kernels:
            totals[k.category] = totals.get(k.category, 0.0) + k.ms_per_run
        return dict(sorted(totals.items(), key=lambda item: -item[1]))

    def __str__(self) -> str:
        outside = max(self.model_ms - self.engine_ms, 0.0)
        overhead = max(self.engine_ms - self.kernel_ms, 0.0)
        lines = [f"blade.profile: {self.model_ms:.3f} ms per call = {self.kernel_ms:.3f} ms in kernels + "
                 f"{overhead:.3f} ms engine-call overhead + {outside:.3f} ms outside engines"]
        lines += [f"  {label:12s} {ms:8.3f} ms  {100 * ms / max(self.model_ms, 1e-12):5.1f}%"
                  for label, ms in self.by_category().items()]
        lines.append("top kernels:")
        for k in sorted(self.kernels, key=lambda k: -k.ms_per_run)[:self.top]:
            lines.append(f"  {k.ms_per_run:8.3f} ms {100 * k.ms_per_run / max(self.model_ms, 1e-12):5.1f}%  "
                         f"{k.engine} #{k.index}: {k.name}")
        if self.gemm_choices:
            lines.append("GEMM kernels chosen per bucket of call shapes (this process; best sampled call per candidate):")
        for choice in self.gemm_choices:
            timed = ", ".join(f"{name} {us:.1f} us" for name, us in choice["microseconds"])
            state = "" if choice["settled"] else ", still sampling"
            lines.append(f"  {choice['kernel']:14s} {choice['shape']}  ({timed}; {choice['timings']} calls sampled{state})")
        return "\n".join(lines)


def _counters(text: str) -> tuple:
    """(ns in run_engine, [(kernel name, ns)]) totals so far, from Engine.profile()'s text."""
    lines = text.splitlines()
    kernels = [line.split("\t", 1) for line in lines[2:]]
    return int(lines[1].split("\t")[1]), [(name, int(ns)) for ns, name in kernels]


def profile(model, *example_inputs, runs: int = 50, warmup: int = 25, **options) -> Profile:
    """Compiles model with tt_infer and profiling engines, runs it warmup + runs times, and reports
    the per-call time split (model, engines, kernels) averaged over the timed runs.

    The warm-up is long because the runtime chooses its GEMM kernels on a model's first calls (each
    candidate timed ~5 calls per bucket of shapes, gemm_choice.cpp): with 5 warm-up calls the mean
    over 50 runs still held that sampling, and MobileNetV2 b1's kernels summed to 3.0 ms a call
    where the settled call took 1.45 ms in all (with 30: 1.26 ms of kernels)."""
    config = Config.from_options({**options, "profile": True})
    backend = CapturingBackend(config)
    with torch.no_grad():
        compiled = torch.compile(model, backend=backend, dynamic=False)
        for _ in range(warmup):
            compiled(*example_inputs)
        baseline = {name: engine.profile() for name, engine in backend.engines()}
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            compiled(*example_inputs)
            times.append(time.perf_counter() - start)
    # The mean, like the engines' counters (totals over the runs): a median next to them made the
    # parts exceed the whole when a few calls waited for a busy CPU (a 0.14 ms median call "held"
    # 4.4 ms of GEMM per call on a loaded 2-core machine).
    result = Profile(model_ms=1e3 * sum(times) / len(times), engine_ms=0.0)
    for name, engine in backend.engines():
        if not baseline[name]:
            continue  # compiled without profiling (cannot happen with profile=True; kept safe)
        (call_before, before), (call_after, after) = _counters(baseline[name]), _counters(engine.profile())
        result.engine_ms += (call_after - call_before) / runs / 1e6
        result.kernels += [KernelTime(name, index, kernel, (ns - ns_before) / runs / 1e6)
                           for index, ((kernel, ns), (_, ns_before)) in enumerate(zip(after, before))]
    result.gemm_choices = blade._C.gemm_choices()
    return result
