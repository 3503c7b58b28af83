"""Dynamic-shape graphs: one compile with run-time sizes, else one compile per input signature.

When dynamo hands over a graph with symbolic sizes (``dynamic=True``, ``mark_dynamic``, or by
itself after a shape change: "automatic dynamic shapes"), ``compile_dynamic`` first compiles it
once with engines that take the sizes at run time (blade/dynamic.py). When a cluster cannot
(``Config.dynamic_shapes="specialize"``, or a rule that computes from a run-time size), each
distinct signature (tensor shapes and dtypes, scalar values) gets its own static compile, on first
use (``ShapeSpecialized``); past ``MAX_VARIANTS`` signatures the graph runs eagerly, with one
warning. Compiling the graph for the example shapes alone would break the next call with others.
"""
from __future__ import annotations

import logging
import warnings

import torch

from blade.config import Config
from blade.dynamic import SizeSymbols
from blade.pipeline import compile_fx

log = logging.getLogger("blade")
MAX_VARIANTS = 8


def is_dynamic(gm: torch.fx.GraphModule, example_inputs) -> bool:
    """True when a placeholder is a SymInt or a tensor with a symbolic size."""
    if any(isinstance(x, torch.SymInt) for x in example_inputs):
        return True
    for node in gm.graph.nodes:
        value = node.meta.get("example_value") if node.op == "placeholder" else None
        if isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape):
            return True
    return False


def signature(args) -> tuple:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else (type(a), a)
                 for a in args)


def compile_dynamic(gm: torch.fx.GraphModule, example_inputs, config: Config):
    """One compile serving every size in the symbols' ranges, else a ShapeSpecialized saying why."""
    if config.dynamic_shapes == "specialize":
        return ShapeSpecialized(gm, config, "Config.dynamic_shapes is 'specialize'")
    symbolic = None
    try:
        symbols = SizeSymbols.of(gm, list(example_inputs), config.dynamic_max_size)
        symbolic = compile_fx(gm, list(example_inputs), config, symbols)
    except Exception as err:  # noqa: BLE001 - blade never takes the model down: compile per shape
        reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        log.debug("blade: no compile with run-time sizes", exc_info=True)
    else:
        if not symbolic.report.symbolic_refusals:
            return symbolic
        reason = "; ".join(symbolic.report.symbolic_refusals)
    log.info("blade: compiling this graph per input shape: %s", reason)
    return ShapeSpecialized(gm, config, reason, symbolic.report if symbolic else None)


class ShapeSpecialized:
    def __init__(self, gm: torch.fx.GraphModule, config: Config, reason: str = "",
                 symbolic_report=None):
        self.gm = gm
        self.config = config
        self.variants: dict = {}
        self.reason = reason                    # why not one compile with run-time sizes
        self.symbolic_report = symbolic_report  # that attempt's CompileReport, when it got that far

    def __call__(self, *args):
        key = signature(args)
        run = self.variants.get(key)
        if run is None:
            run = self.variants[key] = self._compile(args)
        return run(*args)

    def _compile(self, args):
        if len(self.variants) >= MAX_VARIANTS:
            if len(self.variants) == MAX_VARIANTS:
                warnings.warn(f"blade: more than {MAX_VARIANTS} input shapes for one graph; further "
                              f"shapes run eagerly (use fixed shapes, or torch.compile(dynamic=False))")
            return self.gm.forward
        log.info("blade: compiling a dynamic graph for signature %s", signature(args))
        try:
            with self.config:
                return compile_fx(self.gm, list(args), self.config)
        except Exception as err:  # noqa: BLE001 - blade never takes the model down
            warnings.warn(f"blade: tt_infer could not compile this graph for these shapes "
                          f"({type(err).__name__}: {err}); it runs eagerly")
            return self.gm.forward
