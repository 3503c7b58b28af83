"""The direct call of a loaded archive whose forward is exactly one engine call.

A model that compiles to a single engine (one op, or a fully fused block) is saved as

    graph(%self, %x, %y):
      %engine = prim::GetAttr[name="cluster_0"](%self)
      %in = prim::ListConstruct(%x, %y)
      %out = prim::CallMethod[name="execute"](%engine, %in)
      %a, %b = prim::ListUnpack(%out)
      %res = prim::ListConstruct(%a, %b)       (torch.compile's graphs: prim::TupleConstruct)
      return (%res)

Calling that forward from Python costs ~1.7 us per call beyond the engine (pybind into TorchScript,
the interpreter, the custom class's boxed call): as much as eager's whole call of a small op.
``direct_call`` recognizes exactly this graph and returns a function of the forward's flat inputs
that calls the Engine's ``execute`` through ``blade._C.engine_call``: the same inputs, checks,
fallback modes and outputs, without the interpreter; the inputs' reordering and the results'
container are done in C++ too (cpp/python_engine_call.cpp). Any other graph: None (the forward is
used).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import blade._C as _C

_KINDS = ["prim::GetAttr", "prim::ListConstruct", "prim::CallMethod", "prim::ListUnpack"]
# the forward's result: a list (blade.export's graphs) or a tuple (torch.compile's); the names are
# blade._C.engine_call's
_RESULTS = {"prim::ListConstruct": "list", "prim::TupleConstruct": "tuple"}


@dataclass(frozen=True)
class DirectPlan:
    """A forward that is one engine call: engine (the torch.classes.blade.Engine), arity (the
    forward's tensor inputs), order (the forward input of each engine input), picks (the engine
    output of each forward result), result ("list" or "tuple")."""
    engine: object
    arity: int
    order: list
    picks: list
    result: str

    def call(self, order=None, arity=None, result=None, fallback=None):
        """blade._C.engine_call of this engine: a function of a tuple or list of inputs (by
        default the forward's; order/arity re-map them) returning the forward's results (or one
        tensor for result="single"); inputs that are not `arity` tensors go to fallback(inputs)."""
        return _C.engine_call(self.engine, self.arity if arity is None else arity,
                              self.order if order is None else order, self.picks,
                              result or self.result, fallback)


def direct_plan(script: torch.jit.ScriptModule) -> DirectPlan | None:
    """The DirectPlan of a forward that is exactly one engine call on its tensor inputs, else None."""
    graph = script.forward.graph
    nodes = list(graph.nodes())
    if [n.kind() for n in nodes[:-1]] != _KINDS or len(nodes) != 5 or nodes[-1].kind() not in _RESULTS:
        return None
    get_engine, pack, call, unpack, repack = nodes
    ids = lambda values: [v.unique() for v in values]  # noqa: E731 - Values compare by their unique id
    params = ids(graph.inputs())
    ok = (ids(get_engine.inputs()) == params[:1] and call.s("name") == "execute"
          and ids(call.inputs()) == ids([get_engine.output(), pack.output()])
          and ids(unpack.inputs()) == ids([call.output()])
          and ids(graph.outputs()) == ids([repack.output()])
          and str(get_engine.output().type()) == "__torch__.torch.classes.blade.Engine"
          and all(isinstance(p.type(), torch._C.TensorType) for p in list(graph.inputs())[1:]))
    if not ok:
        return None
    inputs, results = params[1:], ids(unpack.outputs())
    if not set(ids(pack.inputs())) <= set(inputs) or not set(ids(repack.inputs())) <= set(results):
        return None  # an engine input that is not a forward input, or a result from elsewhere
    return DirectPlan(getattr(script, get_engine.s("name")), len(inputs),
                      [inputs.index(v) for v in ids(pack.inputs())],
                      [results.index(v) for v in ids(repack.inputs())], _RESULTS[repack.kind()])


def direct_call(script: torch.jit.ScriptModule):
    """A function of the forward's inputs (a tuple or list of tensors) returning its results (a
    list, or a tuple for torch.compile's graphs), or None when the forward is anything but one
    engine call on its tensor inputs."""
    plan = direct_plan(script)
    return plan.call() if plan is not None else None
