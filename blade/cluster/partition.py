"""Partition a typed TorchScript graph into clusters of supported nodes. Pure: no compiling.

The top-level block is a DAG of "ops" (every node but constants). Supported ops are merged
greedily along data edges, consumer by consumer in topological order; a merge of clusters A and B
is refused when some path leaves A, runs through a node outside A∪B and enters B (or the other
way): contracting such a pair would create a cycle. Reachability is kept as one Python-int bitset
per op, so a merge check costs a few big-int operations and thousands of nodes partition quickly.

Nodes that mutate memory (in-place ops, training-mode norms, side effects) are barriers:
unsupported, and ordered after every op before them and before every op after them, so no cluster
straddles them. Nodes through which storage is observable (views of written tensors, values
as_strided reads, views returned as aliases of inputs) stay out too (cluster/aliasing.py).
Nodes inside control flow blocks stay where they are (the block owner is unsupported).

Every op left out gets a reason (shown by reports).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blade.cluster.aliasing import has_side_effects, storage_bound_nodes
from blade.cluster.rules.base import is_constant, is_tensor
from blade.cluster.support import can_lower

# Tensor[] glue and pure aliases, and the sizes ops read (frontend._sizes_per_use makes one per
# op): they do not count toward a cluster's size nor as ops in coverage.
GLUE_KINDS = {"prim::ListConstruct", "prim::ListUnpack", "aten::__getitem__", "aten::size"}


@dataclass
class Cluster:
    index: int
    nodes: list            # torch.Node, in graph order
    inputs: list = field(default_factory=list)   # tensor values defined outside, used inside
    outputs: list = field(default_factory=list)  # values defined inside, used outside

    @property
    def op_count(self) -> int:
        return sum(1 for n in self.nodes if n.kind() not in GLUE_KINDS)


@dataclass
class Partition:
    ops: list              # every op of the top-level block, in graph order
    clusters: list         # Cluster
    reasons: dict          # op -> why it stays in TorchScript

    def cluster_of(self) -> dict:
        return {node: c for c in self.clusters for node in c.nodes}


def _is_op(node: torch.Node) -> bool:
    if node.kind() == "prim::Constant":
        return False
    # lists of constants are arguments, not ops
    return not (node.kind() == "prim::ListConstruct" and is_constant(node.output()))


def _is_op_or_input(node: torch.Node) -> bool:
    return node.kind() == "prim::Param" or _is_op(node)


def used_values(node: torch.Node):
    """Values a node reads, including those read inside its sub-blocks."""
    yield from node.inputs()
    for block in node.blocks():
        for inner in block.nodes():
            yield from used_values(inner)
        yield from block.returnNode().inputs()


class _Dag:
    """The ops as indices 0..n-1 with data and ordering edges and descendant bitsets."""

    def __init__(self, ops: list):
        self.index = {node: i for i, node in enumerate(ops)}
        n = len(ops)
        self.preds = [set() for _ in range(n)]
        self.succs = [set() for _ in range(n)]
        for i, node in enumerate(ops):
            for value in used_values(node):
                producer = self.index.get(value.node())
                if producer is not None and producer != i:
                    self._edge(producer, i)
        barriers = [i for i, node in enumerate(ops) if has_side_effects(node)]
        bounds = [-1] + barriers + [n]
        for k, barrier in enumerate(barriers):  # order every op around each barrier
            for i in range(bounds[k] + 1, barrier):
                self._edge(i, barrier)
            for i in range(barrier + 1, bounds[k + 2]):
                self._edge(barrier, i)
        self.reach = [0] * n  # bit j set: j is a descendant of i
        for i in reversed(range(n)):
            bits = 0
            for s in self.succs[i]:
                bits |= (1 << s) | self.reach[s]
            self.reach[i] = bits

    def _edge(self, a: int, b: int) -> None:
        self.succs[a].add(b)
        self.preds[b].add(a)


class _Clusters:
    """Union-find over ops with per-cluster member bitsets and direct-successor bitsets."""

    def __init__(self, dag: _Dag):
        self.dag = dag
        n = len(dag.succs)
        self.parent = list(range(n))
        self.members = [1 << i for i in range(n)]
        self.succ_bits = [sum(1 << s for s in dag.succs[i]) for i in range(n)]

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def _leaves_and_enters(self, a: int, b: int) -> bool:
        """A path from cluster a through some node outside a∪b into cluster b?"""
        outside = self.succ_bits[a] & ~(self.members[a] | self.members[b])
        target = self.members[b]
        while outside:
            low = outside & -outside
            node = low.bit_length() - 1
            if self.dag.reach[node] & target:
                return True
            outside ^= low
        return False

    def try_merge(self, x: int, y: int) -> bool:
        a, b = self.find(x), self.find(y)
        if a == b:
            return True
        if self._leaves_and_enters(a, b) or self._leaves_and_enters(b, a):
            return False
        self.parent[b] = a
        self.members[a] |= self.members[b]
        self.succ_bits[a] |= self.succ_bits[b]
        return True


def _boundary(nodes: list, graph: torch.Graph):
    inside = set(nodes)
    inputs, outputs, seen = [], [], set()
    for node in nodes:
        for value in node.inputs():
            producer = value.node()
            if producer not in inside and _is_op_or_input(producer) and value not in seen:
                seen.add(value)
                inputs.append(value)
    returned = set(graph.return_node().inputs())
    for node in nodes:
        for value in node.outputs():
            if value in returned or any(use.user not in inside for use in value.uses()):
                outputs.append(value)
    return inputs, outputs


def _bad_boundary_nodes(cluster: Cluster) -> list:
    """Nodes whose non-tensor values (Tensor[]) would cross the cluster boundary."""
    bad = [v.node() for v in cluster.outputs if not is_tensor(v)]
    for value in cluster.inputs:
        if not is_tensor(value):
            bad.extend(use.user for use in value.uses() if use.user in set(cluster.nodes))
    return bad


def partition(graph: torch.Graph, *, min_cluster_size: int = 2, excluded_ops=(), excluded_nodes=None) -> Partition:
    """``excluded_nodes``: node -> the reason it stays in TorchScript (decided by the caller)."""
    ops = [node for node in graph.nodes() if _is_op(node)]
    reasons: dict = {}
    storage_bound = storage_bound_nodes(graph, ops)
    for node in ops:
        if list(node.blocks()):
            reasons[node] = f"control flow ({node.kind()}) stays in TorchScript"
        elif has_side_effects(node):
            reasons[node] = "mutates memory (writes a tensor in place, or a side effect): runs once per call"
        elif node in storage_bound:
            reasons[node] = storage_bound[node]
        elif excluded_nodes and node in excluded_nodes:
            reasons[node] = excluded_nodes[node]
        else:
            ok, reason = can_lower(node, excluded_ops)
            if not ok:
                reasons[node] = reason
    dag = _Dag(ops)
    while True:  # refine until no cluster has a non-tensor boundary
        clusters = _form_clusters(ops, dag, reasons, graph)
        bad = [node for c in clusters for node in _bad_boundary_nodes(c)]
        if not bad:
            break
        for node in bad:
            reasons[node] = "its Tensor[] value would cross a cluster boundary"
    kept = []
    for cluster in clusters:
        if cluster.op_count < min_cluster_size:
            for node in cluster.nodes:
                reasons[node] = f"in a cluster of {cluster.op_count} op(s), below min_cluster_size={min_cluster_size}"
        else:
            cluster.index = len(kept)
            kept.append(cluster)
    return Partition(ops, kept, reasons)


def _form_clusters(ops, dag: _Dag, reasons: dict, graph) -> list:
    supported = [node not in reasons for node in ops]
    sets = _Clusters(dag)
    for i in range(len(ops)):
        if supported[i]:
            for p in sorted(dag.preds[i]):
                if supported[p] and _data_edge(ops[p], ops[i]):
                    sets.try_merge(p, i)
    groups: dict = {}
    for i, node in enumerate(ops):
        if supported[i]:
            groups.setdefault(sets.find(i), []).append(node)
    clusters = []
    for nodes in groups.values():
        inputs, outputs = _boundary(nodes, graph)
        clusters.append(Cluster(len(clusters), nodes, inputs, outputs))
    return clusters


def _data_edge(producer: torch.Node, consumer: torch.Node) -> bool:
    outputs = set(producer.outputs())
    return any(v in outputs for v in consumer.inputs())
