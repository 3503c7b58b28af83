"""A cluster's TorchScript subgraph as a standalone function: the Engine's debugging fallback.

    forward(self, inputs: List[Tensor]) -> List[Tensor]     (cluster.inputs -> cluster.outputs)

It is built from the cluster's nodes before splicing destroys them, saved with torch.jit's own
format (a module whose forward is that function), and loaded by the Engine in C++ with
torch::jit::load, so it runs in a libtorch-only process too. TorchScript-specific, like splice.py.
"""
from __future__ import annotations

import torch

from blade.cluster.partition import Cluster


def subgraph(cluster: Cluster) -> torch.Graph:
    """A new graph computing the cluster: unpack the input list, clone the nodes (and the
    constants they read), pack the outputs into a list."""
    graph = torch._C.Graph()
    tensor_list = torch._C.ListType.ofTensors()
    packed = graph.addInput("inputs")
    packed.setType(tensor_list)
    unpack = graph.appendNode(graph.create("prim::ListUnpack", [packed], len(cluster.inputs)))
    copies = dict(zip(cluster.inputs, unpack.outputs()))
    for original, copy in copies.items():
        copy.setType(original.type())

    def copy_of(value):
        """The copy of a value; values from outside the cluster that are not inputs are constants
        (or lists of constants): clone their producers on first use."""
        if value not in copies:
            producer = value.node()
            for argument in producer.inputs():
                copy_of(argument)
            clone = graph.appendNode(graph.createClone(producer, copy_of))
            copies.update(zip(producer.outputs(), clone.outputs()))
        return copies[value]

    for node in cluster.nodes:
        for value in node.inputs():
            copy_of(value)
        clone = graph.appendNode(graph.createClone(node, copy_of))
        copies.update(zip(node.outputs(), clone.outputs()))
    pack = graph.appendNode(graph.create("prim::ListConstruct", [copies[v] for v in cluster.outputs]))
    pack.output().setType(tensor_list)
    graph.registerOutput(pack.output())
    return graph


def saved_subgraph(graph: torch.Graph) -> bytes:
    """The graph as a torch.jit.save'd module (what the Engine's fallback_module holds)."""
    function = torch._C._create_function_from_graph("forward", graph)
    return function.save_to_buffer()
