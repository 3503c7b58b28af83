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
fallback modes and outputs, without the interpreter. Any other graph: None (the forward is used).
"""
from __future__ import annotations

import torch

import blade._C as _C

_KINDS = ["prim::GetAttr", "prim::ListConstruct", "prim::CallMethod", "prim::ListUnpack"]
# the forward's result: a list (blade.export's graphs) or a tuple (torch.compile's)
_RESULTS = {"prim::ListConstruct": None, "prim::TupleConstruct": tuple}


def direct_call(script: torch.jit.ScriptModule):
    """A function of the forward's inputs (a sequence of tensors) returning its output list, or
    None when the forward is anything but one engine call on its tensor inputs."""
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
    order = [inputs.index(v) for v in ids(pack.inputs())]
    picks = [results.index(v) for v in ids(repack.inputs())]
    engine = _C.engine_call(getattr(script, get_engine.s("name")))
    n, container = len(inputs), _RESULTS[repack.kind()]
    if order == list(range(n)) and picks == list(range(len(results))):
        # the forward's inputs are the engine's: Engine::execute checks their count
        return engine if container is None else (lambda flat: container(engine(flat)))
    return _reordered(engine, n, order, picks, container or list)


def _reordered(engine, n: int, order: list, picks: list, container):
    def call(inputs):
        if len(inputs) != n or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise RuntimeError(f"forward() expected {n} tensors, got {[type(t).__name__ for t in inputs]}")
        results = engine([inputs[i] for i in order])
        return container([results[i] for i in picks])
    return call
