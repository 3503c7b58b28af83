"""What a compiled graph checks on every call before it runs its engines.

Engines compute inference only, on the parameter values of compile time:

- **autograd**: an engine's outputs have no ``grad_fn``. When autograd would record (grad enabled
  and an input or parameter requires grad), the graph runs eagerly instead, with one warning, so
  ``backward()`` works; under ``torch.no_grad()`` / ``torch.inference_mode()`` the check is one
  ``torch.is_grad_enabled()`` call.
- **frozen weights**: with ``Config.freeze_params`` parameters and buffers become constants inside
  the engines. ``FrozenWeights`` remembers each one's identity, version counter (bumped by every
  in-place write: ``mul_``, ``copy_``, ``load_state_dict``, optimizer steps) and data pointer
  (``p.data = t``); a change means the engines hold stale values and the graph must be compiled
  again. Writes through ``p.data`` (``p.data.copy_(t)``) bypass the version counter: they are
  invisible here (as they are to autograd).
- **Python scalars**: in a graph with symbolic sizes dynamo passes float and int attributes of
  modules (a layer norm's eps, a dropout's p, attention's scaling) as 0-d tensors it makes on
  every call (``wrapped_scalars``). They are frozen into the engines like weights; ``ScalarValues``
  compares their values on each call, and another value runs the graph eagerly.
"""
from __future__ import annotations

import operator
import re

import torch

import blade._C as _C


def readable_source(name: str) -> str:
    """dynamo's "L['self']._modules['fc']._parameters['weight']" as "L['self'].fc.weight"."""
    return re.sub(r"\._(?:modules|parameters|buffers)\['([^']+)'\]", r".\1", name)


def placeholder_names(gm: torch.fx.GraphModule) -> list[str]:
    """A readable name per graph input: where dynamo got it from, else the placeholder's name.
    Kept in gm.meta: dynamo drops the sources from the nodes after the first compile, and a
    recompile (frozen weights changed) should name inputs the same way."""
    if "blade_input_names" not in gm.meta:
        gm.meta["blade_input_names"] = [_source_name(node) for node in gm.graph.nodes if node.op == "placeholder"]
    return gm.meta["blade_input_names"]


def wrapped_scalars(gm: torch.fx.GraphModule) -> set[int]:
    """Positions of graph inputs that are Python scalars dynamo wraps into 0-d tensors (kept in
    gm.meta like the names: dynamo drops its GraphArgs from the nodes after the first compile)."""
    if "blade_wrapped_scalars" not in gm.meta:
        placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
        gm.meta["blade_wrapped_scalars"] = {i for i, node in enumerate(placeholders)
                                           if getattr(node.meta.get("grapharg"), "pass_arg_as_tensor", False)}
    return gm.meta["blade_wrapped_scalars"]


class ScalarValues:
    """The wrapped scalars a compile froze, and their values then (see the module docstring)."""

    def __init__(self, names: list[str], positions: list[int], values: list):
        self.names, self.positions, self.values = names, positions, values

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, example_inputs: list, runtime_inputs: list) -> "ScalarValues":
        names, kept = placeholder_names(gm), set(runtime_inputs)
        frozen = [(names[i], i, example_inputs[i].item()) for i in sorted(wrapped_scalars(gm))
                  if i not in kept and isinstance(example_inputs[i], torch.Tensor)]
        return cls(*(list(column) for column in zip(*frozen))) if frozen else cls([], [], [])

    def changed(self, args: tuple) -> str | None:
        """The name of the first wrapped scalar whose value differs from compile time, else None."""
        for name, position, value in zip(self.names, self.positions, self.values):
            if args[position].item() != value:
                return name
        return None


def _source_name(node: torch.fx.Node) -> str:
    source = getattr(node.meta.get("grapharg"), "source", None)
    return readable_source(source.name) if source is not None else node.name


def first_requiring_grad(args, names: list[str], attributes: dict) -> str | None:
    """The name of the first tensor autograd would record through (call under grad mode only)."""
    for position, arg in enumerate(args):
        if isinstance(arg, torch.Tensor) and arg.requires_grad:
            return names[position] if position < len(names) else f"input {position}"
    return next((name for name, tensor in attributes.items() if tensor.requires_grad), None)


def module_tensors(gm: torch.fx.GraphModule) -> dict:
    """Parameters and buffers the graph reads as attributes (``torch._dynamo.export``'s graphs,
    behind blade.compile_model and blade.export); TorchScript freezing makes them constants."""
    return {**dict(gm.named_parameters()), **dict(gm.named_buffers())}


# FX targets that write their first argument in place, besides methods named like ``add_``.
WRITING_FUNCTIONS = {operator.setitem, operator.iadd, operator.isub, operator.imul,
                     operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
                     operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift}
# FX targets whose result aliases their first argument (a write to it writes the input).
VIEW_TARGETS = {operator.getitem, "view", "view_as", "reshape", "narrow", "select", "transpose",
                "permute", "unsqueeze", "squeeze", "expand", "expand_as", "flatten", "t", "detach",
                "__getitem__", "unflatten", "as_strided", "diagonal"}


def written_inputs(gm: torch.fx.GraphModule) -> set[int]:
    """Positions of graph inputs the graph itself writes (``self.count.add_(1)``, a buffer
    updated through a view): state, not weights; their version counters move on every call."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    alias_of = {node: position for position, node in enumerate(placeholders)}
    written = set()
    for node in gm.graph.nodes:
        first = node.args[0] if node.args else None
        if node.op not in ("call_method", "call_function") or first not in alias_of:
            continue
        if _writes_first_arg(node.target):
            written.add(alias_of[first])
        elif node.target in VIEW_TARGETS or getattr(node.target, "__name__", None) in VIEW_TARGETS:
            alias_of[node] = alias_of[first]
    return written


def _writes_first_arg(target) -> bool:
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return target in WRITING_FUNCTIONS or (name.endswith("_") and not name.endswith("__"))


class FrozenWeights:
    """The tensors a compile froze into constants, and their state at compile time (held by
    ``blade._C.FrozenTensors``, which checks them in C++: a Python loop reading each tensor's
    ``_version`` and ``data_ptr()`` cost 17 us per call on BERT's 73 tensors)."""

    def __init__(self, names: list[str], positions: list, tensors: list):
        self.names = names
        self._check = _C.FrozenTensors([-1 if p is None else p for p in positions], tensors)

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, example_inputs: list, runtime_inputs: list) -> "FrozenWeights":
        """Frozen = tensor inputs the frontend did not keep as inputs, and the module's attributes,
        but not those the graph writes itself."""
        names, kept = placeholder_names(gm), set(runtime_inputs) | written_inputs(gm) | wrapped_scalars(gm)
        frozen = [(names[i], i, t) for i, t in enumerate(example_inputs)
                  if isinstance(t, torch.Tensor) and i not in kept]
        frozen += [(f"graph attribute {name}", None, t) for name, t in module_tensors(gm).items()]
        return cls(*(list(column) for column in zip(*frozen))) if frozen else cls([], [], [])

    def same_objects(self, args: tuple) -> bool:
        """Whether args pass the very tensors of compile time (a change is then an in-place write)."""
        return self._check.same_objects(args)

    def changed(self, args: tuple) -> str | None:
        """The name of the first frozen tensor replaced or written since compile time, else None."""
        index = self._check.changed(args)
        return None if index < 0 else self.names[index]
