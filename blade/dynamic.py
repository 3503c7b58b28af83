"""Graphs with symbolic sizes: one compile whose engines take the sizes at run time.

dynamo hands a backend symbolic sizes (``torch.compile(dynamic=True)``, ``mark_dynamic``, or
automatic dynamic shapes after a shape change): tensors whose dims are SymInts over size symbols
(s0, s1, ...), SymInt graph inputs, and a ShapeEnv that knows each symbol's range and value at the
example. This module keeps the symbols:

  1. ranges: each symbol's [min, max] from ``shape_env.var_to_range``; dynamo leaves most maxima
     unbounded (int_oo), and an engine plans its scratch at the maxima, so an unbounded maximum
     becomes ``Config.dynamic_max_size`` (declare a range with ``mark_dynamic(x, dim, min=, max=)``);
  2. probe points: the graph's arguments at the example's sizes and at two other values of the
     symbols in range (tensors cut down or repeated along their symbolic dims, so index inputs
     stay valid). The frontend scripts the graph once and keeps every size that differs between
     probes computed in TorchScript (blade/frontend.py). Points must satisfy dynamo's guards and
     tell every size of the graph apart from a constant (max(s, 10) is 10 at points below 10);
     when the graph fails at them (a relation between sizes no guard states), the next set is
     tried (_point_sets);
  3. each cluster is lowered to ONNX at every probe point. The lowering rules read static shapes;
     when the ONNX graphs agree but for the declared sizes of the cluster's inputs and outputs, no
     rule computed from a run-time size, and the ONNX of the example with those dims as dim_params
     named after the symbols (plus the ranges, ``blade.size_ranges``) is the cluster at every size:
     the engine derives every inner shape from its inputs. A dim that matches no symbol
     expression, or graphs that differ (a reshape target, a mean's divisor, a mask's length baked
     in), refuse the cluster with the reason.

An op a refusing cluster blames stays in TorchScript (``exclusions``, reason in blade.explain)
and the rest is partitioned again, so the graph still compiles once and serves every size in
range. The engine compiler's first stage (ONNX -> IR, whose shape rules meet the size symbols)
runs here too, so an op it refuses, or whose dims it derives otherwise than ONNX infers, is
blamed the same way instead of failing its whole cluster's compile (``_engine_takes``). When the engine compiler itself refuses a cluster's run-time sizes, or the graph cannot be
scripted with its symbols, tt_infer falls back to one static compile per input signature
(blade/specialize.py), with the reason logged.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import onnx
import sympy
import torch
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy
from torch.utils._sympy.functions import FloorDiv, Max, Min, PythonMod

from blade.cluster.lower import lower_cluster
from blade.cluster.rules.base import LoweringError
from blade.engine.ir import SIZE_DERIVED_KEY, SIZE_EQUAL_KEY, SIZE_RANGES_KEY, lower_onnx
from blade.frontend import is_frozen_input, measure_types, stamp

PROBES = 3              # the example's sizes and two others
NEAR_THE_EXAMPLE = 6    # probe values are tried from the minimum up, then just above the example


class NotSymbolic(RuntimeError):
    """The graph's symbolic sizes cannot be kept (the reason says why); compile per shape."""


class SymbolicRefusal(LoweringError):
    """A cluster's lowering depends on a run-time size: it cannot take the sizes at run time.
    ``node``: the cluster node blamed (its rule wrote a size into the ONNX), when known."""

    def __init__(self, message: str, node=None):
        super().__init__(message)
        self.node = node


@dataclass
class SizeSymbols:
    ranges: dict                 # sympy.Symbol -> (min, max), maxima capped
    points: list                 # per probe: sympy.Symbol -> int (points[0]: the example's)
    candidates: list             # sympy expressions a run-time dim may be, simplest first
    probes: list = field(default_factory=list)  # the graph's arguments at each point
    checks: list = field(default_factory=list)  # (argument position, dim or None for an int, symbol)
    open: list = field(default_factory=list)    # the symbols whose maximum dynamo left unbounded
    spare: list = field(default_factory=list)   # other (points, probes) to try if the graph fails at these
    equal: dict = field(default_factory=dict)   # symbol -> an expression over other symbols the guards make it equal
    _at_points: dict = field(default=None, repr=False)  # candidate values at the points -> index

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, example_inputs: list, max_size: int) -> "SizeSymbols":
        placeholders = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        # a backend runs in dynamo's tracing context; blade.export's graph carries its fakes itself
        fake_mode = torch._guards.detect_fake_mode(example_inputs) or torch._guards.detect_fake_mode(
            [p for p in placeholders if isinstance(p, torch.Tensor)])
        shape_env = getattr(fake_mode, "shape_env", None)
        if shape_env is None:
            raise NotSymbolic("dynamo passed no ShapeEnv with the graph")
        exprs = [e for e in _graph_exprs(gm) if e.free_symbols]
        symbols = sorted(set().union(*(e.free_symbols for e in exprs)), key=str) if exprs else []
        if not symbols:
            raise NotSymbolic("no symbolic size in the graph")
        ranges, example, open_symbols = {}, {}, []
        values = getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val
        for sym in symbols:
            value = values.get(sym)
            if value is None:
                raise NotSymbolic(f"size symbol {sym} has no example value (an unbacked size)")
            bound = shape_env.var_to_range.get(sym)
            lo = _finite(bound.lower if bound else None, 0)
            hi = _finite(bound.upper if bound else None, None)
            if hi is None:
                open_symbols.append(sym)
                hi = max(max_size, int(value))
            ranges[sym], example[sym] = (lo, hi), int(value)
        usable, refusals = [], []  # (points, probes) that tell the sizes apart; why others do not
        bounds = {s: ValueRanges(lo, hi) for s, (lo, hi) in ranges.items()}
        guards = [g.expr for g in getattr(shape_env, "guards", ())]
        # sizes that vary: not constant over the ranges, nor guarded equal to a constant
        pinned = {side for g in guards if isinstance(g, sympy.Eq)
                  for side, other in (g.args, g.args[::-1]) if other.is_number}
        varying = [e for e in set(exprs) if e not in pinned and bound_sympy(e, bounds).is_singleton() is False]
        for others in _point_sets(ranges, example, guards):
            points = [example] + others
            try:
                probes = [arguments_at(placeholders, example_inputs, point) for point in points]
                refusal = _refusal(points, probes, varying, shape_env, placeholders)
            except ArithmeticError as err:  # a size of the graph undefined there (a division by 0)
                refusal = f"the graph's sizes are undefined at {points}: {err}"
            if refusal:
                refusals.append(refusal)
            else:
                usable.append((points, probes))
        if not usable:
            raise NotSymbolic("; ".join(refusals) if refusals else "no probe points")
        candidates = sorted(set(exprs), key=lambda e: (len(e.free_symbols), sympy.count_ops(e), str(e)))
        symbols_first = [s for s in symbols] + [e for e in candidates if e not in symbols]
        (points, probes), *spare = usable
        result = cls(ranges, points, symbols_first, probes, _range_checks(placeholders, ranges), open_symbols)
        result.spare = spare
        result.equal = _guarded_equalities(symbols, candidates, guards)
        return result

    def next_points(self) -> bool:
        """Switch to the next probe points (the example's equal sizes kept equal), when the graph
        failed at these; False when there are none left."""
        if not self.spare:
            return False
        self.points, self.probes = self.spare.pop(0)
        self._at_points = None
        return True

    @property
    def names(self) -> dict:
        """The dim_param of each symbol and of each size expression of the graph."""
        return {expr: str(expr).replace(" ", "") for expr in self.candidates}

    def range_of(self, expr) -> tuple:
        bounds = bound_sympy(expr, {s: ValueRanges(lo, hi) for s, (lo, hi) in self.ranges.items()})
        return int(bounds.lower), int(bounds.upper)

    def dim_of(self, values: list):
        """The symbol expression whose value at every probe point is ``values``, else None."""
        index = self.candidate_index(values)
        return None if index is None else self.candidates[index]

    def candidate_index(self, values: list):
        if self._at_points is None:
            self._at_points = {}
            for k, expr in enumerate(self.candidates):  # the simplest first wins
                self._at_points.setdefault(tuple(int(expr.subs(p)) for p in self.points), k)
        return self._at_points.get(tuple(values))

    def fit_caps(self, graph, probe_types: list, budget: int) -> None:
        """Lower the maxima of the open symbols (all to one cap, halved from Config.dynamic_max_size,
        not below a probe's value) until the graph's peak of live tensor bytes at the maxima fits
        ``budget``: engines plan their scratch at the maxima, and attention's batch x seq x seq
        scores outgrow any single cap that suits both batch and sequence."""
        if not self.open:
            return
        sizes = _value_sizes(graph, probe_types, self)
        floor = max(point[sym] for point in self.points for sym in self.open)
        cap = max(self.ranges[sym][1] for sym in self.open)
        while cap > floor and _peak_bytes(sizes, self._maxima(cap)) > budget:
            cap = max(cap // 2, floor)
        for sym in self.open:
            self.ranges[sym] = (self.ranges[sym][0], cap)

    def _maxima(self, cap: int) -> list:
        """Each candidate expression's value with the open symbols at cap, the others at their maxima."""
        at = {sym: cap if sym in self.open else hi for sym, (_, hi) in self.ranges.items()}
        return [int(expr.subs(at)) for expr in self.candidates]

    def out_of_range(self, args) -> str | None:
        """Which argument size lies outside its symbol's range, else None (a few comparisons per
        call: dynamo's guards check the ranges it knows, not the cap on unbounded maxima)."""
        for position, dim, sym in self.checks:
            value = args[position] if dim is None else args[position].shape[dim]
            lo, hi = self.ranges[sym]
            if not lo <= value <= hi:
                where = f"argument {position}" + ("" if dim is None else f" dim {dim}")
                return f"{where} is {value}, outside the range [{lo}, {hi}] of size symbol {sym}"
        return None

    def describe(self) -> str:
        return _ranges_text(self.ranges)

    def with_frozen(self, example_inputs: list, args: list) -> tuple:
        """(example inputs, symbols) for compiling the graph again with the frozen tensors passed
        now (parameters and buffers have static sizes: the same at every probe point)."""
        frozen = [i for i, value in enumerate(example_inputs) if isinstance(value, torch.Tensor)
                  and is_frozen_input(value)]
        refreshed = list(example_inputs)
        probes = [list(probe) for probe in self.probes]
        for i in frozen:
            refreshed[i] = args[i]
            for probe in probes:
                probe[i] = args[i]
        return refreshed, SizeSymbols(self.ranges, self.points, self.candidates, probes, self.checks, self.open)


def _value_sizes(graph, probe_types: list, symbols: SizeSymbols) -> list:
    """(first node, last node using it, itemsize, dims) of each tensor value of the top-level
    block, in node order; dims: ints, and candidate indices for run-time dims (one no candidate
    matches counts at its largest probe size)."""
    order = {node: k for k, node in enumerate(graph.nodes())}
    end = len(order)
    sizes = []
    for value, vtype in probe_types[0].items():
        node = value.node()
        if node not in order or vtype.dtype() is None:
            continue
        seen = [list(t[value].sizes()) if value in t else list(vtype.sizes()) for t in probe_types]
        dims = []
        for d, size in enumerate(seen[0]):
            column = [s[d] for s in seen]
            if len(set(column)) == 1:
                dims.append(size)
            else:
                index = symbols.candidate_index(column)
                dims.append(("expr", index) if index is not None else max(column))
        last = max((order.get(_top_level(use.user), end) for use in value.uses()), default=order[node])
        sizes.append((order[node], last, torch.empty((), dtype=vtype.dtype()).element_size(), dims))
    return sizes


def _top_level(node):
    while node.owningBlock().owningNode() is not None:
        node = node.owningBlock().owningNode()
    return node


def _peak_bytes(sizes: list, maxima: list) -> int:
    """The largest sum of live tensor bytes over the graph's nodes, sizes at ``maxima``."""
    events = {}
    for first, last, itemsize, dims in sizes:
        numel = itemsize
        for d in dims:
            numel *= maxima[d[1]] if isinstance(d, tuple) else d
        events[first] = events.get(first, 0) + numel
        events[last + 1] = events.get(last + 1, 0) - numel
    live = peak = 0
    for k in sorted(events):
        live += events[k]
        peak = max(peak, live)
    return peak


def _range_checks(placeholders: list, ranges: dict) -> list:
    """(position, dim, symbol) of each argument size that is a symbol itself, once per symbol
    (dims that are expressions of symbols follow from those)."""
    checks, seen = [], set()
    for position, fake in enumerate(placeholders):
        sizes = [(None, fake)] if isinstance(fake, torch.SymInt) else \
            list(enumerate(fake.shape)) if isinstance(fake, torch.Tensor) else []
        for dim, size in sizes:
            expr = sympy.sympify(size.node.expr) if isinstance(size, torch.SymInt) else None
            if isinstance(expr, sympy.Symbol) and expr in ranges and expr not in seen:
                seen.add(expr)
                checks.append((position, dim, expr))
    return checks


def _finite(bound, default: int) -> int:
    """A range bound as an int; ``default`` for an unbounded one (dynamo's int_oo, -int_oo)."""
    if not isinstance(bound, (int, sympy.Integer)):  # int_oo (IntInfinity) is not a sympy Integer
        return default
    try:
        return int(bound)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return default


def _guarded_equalities(symbols: list, candidates: list, guards: list) -> dict:
    """symbol -> a size expression of the graph over other symbols that dynamo's guards make it
    equal to, where dynamo did not substitute it: a decode step's mask length s53 and its cache
    length s70 guarded by s53 <= s70 + 1 and s70 + 1 <= s53 (the mask is cache + 1 long). The
    engine then knows a dim of s53 is one of s70 + 1 (a broadcast between them is no refusal), and
    checks it when it is called. Only bounds both ways by single guards count (linear, read off
    as given), no reasoning across guards."""
    upper = set()   # expressions e with a guard e <= 0 (integers: e < 0 is e + 1 <= 0)
    for guard in guards:
        if isinstance(guard, (sympy.Le, sympy.Lt, sympy.Ge, sympy.Gt, sympy.Eq)):
            lhs, rhs = (guard.lhs, guard.rhs) if isinstance(guard, (sympy.Le, sympy.Lt, sympy.Eq)) else \
                (guard.rhs, guard.lhs)
            difference = sympy.expand(lhs - rhs)
            upper.add(difference + 1 if isinstance(guard, (sympy.Lt, sympy.Gt)) else difference)
            if isinstance(guard, sympy.Eq):
                upper.add(-difference)
    equal = {}

    def bounded(e) -> bool:   # some guard says e + c <= 0 with c >= 0, so e <= 0
        slacks = (sympy.expand(u - e) for u in upper)
        return any(c.is_number and c >= 0 for c in slacks)

    for symbol in symbols:
        for expr in candidates:
            if expr is symbol or symbol in expr.free_symbols or not expr.free_symbols or expr.free_symbols & set(equal):
                continue
            if bounded(sympy.expand(symbol - expr)) and bounded(sympy.expand(expr - symbol)):
                equal[symbol] = expr
                break
    return equal


def _refusal(points: list, probes: list, varying: list, shape_env, placeholders: list) -> str | None:
    """Why these probe points cannot stand for every size, else None."""
    if len(points) < 2:
        return "the size symbols' ranges leave no second size"
    bad = next((point for point, probe in zip(points[1:], probes[1:])
                if not _guards_hold(shape_env, placeholders, probe)), None)
    if bad is not None:
        return f"dynamo's guards do not hold at sizes {bad}"
    # the frontend takes a size that is the same at every probe point for a constant: max(s, 10)
    # at points below 10, s // 64 below 64
    flat = next((e for e in varying if len({int(e.subs(p)) for p in points}) == 1), None)
    if flat is not None:
        return f"the size {flat} is the same at every probe point {points}"
    return None


def _ranges_text(ranges: dict) -> str:
    return ", ".join(f"{s} in [{lo}, {hi}]" for s, (lo, hi) in ranges.items())


def _graph_exprs(gm: torch.fx.GraphModule) -> list:
    """Every size expression of the graph's example values (tensor dims, SymInt values)."""
    exprs = []
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        items = list(value.shape) if isinstance(value, torch.Tensor) else [value]
        exprs += [sympy.sympify(d.node.expr) for d in items if isinstance(d, torch.SymInt)]
    return exprs


def _point_sets(ranges: dict, example: dict, guards: list) -> list:
    """The other probe points to try, in order: every symbol at its own value (tells their dims
    apart), then related symbols moved together (``_moved_together``)."""
    sets = []
    for points in (_other_points(ranges, example), _moved_together(ranges, example, guards)):
        if points and points not in sets:
            sets.append(points)
    return sets


def _moved_together(ranges: dict, example: dict, guards: list) -> list:
    """PROBES - 1 points at which the symbols of a group move from the example together, by the
    first move (a step of +-1, +-2, ..., then doubling, tripling, halving) that keeps the group in
    range and its guards true. A group: symbols a guard relates (a KV-cache decode step's mask is
    one longer than the cache: dynamo guards s53 <= s70 + 1 and s53 > s70; a view to [b, -1, 4]
    guards the width a multiple of 4), and symbols equal at the example (dynamo gives the ids'
    and the mask's batch two symbols when no guard equates them, yet the model relies on it:
    ``attention_mask[arange(batch), ...]`` indexes the mask's batch with the ids' batch)."""
    guards = [g for g in guards if g.free_symbols and g.free_symbols <= ranges.keys()]
    group = {sym: {sym} for sym in ranges}
    related = [list(g.free_symbols) for g in guards]
    related += [[s for s in ranges if example[s] == value] for value in set(example.values())]
    for symbols in related:
        merged = set().union(*(group[s] for s in symbols))
        for s in merged:
            group[s] = merged
    points, used = [], {}
    for _ in range(PROBES - 1):
        point = {}
        for sym in ranges:
            if sym in point:
                continue
            members = sorted(group[sym], key=str)
            own = [g for g in guards if g.free_symbols & group[sym]]
            for k, move in enumerate(MOVES):
                moved = {s: move(example[s]) for s in members}
                if k not in used.setdefault(members[0], set()) and \
                        all(v is not None and ranges[s][0] <= v <= ranges[s][1] for s, v in moved.items()) and \
                        _hold(own, {**example, **moved}):
                    used[members[0]].add(k)
                    point.update(moved)
                    break
            else:
                return points
        points.append(point)
    return points


# how a group of symbols moves from the example (None: not this way)
MOVES = [lambda v, k=k: v + k for step in range(1, NEAR_THE_EXAMPLE + 1) for k in (-step, step)] + \
    [lambda v, r=r: v * r for r in (2, 3)] + [lambda v: v // 2 if v % 2 == 0 else None]


def _hold(guards: list, point: dict) -> bool:
    values = {s: sympy.Integer(v) for s, v in point.items()}
    try:
        return all(bool(g.xreplace(values)) for g in guards)
    except (TypeError, ArithmeticError):  # undecidable or undefined there (a division by 0)
        return False


def _other_points(ranges: dict, example: dict) -> list:
    """PROBES - 1 assignments of the symbols, each symbol at a value in range that differs from its
    example value and from its values at other points, and distinct symbols at distinct values
    where the ranges allow (so a dim's expression is told apart from the others). Small sizes
    first: every probe runs the graph."""
    used = {sym: {value} for sym, value in example.items()}
    points = []
    for _ in range(PROBES - 1):
        point, taken = {}, set()
        for sym, (lo, hi) in ranges.items():
            near = [example[sym] + k for k in range(1, NEAR_THE_EXAMPLE + 1)]
            options = [v for v in list(range(lo, min(hi, lo + NEAR_THE_EXAMPLE) + 1)) + near
                       if lo <= v <= hi and v not in used[sym]]
            fresh = [v for v in options if v not in taken]
            if not options:
                return points
            point[sym] = (fresh or options)[0]
            taken.add(point[sym])
            used[sym].add(point[sym])
        points.append(point)
    return points


def arguments_at(placeholders: list, example_inputs: list, point: dict) -> list:
    """The graph's arguments with every symbolic size at its value at ``point``: a SymInt becomes
    that int, a tensor is cut down or repeated cyclically along its symbolic dims (its values stay
    ones the model saw: token ids in range, masks of zeros and ones)."""
    args = []
    for fake, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.SymInt):
            args.append(int(sympy.sympify(value.node.expr).subs(point)))
        elif isinstance(value, torch.Tensor) and isinstance(fake, torch.Tensor):
            for dim, size in enumerate(fake.shape):
                if isinstance(size, torch.SymInt):
                    want = int(sympy.sympify(size.node.expr).subs(point))
                    index = torch.arange(want) % max(value.shape[dim], 1)
                    value = value.index_select(dim, index)
            args.append(value)
        else:
            args.append(value)
    return args


def _guards_hold(shape_env, placeholders: list, args: list) -> bool:
    """Whether dynamo would run this graph for these arguments (its guards on the sizes hold)."""
    if not all(isinstance(p, (torch.Tensor, torch.SymInt)) or p is None for p in placeholders):
        return True  # a placeholder dynamo typed otherwise: nothing to check the sizes of
    fakes = [p for p in placeholders]
    try:
        return bool(shape_env.evaluate_guards_for_args(fakes, args))
    except Exception:  # noqa: BLE001 - a guard we cannot evaluate: do not use this point
        return False


def lower_symbolic(cluster, name: str, symbols: SizeSymbols, probe_types: list) -> onnx.ModelProto:
    """The cluster's ONNX with its run-time dims as dim_params (see the module docstring)."""
    run_time = run_time_dims(probe_types)
    origins = []
    try:  # at the example's sizes: the graph's types
        models = [lower_cluster(cluster, name, run_time, origins)]
    except LoweringError as err:  # a rule refusing a run-time dim (Bloom's reshape to b * heads):
        # that node stays out, not the whole cluster
        blamed = cluster.nodes[len(origins)] if len(origins) < len(cluster.nodes) else \
            _origin(origins, getattr(err, "onnx_node", None))
        raise SymbolicRefusal(f"it does not lower with run-time sizes: {err}", blamed) from err
    try:
        for point, types in zip(symbols.points[1:], probe_types[1:]):
            stamp(types)
            failing = []
            try:
                models.append(lower_cluster(cluster, name, run_time, failing))
            except LoweringError as err:
                blamed = cluster.nodes[len(failing)] if len(failing) < len(cluster.nodes) else \
                    _origin(failing, getattr(err, "onnx_node", None))  # (the whole cluster's ONNX check)
                raise SymbolicRefusal(f"it does not lower at {_point_text(point)}: {err}", blamed) from err
    finally:
        stamp(probe_types[0])
    for point, model in zip(symbols.points[1:], models[1:]):
        if not _same_skeleton(models[0], model):
            what, node_index, init_index = _first_difference(models[0], model)
            blamed = next((n for n, nodes, inits in origins if node_index < nodes or init_index < inits), None)
            raise SymbolicRefusal(f"its ONNX depends on the sizes (at {_point_text(point)}: {what})", blamed)
    model = models[0]
    used, derived = {}, {}
    for group in ("input", "output"):
        for k, value in enumerate(getattr(model.graph, group)):
            dims = [[d.dim_value for d in getattr(m.graph, group)[k].type.tensor_type.shape.dim] for m in models]
            for axis, dim in enumerate(value.type.tensor_type.shape.dim):
                seen = [d[axis] for d in dims]
                if len(set(seen)) == 1:
                    continue
                expr = symbols.dim_of(seen)
                if expr is None:
                    raise SymbolicRefusal(f"{group} {k} dim {axis} ({seen} at the probe sizes) is no size "
                                          f"expression of the graph")
                if group == "output" and symbols.names[expr] not in used:
                    try:
                        derived[symbols.names[expr]] = _derived_tree(expr, symbols.names, used, f"output {k} dim {axis}",
                                                                     _producer(cluster, k))
                    except SymbolicRefusal as err:
                        err.node = _first_with_dim(cluster, seen, probe_types) or err.node
                        raise
                used[symbols.names[expr]] = symbols.range_of(expr)
                dim.ClearField("dim_value")
                dim.dim_param = symbols.names[expr]
    equal = _input_equalities(symbols, used, derived)
    if used:
        model.metadata_props.add(key=SIZE_RANGES_KEY, value=json.dumps(dict(sorted(used.items()))))
    if equal:
        model.metadata_props.add(key=SIZE_EQUAL_KEY, value=json.dumps(dict(sorted(equal.items()))))
    if derived:
        model.metadata_props.add(key=SIZE_DERIVED_KEY, value=json.dumps(dict(sorted(derived.items()))))
    if used:
        _engine_takes(model, origins)
    return model


def _input_equalities(symbols: SizeSymbols, used: dict, derived: dict) -> dict:
    """SIZE_EQUAL_KEY's trees: the dim_params the cluster's inputs bind that dynamo's guards make
    equal to an expression of other input-bound ones (SizeSymbols.equal)."""
    names = symbols.names
    free = {name for name in used if name not in derived}
    equal = {}
    for symbol, expr in symbols.equal.items():
        name = names.get(symbol)
        if name in free and {names.get(s) for s in expr.free_symbols} <= free - {name} - set(equal):
            equal[name] = _derived_tree(expr, names, used, f"size {name}", None)
    return equal


def _engine_takes(model: onnx.ModelProto, origins: list) -> None:
    """Run the engine compiler's first stage (ONNX -> IR, torch-free and g++-free) on a cluster with
    run-time sizes: its shape rules meet the symbols there (a Slice bound clamped at some sizes
    only, a dim the rules derive otherwise than ONNX infers), and a refusal there used to fail the
    whole cluster's compile. A refusal naming its ONNX node blames the cluster node that made it,
    so only that op stays in TorchScript (``exclusions``); one naming none is left to the compile
    to report, as before."""
    try:
        lower_onnx(model)
    except Exception as err:  # noqa: BLE001 - any refusal of the stage; the compile would fail the same way
        index = getattr(err, "onnx_node", None)
        blamed = _origin(origins, _output_producer(model, index))
        if blamed is None:
            return
        raise SymbolicRefusal(f"the engine refuses it ({type(err).__name__}: {err})", blamed) from err


# sympy function -> the operator of the derived size's tree (ir.DERIVED_OPS). Sizes are >= 0, so
# FloorDiv and PythonMod agree with the engine's floor division and remainder.
_DERIVED_OPS = {sympy.Add: "add", sympy.Mul: "mul", FloorDiv: "floordiv", PythonMod: "mod",
                Max: "max", Min: "min", sympy.Max: "max", sympy.Min: "min"}


def _derived_tree(expr, names: dict, used: dict, where: str, producer):
    """An output dim no input binds, as the JSON tree (ints, names of input-bound size symbols,
    [op, *args]) the engine computes it from when it is called (SIZE_DERIVED_KEY), or a refusal
    when it is not an integer polynomial/division of size symbols the inputs bind."""
    def tree(e):
        if e.is_Integer:
            return int(e)
        if e.is_Symbol:
            if names.get(e) not in used:
                raise SymbolicRefusal(f"{where} is {expr}, over {e}, which no input of the cluster has", producer)
            return names[e]
        op = _DERIVED_OPS.get(type(e))
        if op is None:
            raise SymbolicRefusal(f"{where} is {expr}, a size no input of the cluster has and the engine cannot "
                                  f"compute ({type(e).__name__})", producer)
        return [op, *map(tree, e.args)]
    return tree(sympy.sympify(expr))


def _output_producer(model: onnx.ModelProto, index):
    """The ONNX node index to blame for node ``index``: itself, or for an output's Identity (which
    lower_cluster appends after every op, e.g. where the engine's dims for an output disagree with
    the ones the probes gave it) the node computing the output."""
    if index is None or index >= len(model.graph.node) or model.graph.node[index].op_type != "Identity":
        return index
    source = model.graph.node[index].input[0]
    return next((k for k, node in enumerate(model.graph.node) if source in node.output), index)


def _origin(origins: list, onnx_node):
    """The cluster node whose rule made ONNX node number ``onnx_node`` (lower_cluster's origins),
    None when not known."""
    return None if onnx_node is None else next((n for n, nodes, _ in origins if onnx_node < nodes), None)


def _first_with_dim(cluster, seen: list, probe_types: list):
    """The first cluster node with an output dim of the sizes ``seen`` at the probe points: the op
    that made a size the engine cannot compute (a slice's Max(0, s - 2)), which the ops after it
    only pass on; None when no node's output has it."""
    for node in cluster.nodes:
        for value in node.outputs():
            if value not in probe_types[0] or not isinstance(probe_types[0][value], torch.TensorType):
                continue
            shapes = [types[value].sizes() if value in types else None for types in probe_types]
            if any(shape is None for shape in shapes):
                continue
            if any([shape[d] for shape in shapes] == seen for d in range(len(shapes[0]))):
                return node
    return None


def _producer(cluster, k: int):
    """The cluster node computing its k-th output (None when the output is one of its inputs)."""
    node = cluster.outputs[k].node()
    return node if node in cluster.nodes else None


def _same_skeleton(a: onnx.ModelProto, b: onnx.ModelProto) -> bool:
    """Whether two lowerings agree but for their inputs' and outputs' sizes (what must not depend
    on the sizes). Messages compare field by field in C, bit for bit like their serializations;
    serializing every weight to compare them cost more than the lowering itself."""
    return (_io(a) == _io(b) and list(a.graph.node) == list(b.graph.node)
            and list(a.graph.initializer) == list(b.graph.initializer))


def _io(model: onnx.ModelProto) -> tuple:
    graph = model.graph
    return tuple((v.name, v.type.tensor_type.elem_type, len(v.type.tensor_type.shape.dim))
                 for v in list(graph.input) + list(graph.output))


def _first_difference(a: onnx.ModelProto, b: onnx.ModelProto) -> tuple:
    """(what differs, index of the first ONNX node that differs or reads a constant that does,
    index of the first initializer that differs); the indices are large when none does."""
    none = len(a.graph.node) + len(a.graph.initializer) + 1
    changed = {t.name: k for k, (t, u) in enumerate(zip(a.graph.initializer, b.graph.initializer))
               if t.SerializeToString() != u.SerializeToString()}
    for k, (n, m) in enumerate(zip(a.graph.node, b.graph.node)):
        if n.SerializeToString() != m.SerializeToString():
            return f"ONNX {n.op_type} changes", k, min(changed.values(), default=none)
        constant = next((name for name in n.input if name in changed), None)
        if constant is not None:
            return f"constant {constant} of {n.op_type} changes", k, changed[constant]
    return "the graphs differ", none, min(changed.values(), default=none)


def _point_text(point: dict) -> str:
    return ", ".join(f"{s}={v}" for s, v in point.items())


def run_time_dims(probe_types: list) -> dict:
    """value -> {dim: its sizes at the probe points} for the dims whose size differs between probe
    points (its run-time dims). Rules compare run-time dims by these columns, not by one probe's
    sizes: at a probe where seq is 1, batch * seq equals batch there only (LowerCtx.target_shape)."""
    dims = {}
    for value, vtype in probe_types[0].items():
        sizes = [list(types[value].sizes()) if value in types else None for types in probe_types]
        varying = {d: tuple(None if s is None else s[d] for s in sizes) for d in range(len(sizes[0]))
                   if any(s is None or s[d] != sizes[0][d] for s in sizes)}
        if varying:
            dims[value] = varying
    return dims


def probe_types(front) -> list:
    """Per probe point, every tensor value of the frontend's graph -> its type there."""
    return [measure_types(front.module, inputs) for inputs in front.probe_inputs]


def exclusions(graph, symbols: SizeSymbols, types: list, partition_graph) -> tuple:
    """(partition, lowered): the graph partitioned with the ops whose lowering computes from a
    run-time size left out (their reasons in ``partition.reasons``), and the ONNX of each of its
    clusters by name (``cluster_<index>``) where it lowered. ``partition_graph(excluded)``
    partitions with those nodes left out; partition, lower every cluster at every probe point,
    leave out the node each refusing cluster blames (or all of its nodes when none is to blame),
    and again until every cluster lowers. The last round's lowerings are the compile's: the
    pipeline does not lower those clusters again."""
    excluded: dict = {}
    while True:
        refused, lowered = 0, {}
        parts = partition_graph(excluded)
        for cluster in parts.clusters:
            name = f"cluster_{cluster.index}"
            try:
                lowered[name] = lower_symbolic(cluster, name, symbols, types)
            except SymbolicRefusal as err:
                refused += 1
                blamed = [err.node] if err.node is not None else cluster.nodes
                excluded.update({node: f"computes from a run-time size: {err}" for node in blamed})
            except LoweringError:
                continue  # refused at the example's sizes too: the compile reports it
        if not refused:
            return parts, lowered
