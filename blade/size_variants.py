"""Declared dims a single capture does not serve, and the archive module that dispatches by size.

``blade.export(..., dynamic_shapes={"ids": {1: Dim("seq", min=1, max=512)}})`` captures one graph,
but dynamo narrows a declared range whenever the model branches on the size: transformers'
attention computes ``is_causal = q_length > 1 and ...``, so the graph guards seq >= 2 and cannot
serve seq 1 (no torch mechanism keeps the symbol through that branch). Rather than narrow the
declared range silently, export captures the model again with such a dim fixed at each value the
graph left out (a handful at most, ``MAX_EXCLUDED``), each capture serving the other declared dims
at run time, and the archive's forward picks the capture by the input sizes:

    def forward(self, x0: Tensor, x1: Tensor):
        d0 = x0.size(1)                       # every declared dim, checked against its range
        if d0 < 1 or d0 > 512: raise RuntimeError("... outside its declared range [1, 512]")
        if d0 == 1: return self.capture_1(x0, x1)   # the most specific capture first
        return self.capture_0(x0, x1)

The dispatch is TorchScript, so a C++ server (torch::jit::load) dispatches the same way.
"""
from __future__ import annotations

import json
import typing
import warnings
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch.fx.graph_module import _forward_from_src  # FX's own: source kept for TorchScript
from torch.export.dynamic_shapes import Dim, _combine_args, _DerivedDim, _StaticDim, _tree_map_with_path
from torch.utils._sympy.numbers import int_oo

SIZE_ERROR = "blade archive: "   # how the dispatcher's range errors start (see size_error)
MAX_EXCLUDED = 2    # values of one dim a capture leaves out that get captures of their own
MAX_CAPTURES = 4    # captures per export (each one is a full compile)


class UncoverableRange(ValueError):
    """A declared dim's range cannot be served (the message names the dim and the values)."""


@dataclass
class DeclaredDim:
    """A plain torch.export Dim and where the inputs carry it: (flat input position, dim, path)."""
    name: str
    lo: int
    hi: int | None          # None: no declared maximum
    places: list = field(default_factory=list)

    def describe(self) -> str:
        return f"[{self.lo}, {'inf' if self.hi is None else self.hi}]"


def declared_dims(model, args: tuple, kwargs: dict, dynamic_shapes, flat_inputs: list) -> dict:
    """name -> DeclaredDim for every plain Dim of dynamic_shapes (derived dims follow their root
    and are not checked here)."""
    combined = _combine_args(model, args, kwargs)
    tree = type(dynamic_shapes)(combined.values()) if isinstance(dynamic_shapes, (tuple, list)) else combined
    dims: dict = {}

    def visit(path, value, spec):
        if not isinstance(value, torch.Tensor) or spec is None:
            return
        items = spec.items() if isinstance(spec, dict) else enumerate(spec)
        for dim, declared in items:
            if not _is_plain_dim(declared):
                continue
            # size 0 (empty inputs) is not served: torch.export's default minimum is 0, and a
            # model rarely runs, let alone means anything, at sequence length 0
            entry = dims.setdefault(declared.__name__, DeclaredDim(declared.__name__, max(int(declared.min), 1),
                                                                   _finite(declared.max)))
            entry.places += [(i, dim, f"inputs{pytree.keystr(path)}") for i, leaf in enumerate(flat_inputs)
                             if leaf is value]

    _tree_map_with_path(visit, tree, dynamic_shapes, tree_name="inputs")
    return dims


def _is_plain_dim(value) -> bool:
    return isinstance(value, Dim) and not isinstance(value, (_DerivedDim, _StaticDim))


def _finite(value) -> int | None:
    return None if value is None or value == int_oo or value == float("inf") else int(value)


def captured_ranges(gm: torch.fx.GraphModule, dims: dict) -> dict:
    """name -> (lo, hi) the captured graph serves for each declared dim (hi None: unbounded): the
    intersection of its sizes' ranges in dynamo's ShapeEnv, or the one value dynamo fixed it to."""
    placeholders = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    shape_env = None
    ranges = {}
    for name, declared in dims.items():
        lo, hi = declared.lo, declared.hi
        for position, dim, _ in declared.places:
            if not isinstance(placeholders[position], torch.Tensor):
                continue  # no example value to read the size from
            size = placeholders[position].shape[dim]
            if isinstance(size, torch.SymInt):
                shape_env = shape_env or size.node.shape_env
                bound = shape_env.bound_sympy(size.node.expr)
                at_least, at_most = int(bound.lower), _finite(bound.upper)
            else:
                at_least = at_most = int(size)
            lo = max(lo, at_least)
            hi = at_most if hi is None else (hi if at_most is None else min(hi, at_most))
        ranges[name] = (lo, hi)
    return ranges


def excluded_values(dims: dict, served: dict, fixed: dict) -> dict:
    """name -> the declared values a capture (serving ``served``) leaves out, for the dims not
    fixed; UncoverableRange when more than MAX_EXCLUDED values of one dim are left out. A dim
    declared without a maximum is checked at its lower end only (blade caps open maxima itself,
    see README's dynamic shapes)."""
    excluded = {}
    for name, declared in dims.items():
        if name in fixed:
            continue
        lo, hi = served[name]
        values = list(range(declared.lo, lo))
        if declared.hi is not None and hi is not None:
            values += list(range(hi + 1, declared.hi + 1))
        if len(values) > MAX_EXCLUDED:
            raise UncoverableRange(
                f"dim '{name}' is declared {declared.describe()}, but the model's graph serves it only in "
                f"[{lo}, {hi}] (dynamo guards on it{_fixed_text(fixed)}); {_values_text(values)} would each need "
                f"a capture of their own (at most {MAX_EXCLUDED} per dim). Declare the range [{lo}, {hi}] for it")
        if values:
            excluded[name] = values
    return excluded


def _values_text(values: list) -> str:
    return "values " + ", ".join(map(str, values)) if len(values) <= 6 else \
        f"the {len(values)} values {values[0]}..{values[-1]}"


def _fixed_text(fixed: dict) -> str:
    return "" if not fixed else " with " + ", ".join(f"{n}={v}" for n, v in sorted(fixed.items()))


def inputs_at(flat_inputs: list, dims: dict, fixed: dict) -> list:
    """The example's flat inputs with each fixed dim cut down (or repeated cyclically) to its
    value: token ids stay in range, masks stay zeros and ones."""
    flat = list(flat_inputs)
    for name, value in fixed.items():
        for position, dim, _ in dims[name].places:
            index = torch.arange(value) % max(flat[position].shape[dim], 1)
            flat[position] = flat[position].index_select(dim, index)
    return flat


def shapes_with_fixed(dynamic_shapes, fixed: dict):
    """dynamic_shapes with the fixed dims' Dims replaced by None (static)."""
    return pytree.tree_map(lambda d: None if _is_plain_dim(d) and d.__name__ in fixed else d, dynamic_shapes)


def has_dims(dynamic_shapes) -> bool:
    return any(isinstance(leaf, Dim) for leaf in pytree.tree_leaves(dynamic_shapes))


@dataclass
class Capture:
    """One compile of the model: the declared dims fixed to values, the rest at run time."""
    fixed: dict                 # dim name -> value
    module: torch.jit.ScriptModule
    inputs: list                # the flat input positions its forward takes


def dispatcher(captures: list, dims: dict) -> tuple:
    """(ScriptModule, flat input positions it takes) that checks every declared dim against its
    declared range and runs the most specific capture whose fixed dims match the inputs (the
    capture with nothing fixed, captures[0], last)."""
    taken = sorted(set().union(*(c.inputs for c in captures)))
    types = {}
    for capture in captures:
        arguments = capture.module.forward.schema.arguments[1:]
        types.update({position: str(arg.type) for position, arg in zip(capture.inputs, arguments)})
    lines = [f"def forward(self, {', '.join(f'x{p}: {types[p]}' for p in taken)}):"]
    first = {}   # dim name -> the variable holding its size
    for name, declared in sorted(dims.items()):
        for position, dim, path in declared.places:
            if position not in taken:
                continue
            size = f"d{position}_{dim}"
            first.setdefault(name, size)
            limits = [f"{size} < {declared.lo}"] + ([] if declared.hi is None else [f"{size} > {declared.hi}"])
            message = (f"{SIZE_ERROR}{path} dim {dim} (Dim '{name}') is {{}}, outside its declared range "
                       f"{declared.describe()}")
            lines += [f"    {size} = x{position}.size({dim})",
                      f"    if {' or '.join(limits)}:",
                      f"        raise RuntimeError({json.dumps(message)}.format({size}))"]
    ordered = sorted(captures[1:], key=lambda c: -len(c.fixed)) + [captures[0]]
    for capture in ordered:
        missing = [name for name in capture.fixed if name not in first]
        if missing:
            raise UncoverableRange(f"dim '{missing[0]}' has a capture of its own, but no input the archive takes "
                                   f"carries it")
        call = f"return self.capture_{captures.index(capture)}({', '.join(f'x{p}' for p in capture.inputs)})"
        if capture.fixed:
            test = " and ".join(f"{first[name]} == {value}" for name, value in sorted(capture.fixed.items()))
            lines += [f"    if {test}:", f"        {call}"]
        else:
            lines.append(f"    {call}")
    forward = _forward_from_src("\n".join(lines) + "\n", dict(vars(typing), Tensor=torch.Tensor))
    holder = type("BladeSizeDispatch", (torch.nn.Module,), {"forward": forward})()
    for k, capture in enumerate(captures):
        # a frozen module's Python wrapper names a type TorchScript cannot cast a submodule
        # attribute to; a fresh wrapper of the same C++ module carries its own type
        setattr(holder, f"capture_{k}", torch.jit._recursive.wrap_cpp_module(capture.module._c))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TorchScript's notice about nn.Module.__init__
        return torch.jit.script(holder), taken


def size_error(err: Exception) -> RuntimeError | None:
    """The dispatcher's range error as the RuntimeError it raises in TorchScript (the interpreter
    hands Python a torch.jit.Error, which is no RuntimeError, with TorchScript's traceback), else None."""
    last = str(err).rstrip().splitlines()[-1] if str(err).strip() else ""
    prefix = f"builtins.RuntimeError: {SIZE_ERROR}"
    return RuntimeError(last[len("builtins.RuntimeError: "):]) if last.startswith(prefix) else None
