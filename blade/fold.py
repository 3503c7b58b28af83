"""Fold the parts of an FX graph that do not depend on its inputs into constants.

A model may rebuild a tensor from constants on every call: BEiT's relative-position index is made
with ``torch.zeros`` and filled by slice assignments, then gathers its bias table (a parameter).
TorchScript's freezing folds pure ops over constants, but not writes into a tensor, so such a
region stayed in TorchScript (the writes are memory barriers to the partitioner) and ran on every
call: BEiT kept 48% of its aten ops out of engines. Here the region runs once, at compile time,
and each value the rest of the graph reads from it becomes a constant (as it is at that read: a
later write in the region does not change what an earlier reader saw).

Constant: a frozen weight (get_attr), or a call whose tensor arguments are all constants and
which draws no random numbers. Only a region that writes is folded here (TorchScript's freezing
folds the others, as before). Not folded at all (the graph is left as it is) when a write in the
region lands in a frozen weight (model state the caller sees), when an op outside the region
writes into a tensor the region made (its later readers would see input data), when the region
raises, or when the constants it would add pass FOLD_LIMIT_BYTES.
"""
from __future__ import annotations

import logging
import operator

import torch
import torch.fx

log = logging.getLogger("blade")

FOLD_LIMIT_BYTES = 32 << 20
FOLDED_PREFIX = "_blade_folded_"

# Tensor methods and functions whose result may share the memory of their first argument (a
# write through it lands in that argument): how a write outside the region is traced back to it
VIEW_NAMES = frozenset("""
    view view_as reshape reshape_as flatten unflatten squeeze unsqueeze transpose t T mT permute
    movedim moveaxis expand expand_as narrow select slice split chunk unbind tensor_split swapaxes
    swapdims diagonal as_strided detach alias unfold contiguous to type_as float double half int
    long bool real imag getitem __getitem__
""".split())


def fold_input_independent(module: torch.fx.GraphModule) -> int:
    """Fold module's input-independent region in place; returns how many nodes it removed."""
    graph = module.graph
    constant = _constant_nodes(graph)
    # a region without writes TorchScript's freezing folds already (constant propagation)
    if not any(_writes(n) for n in constant) or _written_from_outside(graph, constant):
        return 0
    try:
        with torch.no_grad():
            folded = _fold(module, constant)
    except _Unfoldable as reason:
        log.debug("blade: input-independent region not folded: %s", reason)
        return 0
    module.recompile()
    return folded


class _Unfoldable(Exception):
    pass


def _constant_nodes(graph: torch.fx.Graph) -> set:
    constant = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            constant.add(node)
        elif node.op in ("call_function", "call_method") and not _random(node) and \
                all(arg in constant for arg in node.all_input_nodes):
            constant.add(node)
    return constant


def _name(node: torch.fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


def _random(node: torch.fx.Node) -> bool:
    """Whether the op draws random numbers (aten's nondeterministic_seeded tag; dropout too)."""
    if isinstance(node.target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in node.target.tags
    name = _name(node).rstrip("_")
    packet = getattr(torch.ops.aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    return any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads())


# t[i] = v, t += v, ...: the Python operators that write into a tensor
WRITING_OPERATORS = frozenset({operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                               operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
                               operator.ixor, operator.ilshift, operator.irshift, operator.imatmul})


def _writes(node: torch.fx.Node) -> bool:
    """Whether the node writes into its first argument (or its out= argument)."""
    if node.target in WRITING_OPERATORS:
        return True
    if isinstance(node.target, torch._ops.OpOverload):  # torch.ops.aten.copy_.default
        return node.target._schema.is_mutable
    name = _name(node)
    return (name.endswith("_") and not name.startswith("__")) or node.kwargs.get("inplace") is True or \
        "out" in node.kwargs


def _written(node: torch.fx.Node):
    """The argument a writing node writes into."""
    return node.kwargs["out"] if "out" in node.kwargs else node.args[0] if node.args else None


def _storage(value):
    return value.untyped_storage().data_ptr() if isinstance(value, torch.Tensor) else None


def _written_from_outside(graph: torch.fx.Graph, constant: set) -> bool:
    """Whether a write outside the region may land in a tensor of the region: its target, traced
    back through views, is a constant."""
    for node in graph.nodes:
        if node in constant or node.op not in ("call_function", "call_method") or not _writes(node):
            continue
        target = _written(node)
        while isinstance(target, torch.fx.Node) and target not in constant and _name(target) in VIEW_NAMES \
                and target.args:
            target = target.args[0]
        if isinstance(target, torch.fx.Node) and target in constant:
            return True
    return False


def _fold(module: torch.fx.GraphModule, constant: set) -> int:
    """Run the region in graph order, taking at each node outside it a copy of every constant
    tensor it reads (one per value and version) and the value of every plain one; then rewrite
    the graph (only once every check has passed: a refusal leaves it as it was)."""
    values, weights = {}, set()
    snapshots, reads, added = {}, [], 0  # (region node, version) -> tensor; (reader, node, key or literal)
    for node in module.graph.nodes:
        if node in constant:
            if _writes(node) and _storage(values.get(_written(node))) in weights:  # (checked before it runs)
                raise _Unfoldable(f"{node.format_node()} writes a frozen weight")
            values[node] = _run(module, node, values)
            if node.op == "get_attr":
                weights.add(_storage(values[node]))
            continue
        for arg in [a for a in node.all_input_nodes if a in constant and a.op != "get_attr"]:
            value = values[arg]
            if _storage(value) in weights:
                continue  # a view of a weight (w.t()): freezing folds it without a copy of the weight
            if not isinstance(value, torch.Tensor):
                if not _plain(value):
                    raise _Unfoldable(f"{arg.format_node()} is read as a {type(value).__name__}")
                reads.append((node, arg, None, value))
                continue
            key = (arg, value._version)
            if key not in snapshots:
                added += value.numel() * value.element_size()
                if added > FOLD_LIMIT_BYTES:
                    raise _Unfoldable(f"its constants pass {FOLD_LIMIT_BYTES} bytes")
                snapshots[key] = value.detach().clone()
            reads.append((node, arg, key, None))
    graph, attrs = module.graph, {}
    for reader, arg, key, literal in reads:
        if key is None:
            reader.replace_input_with(arg, literal)
            continue
        if key not in attrs:
            name = f"{FOLDED_PREFIX}{len(attrs)}"
            module.register_buffer(name, snapshots[key])
            with graph.inserting_before(reader):
                attrs[key] = graph.get_attr(name)
            attrs[key].meta = dict(arg.meta)
        reader.replace_input_with(arg, attrs[key])
    removed = 0
    for node in reversed([n for n in graph.nodes if n in constant and n.op != "get_attr"]):
        if not node.users:
            graph.erase_node(node)
            removed += 1
    return removed


def _plain(value) -> bool:
    """A value a graph can hold as a literal argument (an int of a size, a dtype...)."""
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device))


def _run(module: torch.fx.GraphModule, node: torch.fx.Node, values: dict):
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: values[n])
    try:
        if node.op == "get_attr":
            value = module
            for part in node.target.split("."):
                value = getattr(value, part)
            return value
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return node.target(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - the region fails at compile time: leave it to run
        raise _Unfoldable(f"{node.format_node()} raised {type(err).__name__}: {err}") from err
