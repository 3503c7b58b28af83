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
from blade.guards import first_requiring_grad, module_tensors, placeholder_names
from blade.pipeline import CompiledModule, compile_fx, eager_for_grad_message
from blade.specialize import compile_dynamic, is_dynamic

log = logging.getLogger("blade")


def tt_infer(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None):
    config = Config.from_options(options)  # bad option names are the user's error: raise
    recording = _autograd_recording(gm, example_inputs)
    if recording is not None:
        warnings.warn(eager_for_grad_message(recording))
        return gm.forward
    if is_dynamic(gm, example_inputs):
        compiled = compile_dynamic(gm, example_inputs, config)
        return PrecompiledModule.wrap(compiled, config.fallback) if isinstance(compiled, CompiledModule) else compiled
    try:
        return PrecompiledModule.wrap(compile_fx(gm, list(example_inputs), config), config.fallback)
    except Exception as err:  # noqa: BLE001 - blade never takes the model down
        warnings.warn(f"blade: tt_infer could not compile this graph ({type(err).__name__}: {err}); "
                      f"it runs eagerly")
        log.debug("tt_infer failure", exc_info=True)
        return gm.forward


def _autograd_recording(gm: torch.fx.GraphModule, example_inputs) -> str | None:
    """What autograd would record through, when it would (dynamo calls the backend under the
    frame's grad mode and guards on it and on requires_grad, so this holds for every call of
    the graph): engines compute no gradients, so such a graph is not worth compiling."""
    if not torch.is_grad_enabled():
        return None
    return first_requiring_grad(example_inputs, placeholder_names(gm), module_tensors(gm))


register_backend(name="tt_infer", compiler_fn=tt_infer)
