"""The ``tt_infer`` dynamo backend: GraphModule + example inputs -> a callable running engines.

The callable is a ``blade.aot.PrecompiledModule``, so ``torch.compile(...).aot_compile(...)``
can save it and a serving process can load it without tracing or compiling.
"""
from __future__ import annotations

import logging
import warnings

import torch
from torch._dynamo.backends.registry import register_backend

from blade.aot import PrecompiledModule
from blade.config import Config
from blade.pipeline import compile_fx
from blade.specialize import ShapeSpecialized, is_dynamic

log = logging.getLogger("blade")


def tt_infer(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None):
    config = Config.from_options(options)  # bad option names are the user's error: raise
    if is_dynamic(gm, example_inputs):
        return ShapeSpecialized(gm, config)
    try:
        return PrecompiledModule.wrap(compile_fx(gm, list(example_inputs), config), config.fallback)
    except Exception as err:  # noqa: BLE001 - blade never takes the model down
        warnings.warn(f"blade: tt_infer could not compile this graph ({type(err).__name__}: {err}); "
                      f"it runs eagerly")
        log.debug("tt_infer failure", exc_info=True)
        return gm.forward


register_backend(name="tt_infer", compiler_fn=tt_infer)
