"""How an exported model is called: the structure of its inputs and outputs, saved with the archive.

The archive's TorchScript module takes flat tensors and returns a flat tuple (what a C++ server or
``torch.jit.load`` sees). ``blade.load`` wraps it in an ``ExportedModule`` that takes the model's own
arguments (positional, keyword, nested tuples/lists/dicts) and returns the model's own output
structure (tuples, dicts, transformers' ModelOutput ...), like ``torch.export``'s ``module()``.

The structures are torch's pytree specs (``torch.utils._pytree``), serialized with
``treespec_dumps``. A container type from a library must be registered with pytree under a
``serialized_type_name`` (transformers registers its ModelOutput classes so, on import): the loading
process imports the type's module by that name. When a structure cannot be saved or rebuilt, the
module returns the flat tuple, with a warning saying why.
"""
from __future__ import annotations

import importlib
import json
import warnings
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from blade.direct import DirectPlan, direct_plan
from blade.executor import unoptimized
from blade.pipeline import picker
from blade.size_variants import size_error

SIGNATURE_FILE = "blade_signature.json"
SIGNATURE_FORMAT = 1


@dataclass
class Signature:
    """in_spec: the spec of (args, kwargs) at export; constants: flat position -> the value of each
    non-tensor leaf (dynamo specialized the graph to it); graph_inputs: the flat positions the
    archive's module takes; out_spec: the spec of the model's output (None: flat tuple)."""
    in_spec: pytree.TreeSpec
    constants: dict
    graph_inputs: list
    out_spec: pytree.TreeSpec | None
    # Set when in_spec is n positional tensors and no keywords: a call of n plain tensors then
    # flattens to itself, which saves pytree's tree_flatten and spec comparison (6 of the 11 us
    # a one-engine loaded module cost per call).
    _positional: int | None = field(init=False, repr=False, compare=False)
    _pick: object = field(init=False, repr=False, compare=False)
    # flat outputs -> the model's structure; a single tensor or a tuple of tensors without
    # pytree's tree_unflatten (~0.3 us per call)
    _unflatten: object = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        n = self.in_spec.num_leaves
        flat = not self.constants and self.in_spec == pytree.tree_structure((tuple(range(n)), {}))
        self._positional = n if flat else None
        # all inputs in order (the usual case): the call's args are the flat inputs as they are
        self._pick = (lambda args: args) if self.graph_inputs == list(range(n)) else picker(self.graph_inputs)
        self._unflatten = _unflattener(self.out_spec)

    @classmethod
    def of(cls, in_spec, out_spec, flat_inputs: list, graph_inputs: list) -> "Signature":
        constants = {i: v for i, v in enumerate(flat_inputs) if not isinstance(v, torch.Tensor)}
        return cls(in_spec, constants, list(graph_inputs), out_spec)

    def dumps(self, what: str) -> str:
        """JSON for the archive; an output structure that cannot be serialized is dropped with a
        warning (the archive then returns a flat tuple)."""
        out = None
        if self.out_spec is not None:
            try:
                out = pytree.treespec_dumps(self.out_spec)
            except Exception as err:  # noqa: BLE001 - an unregistered or unnamed container type
                warnings.warn(f"blade.export: {what}'s output structure cannot be saved ({err}); the "
                              f"loaded module returns its output tensors as a flat tuple")
        return json.dumps({"format": SIGNATURE_FORMAT, "in_spec": pytree.treespec_dumps(self.in_spec),
                           "constants": [[i, _jsonable(v)] for i, v in sorted(self.constants.items())],
                           "graph_inputs": self.graph_inputs, "out_spec": out})

    @classmethod
    def loads(cls, text: str, what: str) -> "Signature":
        state = json.loads(text)
        if state.get("format") != SIGNATURE_FORMAT:
            raise ValueError(f"{what}: call signature of format {state.get('format')}, this blade reads "
                             f"{SIGNATURE_FORMAT}; re-export the model")
        out_spec = None
        if state["out_spec"] is not None:
            try:
                out_spec = _load_spec(state["out_spec"], what)
            except ValueError as err:
                warnings.warn(f"{err}; it returns its output tensors as a flat tuple")
        return cls(_load_spec(state["in_spec"], what), {i: v for i, v in state["constants"]},
                   state["graph_inputs"], out_spec)

    def flat_inputs(self, args: tuple, kwargs: dict, what: str) -> list:
        """The archive module's inputs for a call, or TypeError when the call's structure or a
        specialized constant differs from the export's."""
        if not kwargs and len(args) == self._positional and all(type(a) is torch.Tensor for a in args):
            return self._pick(args)
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.in_spec:
            raise TypeError(f"{what} was exported for inputs structured as {_short(self.in_spec)}; this "
                            f"call passes {_short(spec)}")
        for position, value in self.constants.items():
            if _jsonable(leaves[position]) != value:
                raise ValueError(f"{what} was exported with the non-tensor input #{position} = {value!r} "
                                 f"built into its graph; this call passes {leaves[position]!r}. Export "
                                 f"again with that value")
        return [leaves[i] for i in self.graph_inputs]

    def outputs(self, flat) -> object:
        return self._unflatten(flat)

    def bind(self, forward, what: str):
        """The model's call, (args, kwargs) -> its output structure, around forward (the flat
        inputs as one sequence -> the flat outputs). flat_inputs and outputs in one function: at
        [8, 256] the two method calls were a third of a one-engine module's call."""
        positional, pick, unflatten, flat_inputs = self._positional, self._pick, self._unflatten, self.flat_inputs

        def call(args: tuple, kwargs: dict):
            if not kwargs and len(args) == positional and all(type(a) is torch.Tensor for a in args):
                return unflatten(forward(pick(args)))
            return unflatten(forward(flat_inputs(args, kwargs, what)))
        return call

    def direct(self, plan: DirectPlan, slow):
        """The model's positional call straight into the one engine of plan (blade/direct.py): a
        function of the args tuple that picks the inputs, runs the engine and builds a single
        tensor or a tuple of tensors all in C++; any other call (or non-tensor args) goes through
        slow (bind's call). None when the structures need pytree (keywords, constants, nested outputs)."""
        if self._positional is None:
            return None
        result = _direct_result(self.out_spec, plan)
        if result is None:
            return None
        return plan.call(order=[self.graph_inputs[i] for i in plan.order], arity=self._positional,
                         result=result, fallback=lambda args: slow(args, {}))


def _direct_result(spec: pytree.TreeSpec | None, plan: DirectPlan) -> str | None:
    """engine_call's result form that equals _unflattener(spec) of the plan's results, or None."""
    if spec is None:
        return plan.result
    if spec.is_leaf():
        return "single" if len(plan.picks) == 1 else None
    if spec.type is tuple and all(child.is_leaf() for child in spec.children()):
        return "tuple"
    return None


def _unflattener(spec: pytree.TreeSpec | None):
    """flat outputs (a list or tuple; a bare tensor for one) -> the structure of spec."""
    if spec is None:
        return lambda flat: flat
    if spec.is_leaf():
        return lambda flat: flat[0] if isinstance(flat, (tuple, list)) else flat
    if spec.type is tuple and all(child.is_leaf() for child in spec.children()):
        return lambda flat: tuple(flat) if isinstance(flat, (tuple, list)) else (flat,)
    return lambda flat: pytree.tree_unflatten(list(flat) if isinstance(flat, (tuple, list)) else [flat], spec)


def _jsonable(value):
    """A non-tensor input as JSON keeps it (ints, floats, bools, None, strings); anything else by
    repr, which is enough to notice a different value."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def _short(spec: pytree.TreeSpec) -> str:
    return " ".join(str(spec).split())


def _load_spec(text: str, what: str) -> pytree.TreeSpec:
    """treespec_loads, importing the module of a container type this process has not registered
    yet (transformers registers its ModelOutput classes when their module is imported)."""
    for _attempt in range(8):  # one import per missing type; a spec names only a few
        try:
            return pytree.treespec_loads(text)
        except (KeyError, NotImplementedError) as err:
            missing = _missing_type(text)
            if missing is None or not _import_owner(missing):
                raise ValueError(f"{what}: cannot rebuild the structure of its inputs/outputs: {err}") from err
    raise ValueError(f"{what}: cannot rebuild the structure of its inputs/outputs")


def _missing_type(text: str) -> str | None:
    names = set()

    def walk(node):
        if node.get("type"):
            names.add(node["type"])
        for child in node.get("children_spec", []):
            walk(child)
    walk(json.loads(text)[1])
    return next((n for n in sorted(names) if n not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE), None)


def _import_owner(type_name: str) -> bool:
    """Imports the longest importable module prefix of a serialized type name; True when that
    registered the type."""
    parts = type_name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            importlib.import_module(".".join(parts[:cut]))
            break
        except ImportError:
            continue
    return type_name in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE


def _scripted_call(scripted):
    """flat inputs -> scripted(*flat), with the size dispatcher's range errors raised as
    RuntimeError (blade/size_variants.py). (scripted, not the ExportedModule: the closure would
    hold it.) The graph executor does not optimize it (blade/executor.py)."""
    scripted = unoptimized(scripted)

    def call(flat):
        try:
            return scripted(*flat)
        except torch.jit.Error as err:
            translated = size_error(err)
            if translated is None:
                raise
            raise translated from err
    return call


class ExportedModule:
    """A loaded blade archive called like the model: ``m(*args, **kwargs)`` returns the model's
    output structure. ``m.script`` is the archive's TorchScript module (flat tensors in, flat tuple
    out); its attributes (``named_buffers``, ``code``, ``graph`` ...) are reachable on ``m`` too."""

    def __init__(self, script: torch.jit.ScriptModule, signature: Signature | None, what: str):
        self.script, self.signature, self._what = script, signature, what
        # forward called directly: a ScriptModule runs no Python hooks, and nn.Module.__call__'s
        # hook machinery costs ~1 us per call
        self._forward = unoptimized(script.forward)  # blade/executor.py
        # A forward that is one engine call: the engine called without TorchScript (blade/direct.py),
        # taking the flat inputs as one sequence
        plan = direct_plan(script) if signature is not None else None
        self._direct = plan.call() if plan is not None else None
        self._fast = None  # the positional call of plain tensors (Signature.direct)
        if signature is not None:
            self._call = signature.bind(self._direct or _scripted_call(script.forward), what)
            self._fast = signature.direct(plan, self._call) if plan is not None else None

    def __call__(self, *args, **kwargs):
        if self._fast is not None and not kwargs:
            return self._fast(args)
        if self.signature is None:  # an archive without a signature: the flat module as saved
            return self._forward(*args, **kwargs)
        return self._call(args, kwargs)

    def __getattr__(self, name):
        return getattr(self.__dict__["script"], name)
