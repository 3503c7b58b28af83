"""Splice a compiled cluster back into the graph as an engine call (TorchScript-specific).

    %e   : __torch__.torch.classes.blade.Engine = prim::GetAttr[name="cluster_0"](%self)
    %in  : Tensor[] = prim::ListConstruct(%x, %y)
    %out : Tensor[] = prim::CallMethod[name="execute"](%e, %in)
    %a, %b = prim::ListUnpack(%out)

The engine becomes an attribute of the module, so torch.jit.save stores it (with its .so bytes).
"""
from __future__ import annotations

import torch

from blade.cluster.partition import Cluster, used_values


def _hoist_dependents(cluster: Cluster) -> torch.Node:
    """Move the outside nodes that sit between the cluster's nodes and depend on its results to
    after its last node, so that one call placed there sees every input and precedes every use.
    (The partition guarantees no outside node both feeds and depends on the cluster.)"""
    members = set(cluster.nodes)
    first, last = cluster.nodes[0], cluster.nodes[-1]
    block_nodes = list(first.owningBlock().nodes())
    span = block_nodes[block_nodes.index(first):block_nodes.index(last)]
    tainted = {v for n in cluster.nodes for v in n.outputs()}
    anchor = last
    for node in span:
        if node not in members and any(v in tainted for v in used_values(node)):
            tainted.update(node.outputs())
            node.moveAfter(anchor)
            anchor = node
    return last


def splice(module: torch.jit.ScriptModule, cluster: Cluster, engine, attr_name: str,
           replaced: dict) -> None:
    """Replace the cluster's nodes by a call of `engine`. `replaced` maps values of clusters
    spliced earlier (now destroyed) to the engine outputs that stand for them; it is updated."""
    graph = module.graph
    module._c._register_attribute(attr_name, engine._type(), engine)
    last = _hoist_dependents(cluster)
    self_value = next(graph.inputs())
    tensor_list = torch._C.ListType.ofTensors()

    get_engine = graph.create("prim::GetAttr", [self_value])
    get_engine.s_("name", attr_name)
    get_engine.output().setType(engine._type())
    pack = graph.create("prim::ListConstruct", [replaced.get(v, v) for v in cluster.inputs])
    pack.output().setType(tensor_list)
    call = graph.create("prim::CallMethod", [get_engine.output(), pack.output()])
    call.s_("name", "execute")
    call.output().setType(tensor_list)
    unpack = graph.create("prim::ListUnpack", [call.output()], len(cluster.outputs))

    get_engine.insertAfter(last)
    pack.insertAfter(get_engine)
    call.insertAfter(pack)
    unpack.insertAfter(call)
    for original, replacement in zip(cluster.outputs, unpack.outputs()):
        replacement.setType(original.type())
        original.replaceAllUsesWith(replacement)
        replaced[original] = replacement
    for node in reversed(cluster.nodes):
        node.destroy()
