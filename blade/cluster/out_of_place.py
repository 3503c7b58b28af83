"""In-place writes to temporaries, rewritten out of place where no one can tell.

An in-place op is a barrier to clustering (aliasing.py): it must run once, on the memory it
writes. torch's RemoveMutation pass already rewrites one on a fresh value nothing else shares;
it leaves a write through a view alone. transformers writes through views of values it has just
computed (Funnel's relative attention: ``positional_attn = einsum(...).reshape(...)[:, :, shift:]
...; positional_attn *= cls_mask``). Such a write is not observable when its target is a view
chain of a tensor the graph made itself (no input, module state or constant shares it) and no
alias of that tensor other than the target is read after the write: then ``t.mul_(m)`` is
``t' = mul(t, m).type_as(t)`` (the in-place op keeps t's dtype), with every later read of t (or of
the write's result) reading t'.
"""
from __future__ import annotations

import torch

from blade.cluster.aliasing import SIDE_EFFECT_KINDS, TRAINING_WRITES, AliasSets, aliased_inputs, written_inputs

# A value made by one of these is shared with the caller or the model: never rewritten through.
_SHARED_KINDS = {"prim::Param", "prim::GetAttr", "prim::Constant"}


def rewrite_writes_to_temporaries(graph: torch.Graph) -> int:
    """Rewrites the top-level in-place ops of graph whose writes are not observable (see the module
    docstring); returns how many."""
    rewritten = 0
    nodes = list(graph.nodes())
    sets = AliasSets(nodes)
    # the last write first: in a chain (t *= m; t += 1) the earlier write's result is read by the
    # later write, an alias of it until that one is rewritten
    for node in reversed(nodes):
        if _rewrite(graph, node, sets):
            rewritten += 1
            sets = AliasSets(list(graph.nodes()))  # the rewrite made a fresh value: new alias sets
    return rewritten


def _functional_kind(node: torch.Node) -> str | None:
    """aten::mul_ -> aten::mul, aten::__iand__ -> aten::__and__; None for anything else."""
    kind = node.kind()
    if not kind.startswith("aten::") or kind in TRAINING_WRITES or kind in SIDE_EFFECT_KINDS:
        return None
    name = kind[len("aten::"):]
    if name.startswith("__i") and name.endswith("__"):
        return f"aten::__{name[3:]}"
    return kind[:-1] if name.endswith("_") and not name.startswith("_") else None


def _top_level(node: torch.Node, block) -> torch.Node:
    """The node of `block` that holds node (itself, or the control-flow node it is nested in)."""
    while node.owningBlock() is not block:
        node = node.owningBlock().owningNode()
    return node


def _rewrite(graph: torch.Graph, node: torch.Node, sets: AliasSets) -> bool:
    functional = _functional_kind(node)
    written = written_inputs(node)
    if functional is None or len(written) != 1 or written[0] is not node.inputsAt(0) or node.outputsSize() != 1:
        return False
    target, block = written[0], graph.block()
    aliases = sets.members([target, node.output()])
    if any(v.node().kind() in _SHARED_KINDS or v.node().owningBlock() is not block for v in aliases):
        return False
    # after the write, only the target and the write's result may be read (they become the new value)
    passed = False
    later = set()
    for other in block.nodes():
        if other is node:
            passed = True
        elif passed:
            later.add(other)
    def read_later(value) -> bool:
        return any(use.user is block.returnNode() or _top_level(use.user, block) in later for use in value.uses())

    for value in aliases:
        # a tuple or dict made earlier holding an alias (AliasSets follows lists only) and read later
        if any(read_later(out) for use in value.uses() if _top_level(use.user, block) not in later
               for out in use.user.outputs() if isinstance(out.type(), (torch.TupleType, torch.DictType))):
            return False
        if value is not target and value is not node.output() and read_later(value):
            return False
    replacement = graph.create(functional, list(node.inputs()), 1)
    replacement.insertBefore(node)
    replacement.copyMetadata(node)
    if replacement.schema() == "(no schema)" or aliased_inputs(replacement):
        replacement.destroy()
        return False
    replacement.output().setType(torch._C.TensorType.get())
    kept = graph.create("aten::type_as", [replacement.output(), target], 1)   # the in-place op keeps t's dtype
    kept.insertBefore(node)
    kept.copyMetadata(node)
    kept.output().setType(target.type())
    result = kept.output()
    for use in list(target.uses()):
        if use.user is not replacement and use.user is not kept and _top_level(use.user, block) in later:
            use.user.replaceInput(use.offset, result)
    node.output().replaceAllUsesWith(result)
    node.destroy()
    return True
