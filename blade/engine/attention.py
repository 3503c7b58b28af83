"""Fused attention: the plan's recognition of Q.K^T -> score steps -> Softmax -> P.V as one runtime call.

Unfused, an engine stores the [m, n] score matrix of every head (1 MB a head at 512 keys), reads it
back for the softmax rows, stores the probabilities and reads them again for P.V. The runtime's
BladeRuntime::attention (cpp/blade_abi.h) computes a block of query rows at a time with its score
rows in cache. It takes exactly the graph this module matches (anything else keeps the unfused
kernels), for each matmul `pv` whose left operand is the engine's Softmax decomposition (ir.py
`_softmax`: max, Exp(x - max), sum, Exp * Reciprocal(sum)) of a chain of score steps applied to a
matmul `qk`:

- score steps, in order from qk: Mul or Div by a scalar constant, Where(bool mask, s, scalar
  constant) and Add(s, float32 tensor of the scores' shape) (a scaled, masked attention as torch's
  SDPA decomposition and Hugging Face's attention classes lower);
- optionally the fully masked rows zeroed after the softmax: Where(Equal(max, c), 0, P);
- float32 throughout, both matmuls with alpha 1 and at most two batch dims, and every node in
  between read by nothing else (the call computes them; no kernel does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .ir import Node

SCORE_STEP_KINDS = {"mul": 1, "div": 2, "keep": 3, "add": 4}   # blade_abi.h BLADE_SCORE_*
MAX_STEPS = 4                                                  # BLADE_ATTENTION_MAX_STEPS


@dataclass(frozen=True)
class ScoreStep:
    kind: str                  # SCORE_STEP_KINDS
    value: float = 0.0         # mul/div: the scalar; keep: the masked-out fill
    mask: Node | None = None   # keep: the bool mask; add: the float32 tensor added


@dataclass(frozen=True)
class Attention:
    q: Node                    # qk's operands: Q [.., m, d], K^T [.., d, n]
    kt: Node
    v: Node                    # pv's right operand [.., n, dv]
    steps: tuple
    zero_rows_max: float | None   # rows whose max equals it become 0 (None: no such Where)
    interior: frozenset        # the nodes the call computes in place of their own kernels

    def describe(self) -> str:
        steps = ", ".join(s.kind + (f" {s.mask.name}" if s.mask is not None else f" {s.value}") for s in self.steps)
        zero = f", rows with max {self.zero_rows_max} zeroed" if self.zero_rows_max is not None else ""
        return f"fused attention of {self.q.name} @ {self.kt.name}, steps [{steps}], softmax{zero}, @ {self.v.name}"


def _through_views(node: Node) -> Node:
    while node.op == "view":
        node = node.args[0]
    return node


def _views_to(node: Node, seen: list) -> Node:
    """The node under node's views, the views appended to `seen`."""
    while node.op == "view":
        seen.append(node)
        node = node.args[0]
    return node


def _scalar(node: Node) -> float | None:
    """The value of a float32 scalar constant read through broadcasting views, else None."""
    source = _through_views(node)
    if source.op != "const" or source.numel != 1 or "value" not in source.attrs or source.dtype != "float32":
        return None
    return float(source.attrs["value"].reshape(()))


def _ew(node: Node, fn: str) -> bool:
    return node.op == "ew" and node.attrs.get("fn") == fn


def _last_axis_reduce(node: Node, kind: str, of: Node) -> bool:
    return (node.op == "reduce" and node.attrs.get("kind") == kind and node.args[0] is of
            and list(node.attrs.get("axes", [])) == [of.rank - 1] and node.rank == of.rank
            and node.shape[-1] == 1 and tuple(node.shape[:-1]) == tuple(of.shape[:-1]))


def _score_steps(x: Node, interior: list):
    """(qk, steps) for the chain of score steps from a matmul qk up to the softmax's input x."""
    steps, node = [], x
    while node.op != "matmul":
        if node.op != "ew" or node.dtype != "float32" or tuple(node.shape) != tuple(x.shape):
            return None
        fn, args = node.attrs.get("fn"), node.args
        if fn in ("Mul", "Div") and _scalar(args[1]) is not None:
            steps.append(ScoreStep("mul" if fn == "Mul" else "div", _scalar(args[1])))
            chain = args[0]
        elif fn == "Where" and args[0].dtype == "bool" and tuple(args[0].shape) == tuple(x.shape) \
                and _scalar(args[2]) is not None:
            steps.append(ScoreStep("keep", _scalar(args[2]), args[0]))
            chain = args[1]
        elif fn == "Add" and args[1].dtype == "float32" and tuple(args[1].shape) == tuple(x.shape) \
                and _scalar(args[1]) is None:
            steps.append(ScoreStep("add", mask=args[1]))
            chain = args[0]
        else:
            return None
        interior.append(node)
        node = chain
    if len(steps) > MAX_STEPS or any(math.isnan(s.value) for s in steps if s.kind != "add"):
        return None
    return node, tuple(reversed(steps))


def match(pv: Node, users: dict, graph_outputs: set) -> Attention | None:
    """The fused attention computing matmul `pv`, or None when pv is not one the call takes."""
    if pv.op != "matmul" or pv.dtype != "float32" or pv.attrs.get("alpha", 1.0) != 1.0 or not 2 <= pv.rank <= 4:
        return None
    p, v = pv.args
    interior, zero_rows_max = [], None
    if _ew(p, "Where"):
        cond, zero, probs = p.args
        equal = _views_to(cond, interior)
        if _scalar(zero) != 0.0 or not _ew(equal, "Equal") or _scalar(equal.args[1]) is None:
            return None
        zero_rows_max, top_of_zero = _scalar(equal.args[1]), _through_views(equal.args[0])
        interior += [p, equal]
    else:
        probs, top_of_zero = p, None
    if not _ew(probs, "Mul"):
        return None
    e, recip = probs.args[0], _views_to(probs.args[1], interior)
    if not _ew(e, "Exp") or not _ew(recip, "Reciprocal"):
        return None
    total = recip.args[0]
    sub = e.args[0]
    if not _last_axis_reduce(total, "sum", e) or not _ew(sub, "Sub"):
        return None
    x, top = sub.args[0], _views_to(sub.args[1], interior)
    if not _last_axis_reduce(top, "max", x) or (top_of_zero is not None and top_of_zero is not top):
        return None
    interior += [probs, recip, total, e, sub, top]
    found = _score_steps(x, interior)
    if found is None:
        return None
    qk, steps = found
    if qk.dtype != "float32" or qk.attrs.get("alpha", 1.0) != 1.0 or tuple(qk.shape[:-1]) != tuple(pv.shape[:-1]) \
            or tuple(qk.shape) != tuple(p.shape):
        return None
    interior.append(qk)
    inside = set(interior)
    for node in inside:
        readers = users.get(node, [])
        if node in graph_outputs or any(r not in inside and not (node is p and r is pv) for r in readers):
            return None
    if users.get(p, []) != [pv]:
        return None
    return Attention(qk.args[0], qk.args[1], v, steps, zero_rows_max, frozenset(inside))


def find_attentions(live: list, users: dict, graph_outputs: set) -> dict:
    """pv matmul -> Attention, for every matmul of `live` the fused call computes."""
    found = {}
    for node in live:
        attention = match(node, users, graph_outputs) if node.op == "matmul" else None
        if attention is not None:
            found[node] = attention
    return found
