"""Who writes memory and which values share it, in a TorchScript graph: read from torch's op
schemas (their alias annotations, ``Tensor(a!)`` written, ``Tensor(a) -> Tensor(a)`` a view).

Engines have value semantics: they read their inputs and return fresh, contiguous outputs. So a
node must stay in TorchScript when storage is observable through it:
  - it writes memory (an in-place op; batch/instance norm updating running statistics) — it must
    run exactly once per call, on the caller's tensor;
  - it is a view of a tensor that is written in place (the write goes through the view);
  - it produces, or is a view chain to, a value a storage-sensitive op reads (``as_strided`` reads
    the storage under a view, not the view's logical layout);
  - it is a view chain from a graph input (or module state, or another output) to a graph output,
    which eager returns as an alias of that input.
"""
from __future__ import annotations

import functools

import torch

# Ops with side effects beyond their tensor arguments: nothing may be reordered across them.
SIDE_EFFECT_KINDS = {"prim::Print", "prim::RaiseException", "prim::SetAttr", "aten::warn",
                     "prim::CallMethod", "prim::CallFunction", "prim::Enter", "prim::Exit"}

# Ops whose schema does not say that they write: batch_norm / instance_norm update their running
# statistics in place unless the flag at this argument is constant False (torch's own alias
# analysis special-cases the same two ops: analyzeBatchNorm / analyzeInstanceNorm).
# kind -> (index of the training / use_input_stats flag, indices of the arguments written)
TRAINING_WRITES = {
    "aten::batch_norm": (5, (3, 4)),
    "aten::instance_norm": (5, (3, 4)),
}

# Ops that read a tensor's storage or strides rather than its values.
STORAGE_SENSITIVE_KINDS = {"aten::as_strided", "aten::as_strided_", "aten::set_", "aten::stride",
                           "aten::is_contiguous", "aten::storage_offset", "aten::data_ptr",
                           "aten::as_strided_scatter"}

# prim ops whose outputs are elements of their (list or tuple) input.
UNPACKING_KINDS = {"prim::ListUnpack", "prim::TupleUnpack", "prim::TupleIndex"}


@functools.lru_cache(maxsize=None)
def _parsed(schema: str):
    return torch._C.parse_schema(schema)


def _schema(node: torch.Node):
    schema = node.schema()
    return None if schema == "(no schema)" else _parsed(schema)


def _constant_false(value: torch.Value) -> bool:
    return value.node().kind() == "prim::Constant" and value.toIValue() is False


def _constant_none(value: torch.Value) -> bool:
    return value.node().kind() == "prim::Constant" and value.toIValue() is None


def written_inputs(node: torch.Node) -> list:
    """The input values the node writes in place."""
    inputs = list(node.inputs())
    training = TRAINING_WRITES.get(node.kind())
    if training is not None:
        flag, written = training
        if _constant_false(inputs[flag]):
            return []
        return [inputs[i] for i in written if not _constant_none(inputs[i])]
    schema = _schema(node)
    if schema is None:
        return []
    return [value for value, arg in zip(inputs, schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write]


def has_side_effects(node: torch.Node) -> bool:
    """Writes memory or has other side effects: nothing may be reordered across it."""
    return node.kind() in SIDE_EFFECT_KINDS or bool(written_inputs(node))


# Conversions whose schema says "may return self" (Tensor(a) -> Tensor(a)): they do only when
# nothing changes. With the static dtypes the frontend measured, a dtype change (or copy=True)
# means a fresh tensor.
CONVERSION_KINDS = {"aten::to", "aten::type_as"}


# Ops whose schema promises a new tensor but which return their input itself in some cases:
# dropout when not training (or p == 0), to_dense of a dense tensor.
RETURNS_ITS_INPUT = {"aten::dropout", "aten::feature_dropout", "aten::alpha_dropout",
                     "aten::feature_alpha_dropout", "aten::to_dense"}


def _makes_fresh_tensor(node: torch.Node) -> bool:
    """A conversion that provably returns a new tensor: its dtype changes, or it was asked to copy."""
    source, result = node.inputsAt(0).type(), node.output().type()
    if isinstance(source, torch.TensorType) and isinstance(result, torch.TensorType) and \
            None not in (source.dtype(), result.dtype()) and source.dtype() != result.dtype():
        return True
    schema = _schema(node)
    return schema is not None and any(
        arg.name == "copy" and value.node().kind() == "prim::Constant" and value.toIValue() is True
        for arg, value in zip(schema.arguments, node.inputs()))


def aliased_inputs(node: torch.Node) -> list:
    """The inputs the node's outputs may share storage with (a view, an in-place op's result, an
    element taken out of a list)."""
    inputs = list(node.inputs())
    if node.kind() in UNPACKING_KINDS:
        return inputs
    if node.kind() in CONVERSION_KINDS:  # (type_as's schema does not say it, but it returns self too)
        return [] if _makes_fresh_tensor(node) else inputs[:1]
    if node.kind() in RETURNS_ITS_INPUT:
        return inputs[:1]
    if list(node.blocks()):  # control flow returns whatever its blocks return: assume any of it
        return inputs + [v for block in node.blocks() for v in block.returnNode().inputs()]
    schema = _schema(node)
    if schema is None:
        return []
    returned = set()
    wildcard = False
    for ret in schema.returns:
        if ret.alias_info is not None:
            returned |= set(ret.alias_info.before_set)
            wildcard |= "*" in ret.alias_info.before_set
    aliased = []
    for value, arg in zip(inputs, schema.arguments):
        info = arg.alias_info
        if info is None:
            continue
        # a shared alias set, or an argument flowing into a list's elements ("a -> *") / an
        # element taken out of an aliased list ("-> t(*)")
        if returned & set(info.before_set) or "*" in info.after_set or wildcard:
            aliased.append(value)
    return aliased


class AliasSets:
    """Union-find over the values of a block: values that may share storage are in one set."""

    def __init__(self, nodes):
        self.parent: dict = {}
        for node in nodes:
            for source in aliased_inputs(node):
                for output in node.outputs():
                    self.union(output, source)
                if source.node().kind() == "prim::ListConstruct":  # the elements of that list
                    for element in source.node().inputs():
                        self.union(source, element)

    def find(self, value):
        root = value
        while self.parent.get(root, root) is not root:
            root = self.parent[root]
        while value is not root:  # path compression
            self.parent[value], value = root, self.parent[value]
        return root

    def union(self, a, b) -> None:
        self.parent.setdefault(a, a)  # every value in some set is a key: members() lists them
        self.parent.setdefault(b, b)
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[ra] = rb

    def members(self, values) -> set:
        """Every value in the sets of these values."""
        roots = {self.find(v) for v in values}
        return {v for v in self.parent if self.find(v) in roots} | set(values)


def _graph_outputs(graph: torch.Graph) -> list:
    """The values the graph returns, through the tuple it packs them in."""
    outputs = []
    for value in graph.return_node().inputs():
        producer = value.node()
        outputs += list(producer.inputs()) if producer.kind() == "prim::TupleConstruct" else [value]
    return outputs


def _is_state(value: torch.Value) -> bool:
    return value.node().kind() in ("prim::Param", "prim::GetAttr")


def _returned_aliases(sets: AliasSets, outputs: list) -> list:
    """Graph outputs whose storage the caller can see shared: with a graph input or module state
    (a view of an input, returned), or with another output (dynamo returns a view and its base
    when it breaks the graph at an ``out=`` write through that view)."""
    returned: dict = {}
    for value in dict.fromkeys(outputs):
        returned.setdefault(sets.find(value), []).append(value)
    state_sets = {sets.find(v) for v in sets.parent if _is_state(v)}
    return [v for root, values in returned.items() if len(values) > 1 or root in state_sets for v in values]


def storage_bound_nodes(graph: torch.Graph, ops: list) -> dict:
    """Nodes that must stay in TorchScript because storage is observable through them, each with
    its reason (see the module docstring). Writers themselves are not listed: they are barriers."""
    sets = AliasSets(ops)
    produced_by = {v: node for node in ops for v in node.outputs()}
    is_view = {node: bool(aliased_inputs(node)) for node in ops}
    reasons: dict = {}

    def mark(values, reason, views_only):
        for value in values:
            node = produced_by.get(value)
            if node is not None and node not in reasons and (is_view[node] or not views_only):
                reasons[node] = reason

    written = [v for node in ops for v in written_inputs(node)]
    mark(sets.members(written), "a view of a tensor that is written in place", views_only=True)
    read_raw = [v for node in ops if node.kind() in STORAGE_SENSITIVE_KINDS for v in list(node.inputs())[:1]]
    mark(sets.members(read_raw), "its storage is read by as_strided or a stride query", views_only=False)
    mark(sets.members(_returned_aliases(sets, _graph_outputs(graph))),
         "an output that aliases a graph input, module state or another output", views_only=True)
    return reasons


def _written_values(graph: torch.Graph) -> set:
    """Every value of the top-level block that the graph writes, directly or through a view."""
    nodes = list(graph.nodes())
    return AliasSets(nodes).members([v for node in nodes for v in written_inputs(node)])


def written_attributes(graph: torch.Graph) -> set:
    """Names of the module attributes (read with prim::GetAttr on the graph's self) the graph
    writes. Inline the graph first so calls do not hide their writes."""
    self_value = next(iter(graph.inputs()), None)
    return {v.node().s("name") for v in _written_values(graph)
            if v.node().kind() == "prim::GetAttr" and v.node().inputsAt(0) is self_value}


def written_constants(graph: torch.Graph) -> list:
    """Constants the graph writes: state that freezing folded although it is written (e.g. a
    nested module's running statistics), which every call and every run of the compiler would
    then write, shared."""
    return [v for v in _written_values(graph) if v.node().kind() == "prim::Constant"]


IDENTITY_TESTS = {"aten::__is__": True, "aten::__isnot__": False}


def fold_identity_tests(graph: torch.Graph) -> int:
    """``a is b`` on tensors -> a constant where the graph decides it: True for one value, False
    for values that cannot share storage (different alias sets) unless both may be the caller's
    tensors (graph inputs or module state), which the caller could pass twice. F.multi_head_
    attention_forward asks ``query is key`` to choose how to project; left in TorchScript, the
    projections sat in its branches, out of engines. Returns how many tests were folded."""
    nodes = list(graph.nodes())
    sets = AliasSets(nodes)
    callers = {sets.find(v) for node in nodes for v in node.outputs() if _is_state(v)}
    callers |= {sets.find(v) for v in graph.inputs()}
    folded = 0
    for node in nodes:
        if node.kind() not in IDENTITY_TESTS or not all(isinstance(v.type(), torch.TensorType) for v in node.inputs()):
            continue
        a, b = node.inputs()
        if a is b:
            same = True
        elif sets.find(a) is not sets.find(b) and not {sets.find(a), sets.find(b)} <= callers and \
                all(_schema(v.node()) is not None or _is_state(v) for v in (a, b)):
            same = False
        else:
            continue
        with graph.insert_point_guard(node):
            node.output().replaceAllUsesWith(graph.insertConstant(same == IDENTITY_TESTS[node.kind()]))
        node.destroy()
        folded += 1
    return folded
