"""Dynamic-shape graphs, served by static engines: one compile per concrete input signature.

Engines have static shapes. When dynamo hands over a graph with symbolic sizes (it does so by
itself after a shape change: "automatic dynamic shapes"), compiling it for the example shapes
would break the next call with other shapes. Instead each distinct signature (tensor shapes and
dtypes, scalar values) gets its own compile, on first use; past ``MAX_VARIANTS`` signatures the
graph runs eagerly, with one warning.
"""
from __future__ import annotations

import logging
import warnings

import torch

from blade.config import Config
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


class ShapeSpecialized:
    def __init__(self, gm: torch.fx.GraphModule, config: Config):
        self.gm = gm
        self.config = config
        self.variants: dict = {}

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
