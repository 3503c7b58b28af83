"""Debugging helpers on top of the Engine's fallback subgraphs (Config.fallback).

    blade.bisect(model, *inputs)   which cluster's engine breaks accuracy (None: none does)
    blade.set_fallback_mode(compiled, "eager")   switch the engines of compiled graphs at run time
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from blade.config import Config
from blade.pipeline import CompiledModule, compile_fx


class CapturingBackend:
    """A tt_infer backend that keeps every CompiledModule it produces (explain, bisect, tests)."""

    def __init__(self, config: Config):
        self.config = config
        self.compiled: list = []

    def __call__(self, gm, example_inputs):
        from blade.specialize import compile_dynamic, is_dynamic  # it imports the pipeline too
        if is_dynamic(gm, example_inputs):
            compiled = compile_dynamic(gm, list(example_inputs), self.config)
            # compiled per shape: its first variant, compiled by the call explain makes, reports
            self.compiled.append(compiled)
            return compiled
        compiled = compile_fx(gm, list(example_inputs), self.config)
        self.compiled.append(compiled)
        return compiled

    def reports(self) -> list:
        """The CompileReport of every graph (a per-shape graph: of each shape compiled so far,
        with why it is compiled per shape)."""
        reports = []
        for compiled in self.compiled:
            if isinstance(compiled, CompiledModule):
                reports.append(compiled.report)
                continue
            for variant in compiled.variants.values():
                if isinstance(variant, CompiledModule):
                    variant.report.size_symbols = f"compiled per shape: {compiled.reason}"
                    reports.append(variant.report)
        return reports

    def engines(self) -> list:
        """(cluster name, Engine) of every engine, graph by graph, in execution order."""
        return [item for compiled in self.compiled if isinstance(compiled, CompiledModule)
                for item in compiled.engines().items()]


def set_fallback_mode(compiled: CompiledModule, mode: str) -> None:
    for engine in compiled.engines().values():
        engine.set_fallback_mode(mode)


def _flat(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return [t for item in out for t in _flat(item)] if isinstance(out, (list, tuple)) else []


def outputs_match(actual, expected, rtol: float, atol: float) -> bool:
    got, want = _flat(actual), _flat(expected)
    return len(got) == len(want) and all(
        g.shape == w.shape and torch.allclose(g.double(), w.double(), rtol=rtol, atol=atol, equal_nan=True)
        for g, w in zip(got, want))


@dataclass
class BisectResult:
    cluster: str          # the first engine whose use breaks accuracy
    engines: int          # engines in the model
    runs: int             # model runs the bisection took
    ops_source: str       # that cluster's ops and source lines

    def __str__(self) -> str:
        return (f"blade.bisect: {self.cluster} breaks accuracy (found in {self.runs} runs over "
                f"{self.engines} engines); its ops:\n{self.ops_source}")


def bisect(model, *example_inputs, rtol: float = 1e-4, atol: float = 1e-5, **options) -> BisectResult | None:
    """Compiles model with its engines' subgraphs, then finds by bisection the first engine k such
    that engines 0..k on (later ones running their subgraph) no longer match eager."""
    config = Config.from_options({**options, "fallback": "eager"})
    backend = CapturingBackend(config)
    with torch.no_grad():
        expected = model(*example_inputs)
        compiled = torch.compile(model, backend=backend, dynamic=False)
        compiled(*example_inputs)
        engines = backend.engines()
        runs = 0

        def matches_with_first(k: int) -> bool:
            nonlocal runs
            runs += 1
            for i, (_, engine) in enumerate(engines):
                engine.set_fallback_mode("off" if i < k else "eager")
            return outputs_match(compiled(*example_inputs), expected, rtol, atol)

        if matches_with_first(len(engines)):
            return None
        low, high = 0, len(engines)  # invariant: first `low` engines match, first `high` do not
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if matches_with_first(middle) else (low, middle)
    name = engines[high - 1][0]
    report = next(c for comp in backend.compiled for c in comp.report.clusters if c.name == name)
    return BisectResult(name, len(engines), runs, report.ops_source)
