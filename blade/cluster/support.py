"""The one lowering table (DESIGN.md contract 4): aten op -> ONNX nodes, with its conditions.

A TorchScript node is clusterable exactly when ``LOWERING`` has a rule for its kind, the generic
conditions hold (static shapes, supported dtypes, CPU, constant non-tensor arguments) and the rule's
own check passes. The partitioner asks ``can_lower``; there is no second list.

The rules live by op family in ``blade/cluster/rules/`` (elementwise, reductions, linalg, conv,
shapes, indexing, creation), each module ending in its ``RULES`` table with every rule next to its
check; ``base`` holds what they share (the lowering context, value helpers, ``Rule``). Adding an
op is one entry in its family's ``RULES`` (plus engine support for any new ONNX op it emits) and
one line in the op test table.

A rule's ``lower(ctx, node)`` returns, per node output, the ONNX name of that output (or a Python
list of names for a ``Tensor[]`` output). Type promotion is never re-derived here: every value
carries its exact dtype (measured by the frontend), so operands are cast to the dtype torch
computed in, then the ONNX op runs on uniform types.
"""
from __future__ import annotations

from typing import Optional

import torch

from blade.cluster.rules import conv, creation, elementwise, indexing, linalg, reductions, shapes
from blade.cluster.rules.base import Rule, is_constant, is_size_arithmetic, is_size_value, is_tensor, is_tensor_list, \
    tensor_info
from blade.cluster.rules.shapes import SIZE_ARITHMETIC

FAMILIES = (elementwise, reductions, conv, linalg, shapes, indexing, creation)

# Kinds the frontend never hands the partitioner have no rule (tests/e2e/test_frontend.py checks
# each): TorchScript normalizes aten::true_divide to div and aten::concat to cat; freezing drops
# eval-mode aten::dropout / feature_dropout (training mode was refused anyway);
# constant propagation folds creation ops without tensor arguments (aten::zeros, ones, full,
# arange) into constants: their rules are for run-time sizes.
LOWERING: dict[str, Rule] = {kind: rule for family in FAMILIES for kind, rule in family.RULES.items()}
assert len(LOWERING) == sum(len(family.RULES) for family in FAMILIES), "an op with rules in two families"


def rule_for(node: torch.Node) -> Optional[Rule]:
    """The node's rule: SIZE_ARITHMETIC for int arithmetic on sizes, else LOWERING's."""
    return SIZE_ARITHMETIC[node.kind()] if is_size_arithmetic(node) else LOWERING.get(node.kind())


# Node kinds that are never "ops" (they are absorbed into whatever uses them).
IGNORED_KINDS = {"prim::Constant"}


# ---------------------------------------------------------------------------------------------
# The question the partitioner asks
# ---------------------------------------------------------------------------------------------

def can_lower(node: torch.Node, excluded_ops=()) -> tuple[bool, str]:
    """(True, "") if the engine can take this node, else (False, reason)."""
    kind = node.kind()
    if kind in excluded_ops:
        return False, "excluded by config (excluded_ops)"
    rule = rule_for(node)
    if rule is None:
        return False, f"unsupported op {kind}"
    if kind == "prim::ListConstruct" and not is_tensor_list(node.output()) and not is_size_value(node.output()):
        return False, "a list of non-tensors (folded into its users as a constant)"
    for value in list(node.inputs()) + list(node.outputs()):
        if is_tensor(value):
            if tensor_info(value) is None:
                return False, f"%{value.debugName()} has no static shape, an unsupported dtype " \
                              f"({value.type().dtype()}) or is not on the CPU"
        elif is_tensor_list(value):
            if not rule.tensor_lists:
                return False, f"takes a Tensor[] argument %{value.debugName()}"
        elif value in set(node.inputs()) and not is_constant(value) and not (rule.size_args and is_size_value(value)):
            return False, f"argument %{value.debugName()} is not a compile-time constant"
    if rule.check is not None:
        reason = rule.check(node)
        if reason:
            return False, reason
    return True, ""
