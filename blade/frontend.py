"""Frontend: an FX GraphModule (from dynamo) -> a frozen, fully typed TorchScript graph.

This is one of the two TorchScript-specific layers (with cluster/splice.py); the engine compiler
never sees TorchScript. Steps:
  1. parameters and buffers that dynamo lifted to graph inputs become module constants (inference
     freezing, as Inductor's freezing and torch_blade do); the rest stay runtime inputs, and so
     does lifted state the graph writes (a counter buffer, batch norm's running statistics in
     training mode): each call then writes the caller's tensor once, like eager;
  2. torch.jit.script, or torch.jit.trace with the example inputs when scripting fails;
  3. freeze, inline, constant-propagate, remove mutation, specialize sizes to the static shapes;
  4. give every tensor value of the top-level block its concrete shape and dtype, measured by
     running the graph on copies of the example inputs and of the module's state (exact for every
     op, no shape functions needed; the caller's tensors are never written by a compile);
  5. check those dtypes against eager's (dynamo's example values): where TorchScript computes an
     FX value in another dtype, cast it back to eager's and convert again (see _eager_dtypes).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import math
import operator
import re
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx

from blade.cluster.aliasing import fold_identity_tests, written_attributes, written_constants
from blade.cluster.out_of_place import rewrite_writes_to_temporaries
from blade.cluster.rules.base import is_size_arithmetic
from blade.conv_sums import merge_conv_sums
from blade.executor import unoptimized
from blade.fold import fold_input_independent
from blade.guards import wrapped_scalars
from blade.native_layers import unfused

log = logging.getLogger("blade")


class FrontendError(RuntimeError):
    """The FX graph could not be turned into TorchScript (neither scripted nor traced)."""


class ProbeFailed(FrontendError):
    """The scripted graph runs at the example's sizes but raises at a probe point's (other values
    of the size symbols): the probe broke a relation between sizes the model relies on."""


@dataclass
class Frontend:
    module: torch.jit.ScriptModule   # frozen; its forward graph is typed and ready to cluster
    runtime_inputs: list[int]        # positions of the dynamo arguments the module takes
    example_inputs: list             # those arguments' example values
    how: str                         # "script" or "trace"
    probe_inputs: list = field(default_factory=list)  # with size symbols: those arguments at each probe point

    @property
    def graph(self) -> torch.Graph:
        return self.module.graph


def is_frozen_input(value) -> bool:
    """Parameters and buffers dynamo lifted to inputs (it marks them as static inputs)."""
    return isinstance(value, torch.nn.Parameter) or hasattr(value, "_dynamo_static_input_type")


FROZEN_PREFIX = "_blade_frozen_"
# What dynamo's FX graphs spell in ways torch.jit.script rejects, respelled the way it takes them
# (the same computation): a graph with symbolic sizes is only scripted, and compiled once per shape
# when that fails. Functions on symbolic scalars (``math.sqrt(2 / math.pi)`` with math.pi passed as
# a wrapped scalar; sum() of sizes: Wav2Vec2, KV-cache decoders; max() and min() of sizes: Mistral's
# sliding window) -> the plain builtins. (Probe points at which max(s, 10) is 10 at each would make
# a size that varies look constant: blade/dynamic.py refuses such points.)
SCRIPTABLE_FUNCTIONS = {torch._sym_sqrt: math.sqrt, torch.sym_sum: sum, torch.sym_max: max, torch.sym_min: min}
# Tensor methods TorchScript lacks -> (the method it has, arguments appended): DeBERTa's mask.bool()
SCRIPTABLE_METHODS = {"bool": ("to", (torch.bool,))}
# numpy's keyword names -> torch's: torch.cat(xs, axis=1) (Funnel)
KEYWORD_ALIASES = {torch.cat: {"axis": "dim"}, torch.concat: {"axis": "dim"}, torch.concatenate: {"axis": "dim"}}
# float arguments written as ints (F.pad(x, p, "constant", 0): BiT) -> (position, keyword)
FLOAT_ARGUMENTS = {torch.nn.functional.pad: (3, "value"), torch._C._nn.pad: (3, "value")}
# functions whose Python wrapper only checks sizes before calling an op -> (that op, its arguments
# from the wrapper's): TorchScript would run the check (a loop over sizes: F.group_norm's
# _verify_batch_size) on every call and, with run-time sizes, keep it and the sizes it reads out of
# engines. A node dynamo ran on fake tensors (meta "example_value") passed the check at its
# symbolic sizes, and dynamo's guards keep what the check needed true.
CHECKED_FUNCTIONS = {
    torch.nn.functional.group_norm: (torch.group_norm, lambda a: (
        a["input"], a["num_groups"], a["weight"], a["bias"], a["eps"], False)),
}
# torch.tensor of an empty list (DynamicCache's start: cat([torch.tensor([]), keys])): TorchScript
# types [] as List[Tensor] and fails when the graph runs -> torch.empty of 0 elements, the same
# dtype and device keywords
EMPTY_LIST_TENSORS = {torch.tensor: torch.empty, torch.as_tensor: torch.empty}
# x[..., [-2], :] (Falcon's fused QKV split): TorchScript has no tensor indexing after an ellipsis
# -> the ellipsis spelled as the full slices it stands for (the rank is the node's input's)
# calls that compute nothing and that TorchScript cannot script, left out of the graph: the usage
# log of an nn.Module built inside forward (transformers 5's decoders do)
DROPPED_CALLS = {torch._C._log_api_usage_once}


def _plain_graph_module(gm: torch.fx.GraphModule, example_inputs, freeze: bool, written=frozenset()):
    """Copy gm into a plain GraphModule (torch 2.13 hands backends a lazy one) and turn frozen
    inputs, except the positions in ``written``, into attributes. Returns the module and the
    positions of the inputs it still takes."""
    graph = torch.fx.Graph()
    env: dict = {}
    root = torch.nn.Module()
    for name, sub in gm.named_children():
        root.add_module(name, sub)
    for name, buf in gm.named_buffers(recurse=False):
        root.register_buffer(name, buf)
    for name, param in gm.named_parameters(recurse=False):
        root.register_parameter(name, param)
    runtime_inputs = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    scalars = wrapped_scalars(gm)  # frozen like weights, their values checked on every call
    for position, node in enumerate(placeholders):
        value = example_inputs[position] if position < len(example_inputs) else None
        if freeze and isinstance(value, torch.Tensor) and (is_frozen_input(value) or position in scalars) \
                and position not in written:
            attr = f"{FROZEN_PREFIX}{position}"
            root.register_buffer(attr, value.detach())
            env[node] = graph.get_attr(attr)
        elif isinstance(value, (bool, int, float)):
            env[node] = value  # a scalar input is specialized: the caller keys compiles on it
        else:  # a tensor, or a size symbol's value (a SymInt: an int at run time)
            env[node] = graph.placeholder(node.name, type_expr=int if isinstance(value, torch.SymInt) else node.type)
            runtime_inputs.append(position)
        if isinstance(env[node], torch.fx.Node):
            env[node].meta = dict(node.meta)  # (the respellings read example values)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in DROPPED_CALLS and not node.users:
            continue
        if node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
            _respell(env[node])
    for name, value in vars(gm).items():  # constants dynamo attached as plain attributes
        if isinstance(value, torch.Tensor) and not hasattr(root, name):
            setattr(root, name, value)
    module = torch.fx.GraphModule(root, graph).eval()
    if freeze:
        fold_input_independent(module)
    return module, runtime_inputs


def _respell(node: torch.fx.Node) -> None:
    """node as torch.jit.script takes it (the tables above)."""
    if node.op == "call_method" and node.target in SCRIPTABLE_METHODS:
        node.target, extra = SCRIPTABLE_METHODS[node.target]
        node.args = tuple(node.args) + extra
    if node.op != "call_function":
        return
    unfused(node)
    if node.target is operator.getitem:
        node.args = (node.args[0], _without_ellipsis(*node.args))
    node.target = SCRIPTABLE_FUNCTIONS.get(node.target, node.target)
    if node.target in EMPTY_LIST_TENSORS and len(node.args) == 1 and isinstance(node.args[0], (list, tuple)) \
            and len(node.args[0]) == 0:
        node.target, node.args = EMPTY_LIST_TENSORS[node.target], ((0,),)
    if node.target in CHECKED_FUNCTIONS and "example_value" in node.meta:
        op, arguments = CHECKED_FUNCTIONS[node.target]
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
        bound.apply_defaults()
        node.target, node.args, node.kwargs = op, arguments(bound.arguments), {}
    aliases = KEYWORD_ALIASES.get(node.target, {})
    if any(k in aliases for k in node.kwargs):
        node.kwargs = {aliases.get(k, k): v for k, v in node.kwargs.items()}
    if node.target in FLOAT_ARGUMENTS:
        position, keyword = FLOAT_ARGUMENTS[node.target]
        if len(node.args) > position and type(node.args[position]) is int:
            node.args = (*node.args[:position], float(node.args[position]), *node.args[position + 1:])
        if type(node.kwargs.get(keyword)) is int:
            node.kwargs = {**node.kwargs, keyword: float(node.kwargs[keyword])}


def _without_ellipsis(x, index):
    """index with its ellipsis spelled as full slices, when a list or tensor index follows it."""
    value = x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
    if not (isinstance(index, tuple) and isinstance(value, torch.Tensor) and index.count(Ellipsis) == 1):
        return index
    after = index[index.index(Ellipsis) + 1:]
    if not any(isinstance(i, list) or isinstance(getattr(i, "meta", {}).get("example_value"), torch.Tensor)
               for i in after):
        return index
    taken = sum(_dims_indexed(i) for i in index if i is not None and i is not Ellipsis)
    k = index.index(Ellipsis)
    return index[:k] + (slice(None),) * (value.dim() - taken) + index[k + 1:]


def _dims_indexed(item) -> int:
    """How many dims an index item takes: a bool mask its rank, anything else one."""
    value = getattr(item, "meta", {}).get("example_value")
    return value.dim() if isinstance(value, torch.Tensor) and value.dtype == torch.bool else 1


def _script(module: torch.fx.GraphModule, inputs: list):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's annotation chatter about FX internals
        return torch.jit.script(module)


def _trace(module: torch.fx.GraphModule, inputs: list):
    if not all(isinstance(x, torch.Tensor) for x in inputs):
        raise FrontendError("torch.jit.trace needs tensor inputs")
    # Tracing runs the graph: on copies of the inputs, and with the module's own state (which the
    # traced module must keep sharing with the model) put back afterwards.
    with warnings.catch_warnings(), state_restored(module_state(module)):
        warnings.simplefilter("ignore")
        return torch.jit.trace(module, tuple(copied_tensors(inputs)), check_trace=False, strict=False)


def copied_tensors(values: list) -> list:
    """The values with every tensor replaced by a copy of the same sizes, strides and storage
    offset; views of one storage stay views of one copied storage. What the frontend runs the
    graph on, so a graph that writes its inputs never writes the caller's."""
    storages: dict = {}

    def copy_of(value):
        if not isinstance(value, torch.Tensor):
            return value
        storage = value.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in storages:
            storages[key] = storage.clone()
        copied = torch.empty(0, dtype=value.dtype, device=value.device)
        copied.set_(storages[key], value.storage_offset(), value.size(), value.stride())
        return copied.requires_grad_(value.requires_grad)  # measured types carry it

    with torch.no_grad():
        return [copy_of(value) for value in values]


def module_state(module) -> list:
    """A module's parameters and buffers."""
    if not isinstance(module, torch.nn.Module):
        return []
    return list(module.parameters()) + list(module.buffers())


@contextlib.contextmanager
def state_restored(tensors):
    """The tensors (a model's parameters and buffers, inputs) hold their bytes again on exit."""
    saved = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        saved.setdefault(storage.data_ptr(), (storage, storage.clone()))
    try:
        yield
    finally:
        for storage, snapshot in saved.values():
            storage.copy_(snapshot)


CONVERTERS = {"script": _script, "trace": _trace}  # tried in this order


def _constant_size_arguments(graph: torch.Graph, probes: list) -> int:
    """view/reshape/expand whose size list is computed from run-time sizes (dynamo's SymInts:
    ``x.view(batch, seq, -1, 64)``) become ops with constant arguments computing the same at every
    size, so they can join clusters: expand's run-time dims the input already has become -1;
    a view/reshape that keeps its leading and trailing dims and regroups static ones in between
    becomes flatten and/or unflatten of that middle. ``probes``: value -> TensorType at each probe.
    Returns how many nodes it replaced."""
    rewritten = 0
    for node in list(graph.nodes()):
        if node.kind() not in ("aten::view", "aten::reshape", "aten::expand") or is_constant_value(node.inputsAt(1)):
            continue
        with graph.insert_point_guard(node):
            replacement = _constant_size_form(graph, node, probes)
        if replacement is not None:
            replacement.setType(node.output().type())
            node.output().replaceAllUsesWith(replacement)
            node.destroy()
            rewritten += 1
    return rewritten


def _constant_size_form(graph: torch.Graph, node: torch.Node, probes: list):
    """The value replacing a view/reshape/expand to computed sizes, else None."""
    kind, x, out = node.kind(), node.inputsAt(0), node.output()
    shape_of = node.inputsAt(1).node()
    if shape_of.kind() == "aten::size" and len(list(shape_of.inputs())) == 1 and \
            shape_of.inputsAt(0).type().kind() == "TensorType":
        # x.view(t.shape) (OPT's MLP restores the shape it flattened): view_as(x, t), which an
        # engine computes from t's shape at run time; the int list could not enter a cluster
        return graph.insertNode(graph.create(kind + "_as", [x, shape_of.inputsAt(0)])).output()
    if any(x not in types or out not in types for types in probes):
        return None
    ins = [list(types[x].sizes()) for types in probes]
    outs = [list(types[out].sizes()) for types in probes]
    return _expand_constant(graph, node, ins, outs) if kind == "aten::expand" else _regroup(graph, x, ins, outs)


def is_constant_value(value: torch.Value) -> bool:
    node = value.node()
    return node.kind() == "prim::Constant" or (
        node.kind() == "prim::ListConstruct" and all(is_constant_value(v) for v in node.inputs()))


def _same_at_every_probe(ins: list, d_in: int, outs: list, d_out: int) -> bool:
    return all(i[d_in] == o[d_out] for i, o in zip(ins, outs))


def _expand_constant(graph: torch.Graph, node: torch.Node, ins: list, outs: list):
    rank, lead = len(outs[0]), len(outs[0]) - len(ins[0])
    sizes = []
    for d in range(rank):
        if all(o[d] == outs[0][d] for o in outs):
            sizes.append(outs[0][d])
        elif d >= lead and _same_at_every_probe(ins, d - lead, outs, d):
            sizes.append(-1)
        else:
            return None
    args = [node.inputsAt(0), graph.insertConstant(sizes)] + list(node.inputs())[2:]
    return graph.insertNode(graph.create("aten::expand", args)).output()


def _regroup(graph: torch.Graph, x: torch.Value, ins: list, outs: list):
    rank_in, rank_out = len(ins[0]), len(outs[0])
    lead = 0
    while lead < min(rank_in, rank_out) and _same_at_every_probe(ins, lead, outs, lead):
        lead += 1
    tail = 0
    while tail < min(rank_in, rank_out) - lead and _same_at_every_probe(ins, rank_in - 1 - tail, outs, rank_out - 1 - tail):
        tail += 1
    middle_in, middle_out = rank_in - lead - tail, rank_out - lead - tail
    if (middle_in, middle_out) == (1, 1):
        return None  # one dim becomes another of a different size: not a regrouping
    static_out = all(o[d] == outs[0][d] for o in outs for d in range(lead, lead + middle_out))
    if middle_out > 1 and not static_out:
        return None  # unflatten to run-time sizes: its arguments would be computed
    value = x
    if middle_in > 1 or (middle_in == 1 and middle_out == 0) or (middle_in == 0 and middle_out == 1):
        if middle_in == 0:  # a new dim of size 1: unflatten a neighbour into (1, it)
            return None
        value = graph.insertNode(graph.create("aten::flatten", [value, graph.insertConstant(lead),
                                                                 graph.insertConstant(lead + middle_in - 1)])).output()
    if middle_out > 1:
        sizes = outs[0][lead:lead + middle_out]
        value = graph.insertNode(graph.create("aten::unflatten", [value, graph.insertConstant(lead),
                                                                   graph.insertConstant(sizes)])).output()
    elif middle_out == 0 and middle_in > 0:
        return None  # dims of size 1 removed: a squeeze, rare from computed sizes
    return value


def _specialize_sizes(graph: torch.Graph) -> None:
    """aten::size/dim/numel of a tensor become constants where the sizes they read are static (a
    run-time size, None in the value's type, stays computed); so do its dtype and whether it is a
    float (F.multi_head_attention_forward's mask checks)."""
    for node in list(graph.nodes()):
        kind = node.kind()
        if kind not in ("aten::size", "aten::dim", "aten::numel", "prim::dtype", "aten::is_floating_point"):
            continue
        inputs = list(node.inputs())
        shape = known_sizes(inputs[0])
        if shape is None:
            continue
        dtype = inputs[0].type().dtype()
        if kind in ("prim::dtype", "aten::is_floating_point"):
            value = None if dtype is None else dtype if kind == "prim::dtype" else dtype.is_floating_point
        elif kind == "aten::dim":
            value = len(shape)
        elif kind == "aten::numel":
            value = 1 if None not in shape else None
            for d in shape if value is not None else ():
                value *= d
        elif len(inputs) == 1:
            value = None if None in shape else list(shape)
        else:
            dim = inputs[1].toIValue()
            value = None if dim is None else shape[dim]
        if value is None:
            continue
        with graph.insert_point_guard(node):
            const = graph.insertConstant(value)
        node.output().replaceAllUsesWith(const)
        node.destroy()
    _specialize_known_items(graph)


def _specialize_known_items(graph: torch.Graph) -> None:
    """Items of ``x.size()`` that are static where others are run-time sizes (``b, s, d = x.shape``
    with d static): ``__getitem__`` with a constant index and ``prim::ListUnpack`` outputs; and
    its ``len``, the rank (F.adaptive_avg_pool2d's check of the rank, which kept an If, and the
    tensor it reads as an engine output, in TorchScript)."""
    for node in list(graph.nodes()):
        if node.kind() not in ("aten::__getitem__", "prim::ListUnpack", "aten::len"):
            continue
        source = node.inputsAt(0).node()
        if source.kind() != "aten::size" or len(list(source.inputs())) != 1:
            continue
        shape = known_sizes(source.inputsAt(0))
        if shape is None:
            continue
        if node.kind() == "aten::len":
            items = [(node.output(), len(shape))]
        elif node.kind() == "prim::ListUnpack":
            items = list(zip(node.outputs(), shape))
        else:
            index = node.inputsAt(1).toIValue() if node.inputsAt(1).node().kind() == "prim::Constant" else None
            items = [(node.output(), shape[index])] if isinstance(index, int) and -len(shape) <= index < len(shape) else []
        for value, size in items:
            if size is not None:
                with graph.insert_point_guard(node):
                    value.replaceAllUsesWith(graph.insertConstant(size))


def known_sizes(value: torch.Value):
    """A tensor value's sizes, None for each dim not known statically; None when the rank is not."""
    vtype = value.type()
    if not isinstance(vtype, torch.TensorType):
        return None
    sizes = vtype.varyingSizes()  # (sizes() is None unless every dim is known)
    return list(sizes) if sizes is not None else None


def _forget_run_time_sizes(module: torch.jit.ScriptModule, inputs: list, probes: list) -> None:
    """Types whose sizes differ when the graph runs on the probe inputs (the same graph at other
    values of its size symbols) get those dims unknown, so _specialize_sizes keeps them computed."""
    others = [_types_at_probe(module, probe) for probe in probes]
    if _constant_size_arguments(module.graph, [measure_types(module, inputs), *others]):
        torch._C._jit_pass_dce(module.graph)
        others = [_types_at_probe(module, probe) for probe in probes]
    base = measure_types(module, inputs)
    for value, vtype in base.items():
        sizes = list(vtype.sizes())
        for other in others:
            seen = other.get(value)
            seen = list(seen.sizes()) if seen is not None else [None] * len(sizes)
            sizes = [a if a == b else None for a, b in zip(sizes, seen)]
        value.setType(vtype.with_sizes(sizes))


def _types_at_probe(module: torch.jit.ScriptModule, probe: list) -> dict:
    try:
        return measure_types(module, probe)
    except Exception as err:  # noqa: BLE001 - the model's own error at these sizes
        lines = str(err).strip().splitlines() or [type(err).__name__]
        raise ProbeFailed(f"the graph fails at a probe point's sizes: {lines[-1]}") from err


def _clean(graph: torch.Graph) -> None:
    torch._C._jit_pass_inline(graph)
    _drop_size_copies(graph)
    torch._C._jit_pass_constant_propagation(graph)
    torch._C._jit_pass_peephole(graph)
    torch._C._jit_pass_remove_mutation(graph)
    if rewrite_writes_to_temporaries(graph):   # writes through views, which RemoveMutation leaves
        torch._C._jit_pass_remove_mutation(graph)
    torch._C._jit_pass_dce(graph)
    torch._C._jit_pass_cse(graph)


def _drop_size_copies(graph: torch.Graph) -> None:
    """``aten::Size`` of a list built in the graph (``x.shape[-1:]`` under dynamo: torch.Size of
    [s]) is the list itself: without the copy, an op taking it (layer_norm's normalized_shape)
    sees the list of run-time sizes its rule reads (support.run_time_size_list)."""
    for node in list(graph.nodes()):
        if node.kind() == "aten::Size" and node.inputsAt(0).node().kind() == "prim::ListConstruct":
            node.output().replaceAllUsesWith(node.inputsAt(0))
            node.destroy()


def _assign_types(module: torch.jit.ScriptModule, inputs: list) -> None:
    """Run a copy of the graph that returns every top-level tensor value, and stamp each value's
    concrete shape and dtype onto the real graph."""
    stamp(measure_types(module, inputs))


def stamp(types: dict) -> None:
    """Set every value's type: value -> TensorType, as measure_types returns."""
    for value, vtype in types.items():
        value.setType(vtype)


def measure_types(module: torch.jit.ScriptModule, inputs: list) -> dict:
    """Every top-level tensor value -> its TensorType when the graph runs on these inputs (the
    graph itself is left as it is, but for constants, typed from themselves)."""
    graph = module.graph
    values = []
    for node in graph.nodes():
        for value in node.outputs():
            if not isinstance(value.type(), torch.TensorType) or node.kind() == "prim::Uninitialized":
                continue  # (the placeholder of a branch that raises, e.g. in a scripted F.interpolate)
            if node.kind() == "prim::Constant":  # typed from the constant itself
                constant = value.toIValue()  # (a traced wrapped number comes back as a Python scalar)
                if isinstance(constant, (torch.Tensor, bool, int, float)):
                    value.setType(torch._C.TensorType.create_from_tensor(torch.as_tensor(constant)))
            else:
                values.append(value)
    for graph_input, example in zip(list(graph.inputs())[1:], inputs):
        if isinstance(example, torch.Tensor):
            values.append(graph_input)
    probe = graph.copy()
    probe_values = {}
    for original, copied in zip(_all_values(graph), _all_values(probe)):
        probe_values[original] = copied
    for out_index in reversed(range(len(list(probe.outputs())))):
        probe.eraseOutput(out_index)
    for value in values:
        probe.registerOutput(probe_values[value])
    probe.makeMultiOutputIntoTuple()
    # run once: the graph executor's profiling and optimization (most of a call's time on a
    # fresh function) would buy nothing (blade/executor.py)
    fn = unoptimized(torch._C._create_function_from_graph("blade_type_probe", probe))
    with torch.no_grad():  # on copies: the graph may write its inputs and the module's state
        results = fn(copy.deepcopy(module)._c, *copied_tensors(inputs))
    if not isinstance(results, tuple):
        results = (results,)
    return {value: torch._C.TensorType.create_from_tensor(result)
            for value, result in zip(values, results) if isinstance(result, torch.Tensor)}


def _all_values(graph: torch.Graph):
    yield from graph.inputs()
    for node in graph.nodes():
        yield from node.outputs()


FROZEN_FOLDS = (torch._C._jit_pass_fold_frozen_conv_bn, torch._C._jit_pass_fold_frozen_conv_add_or_sub,
                torch._C._jit_pass_fold_frozen_conv_mul_or_div, torch._C._jit_pass_fold_frozen_linear_bn)


def _concat_shared_input_linears(graph: torch.Graph) -> None:
    """Linears that read the same input with constant weights (attention's Q, K and V projections)
    become one linear on the concatenated weights, sliced back apart: one GEMM with 3x the columns
    runs closer to MKL's peak than three. torch's _jit_pass_concat_frozen_linear does this for CUDA
    weights only."""
    groups: dict = {}
    for node in graph.nodes():
        if node.kind() != "aten::linear":
            continue
        x, weight, bias = node.inputs()
        w, b = weight.toIValue(), bias.toIValue()
        if weight.node().kind() != "prim::Constant" or bias.node().kind() != "prim::Constant" or \
                not isinstance(w, torch.Tensor) or w.dim() != 2 or (b is not None and not isinstance(b, torch.Tensor)):
            continue
        groups.setdefault(x, []).append((node, w, b))
    for linears in groups.values():
        first_w = linears[0][1]
        linears = [item for item in linears if item[1].shape[1] == first_w.shape[1] and item[1].dtype == first_w.dtype]
        if len(linears) < 2:
            continue
        first = linears[0][0]
        weight = torch.cat([w for _, w, _ in linears])
        bias = None if all(b is None for _, _, b in linears) else \
            torch.cat([b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype) for _, w, b in linears])
        with graph.insert_point_guard(first):
            merged = graph.create("aten::linear", [first.inputsAt(0), graph.insertConstant(weight),
                                                   graph.insertConstant(bias)])
            merged.insertBefore(first)
            start = 0
            for node, w, _ in linears:
                end = start + w.shape[0]
                part = graph.create("aten::slice", [merged.output(), graph.insertConstant(-1),
                                                    graph.insertConstant(start), graph.insertConstant(end),
                                                    graph.insertConstant(1)])
                part.insertBefore(first)
                node.output().replaceAllUsesWith(part.output())
                start = end
        for node, _, _ in linears:
            node.destroy()


def _prepare(scripted, inputs: list, written: list, probes: list) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript's own deprecation notice
        frozen = torch.jit.freeze(scripted.eval(), preserved_attrs=written, optimize_numerics=False)
    # torch's own folds of frozen affine ops into the preceding conv/linear (what freeze does with
    # optimize_numerics=True, the rest of which we do not want): a batch norm after a conv becomes
    # new conv weights and bias, instead of a per-channel multiply-add pass over every activation.
    for fold in FROZEN_FOLDS:
        fold(frozen.graph)
    _clean(frozen.graph)
    _fold_read_only_attributes(frozen, written)
    written = written_constants(frozen.graph)
    if written:  # the graph then runs eagerly (tt_infer's fallback), which writes the model's own state
        raise FrontendError(f"the graph writes {len(written)} tensor(s) that freezing turned into "
                            f"constants: %{written[0].debugName()}")
    merge_conv_sums(frozen.graph)   # after the batch-norm folds: a re-parameterizable block's branches
    _concat_shared_input_linears(frozen.graph)  # after CSE: a projection used twice is one linear
    _assign_types(frozen, inputs)
    if probes:
        _forget_run_time_sizes(frozen, inputs, probes)
    _specialize(frozen, inputs, probes)
    _unroll_constant_loops(frozen.graph)
    if probes:
        _sizes_per_use(frozen.graph, inputs, probes)
    torch._C._jit_pass_dce(frozen.graph)
    _assign_types(frozen, inputs)  # again: constant propagation made new, untyped values
    return frozen


def _fold_read_only_attributes(frozen: torch.jit.ScriptModule, preserved: list) -> None:
    """Tensor attributes freezing left as reads -> constants, where the inlined graph does not
    write them. Freezing keeps any attribute it cannot prove unwritten: F.multi_head_attention_
    forward's in_proj_weight stayed a read, an engine input instead of constant weights."""
    graph = frozen.graph
    self_value = next(iter(graph.inputs()))
    kept = written_attributes(graph) | set(preserved)
    for node in list(graph.nodes()):
        if node.kind() != "prim::GetAttr" or node.inputsAt(0) is not self_value or node.s("name") in kept:
            continue
        value = frozen._c.getattr(node.s("name"))
        if isinstance(value, torch.Tensor):
            with graph.insert_point_guard(node):
                node.output().replaceAllUsesWith(graph.insertConstant(value))
            node.destroy()


MAX_SPECIALIZE_ROUNDS = 4


def _specialize(frozen: torch.jit.ScriptModule, inputs: list, probes: list) -> None:
    """Static sizes, dtypes and tensor identities become constants, and the branches they decide
    are inlined. Inlining a branch brings its nodes (untyped until measured) to the top level,
    where they may read more of the same (F.multi_head_attention_forward checks ``query.dim()``,
    then ``key.dim()`` inside that branch): measured and specialized again, a few rounds."""
    graph = frozen.graph
    for _ in range(MAX_SPECIALIZE_ROUNDS):
        branches = len(graph.findAllNodes("prim::If"))
        _specialize_sizes(graph)
        fold_identity_tests(graph)
        torch._C._jit_pass_constant_propagation(graph)
        if len(graph.findAllNodes("prim::If")) == branches:
            return  # no branch was inlined: nothing new at the top level
        _assign_types(frozen, inputs)
        if probes:
            _forget_run_time_sizes(frozen, inputs, probes)


def _unroll_constant_loops(graph: torch.Graph) -> None:
    """Loops whose trip count the sizes fixed (a scripted F.interpolate appends its scale factor
    once per spatial dim) unrolled, and the lists they built by appends made plain lists of
    constants a lowering rule reads; loops left in the graph stay in TorchScript anyway."""
    if not any(node.kind() == "prim::Loop" for node in graph.nodes()):
        return
    torch._C._jit_pass_loop_unrolling(graph)
    torch._C._jit_pass_remove_mutation(graph)
    torch._C._jit_pass_constant_propagation(graph)


def _sizes_per_use(graph: torch.Graph, inputs: list, probes: list) -> None:
    """Run-time sizes an op reads (dynamo's SymInt graph inputs, ``aten::size``), also inside
    int lists (``expand(batch, seq)``), become an ``aten::size`` of a tensor made right before
    each op that reads them: the op can then join a cluster that computes the size from that
    tensor's shape (blade/cluster/rules/shapes.py), and no int crosses a cluster boundary. A SymInt
    input is the size of the first tensor input dim equal to it at the example and at every
    probe point; one that matches none stays as it is."""
    params = list(graph.inputs())[1:]
    points = [inputs, *probes]
    tensors = [(value, k) for k, value in enumerate(params) if isinstance(inputs[k], torch.Tensor)]
    sources = {}  # int value -> (tensor, dim) whose size it is
    for k, value in enumerate(params):
        if isinstance(value.type(), torch.IntType):
            seen = [point[k] for point in points]
            sources[value] = next(((t, d) for t, j in tensors for d in range(inputs[j].dim())
                                   if [point[j].shape[d] for point in points] == seen), None)
    for node in graph.nodes():
        if node.kind() == "aten::size" and len(list(node.inputs())) == 2 and \
                node.inputsAt(1).node().kind() == "prim::Constant":
            sources[node.output()] = (node.inputsAt(0), node.inputsAt(1).toIValue())
    sources = {value: source for value, source in sources.items() if source is not None}
    if not sources:
        return

    # int arithmetic on those sizes (``mask.size(0) * mask.size(1) // ids.size(0)``) is copied per
    # op as well, with its own sizes, so the whole computation can join the op's cluster
    derived = set()
    for node in graph.nodes():
        if is_size_arithmetic(node) and all(v in sources or v in derived or v.node().kind() == "prim::Constant"
                                            for v in node.inputs()):
            derived.add(node.output())

    def size_before(user: torch.Node, value: torch.Value) -> torch.Value:
        if value in derived:
            operands = [size_before(user, v) if v in sources or v in derived else v for v in value.node().inputs()]
            with graph.insert_point_guard(user):
                result = graph.insertNode(graph.create(value.node().kind(), operands))
            result.output().setType(torch._C.IntType.get())
            return result.output()
        tensor, dim = sources[value]
        with graph.insert_point_guard(user):
            size = graph.insertNode(graph.create("aten::size", [tensor, graph.insertConstant(dim)]))
        size.output().setType(torch._C.IntType.get())
        return size.output()

    per_use = set(sources) | derived
    for node in list(graph.nodes()):
        if node.kind() in ("prim::ListConstruct", "aten::size") or any(o in derived for o in node.outputs()):
            continue  # (the lists, sizes and their arithmetic read by ops are copied per op below)
        for i, value in enumerate(list(node.inputs())):
            producer = value.node()
            if value in per_use:
                node.replaceInput(i, size_before(node, value))
            elif producer.kind() == "prim::ListConstruct" and isinstance(value.type(), torch.ListType) and \
                    isinstance(value.type().getElementType(), torch.IntType) and \
                    any(item in per_use for item in producer.inputs()):
                items = [size_before(node, item) if item in per_use else item for item in producer.inputs()]
                with graph.insert_point_guard(node):
                    copy = graph.insertNode(graph.create("prim::ListConstruct", items))
                copy.output().setType(value.type())
                node.replaceInput(i, copy.output())


def to_torchscript(gm: torch.fx.GraphModule, example_inputs: list, freeze: bool = True,
                    probes: list = ()) -> Frontend:
    """Script (else trace) gm; a conversion counts only if the result runs on the example inputs.
    (Scripting can succeed and still fail at run time, e.g. on ``torch.tensor([])``.)

    With size symbols (example_inputs hold SymInts, or tensors with symbolic sizes), ``probes`` are
    the arguments at several values of the symbols, the first at the example's own values: the
    graph is typed at the first, and sizes that differ at the others stay computed. Tracing would
    bake every size in, so only scripting is tried."""
    errors = []
    for how, convert in CONVERTERS.items():
        if probes and how != "script":
            continue
        try:
            return _convert(gm, example_inputs, freeze, how, convert, list(probes))
        except ProbeFailed:
            raise  # the graph converts; other probe points may suit it (blade/dynamic.py)
        except Exception as err:  # noqa: BLE001 - any failure: try the next converter
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            errors.append(f"{how}: {first_line}")
            log.info("torch.jit.%s of the FX graph failed: %s", how, first_line)
    raise FrontendError("could not convert the FX graph to TorchScript; " + "; ".join(errors))


def _convert(gm: torch.fx.GraphModule, example_inputs: list, freeze: bool, how: str, convert,
             probes: list) -> Frontend:
    """Frozen inputs the graph writes are converted again as runtime inputs, so each call writes
    the caller's tensor (once) rather than a frozen copy; other attributes it writes are kept
    through freezing (which would fold a training-mode batch norm's running statistics). FX values
    TorchScript computes in another dtype than eager get a cast to eager's (then convert again)."""
    casts = _identity_casts(gm)
    values = probes[0] if probes else example_inputs
    for _ in range(MAX_CAST_ROUNDS):
        fx_module, runtime_inputs = _plain_graph_module(gm, example_inputs, freeze)
        if probes:
            _rows_kept_through_addmm(fx_module)
        scripted = convert(_cast_to(fx_module, casts), [values[i] for i in runtime_inputs])
        written = _written_attributes(scripted)
        lifted = {int(name[len(FROZEN_PREFIX):]) for name in written if name.startswith(FROZEN_PREFIX)}
        if lifted:
            fx_module, runtime_inputs = _plain_graph_module(gm, example_inputs, freeze, lifted)
            if probes:
                _rows_kept_through_addmm(fx_module)
            scripted = convert(_cast_to(fx_module, casts), [values[i] for i in runtime_inputs])
            written = _written_attributes(scripted)
        inputs = [values[i] for i in runtime_inputs]
        probe_inputs = [[probe[i] for i in runtime_inputs] for probe in probes]
        frozen = _prepare(scripted, inputs, sorted(written), probe_inputs[1:])
        diverged = {name: dtype for name, dtype in _eager_dtypes(gm, frozen.graph).items() if name not in casts}
        if not diverged:
            return Frontend(frozen, runtime_inputs, inputs, how, probe_inputs)
        casts.update(diverged)
    raise FrontendError(f"TorchScript computes {', '.join(sorted(diverged))} in another dtype than eager")


def _rows_kept_through_addmm(module: torch.fx.GraphModule) -> None:
    """``addmm(b, x.view(-1, k), w).view(*x.shape[:-1], n)`` (GPT-2's Conv1D) -> ``linear(x, w.t(), b)``.
    With run-time sizes the final view's sizes are computed (batch, seq): it could not join a
    cluster, and the 2-d GEMM's output would be a cluster output whose first dim is a product of
    size symbols. The linear computes the same product-sum per row on x's own shape."""
    changed = False
    for node in list(module.graph.nodes):
        if node.op != "call_function" or node.target is not torch.addmm or len(node.args) != 3 or node.kwargs:
            continue
        bias, flat, weight = node.args
        users = list(node.users)
        if not (isinstance(flat, torch.fx.Node) and flat.op == "call_method" and flat.target == "view"
                and len(flat.users) == 1 and len(users) == 1 and users[0].op == "call_method"
                and users[0].target == "view"):
            continue
        x, out = flat.args[0], users[0]
        shapes = [getattr(n, "meta", {}).get("example_value") for n in (x, node, out)]
        if not all(isinstance(v, torch.Tensor) for v in shapes) or shapes[0].dim() < 2 or \
                list(map(str, shapes[2].shape)) != list(map(str, (*shapes[0].shape[:-1], shapes[1].shape[-1]))):
            continue
        with module.graph.inserting_before(out):
            transposed = module.graph.call_method("t", (weight,))
            linear = module.graph.call_function(torch.nn.functional.linear, (x, transposed, bias))
        linear.meta = dict(out.meta)
        out.replace_all_uses_with(linear)
        for dead in (out, node, flat):
            module.graph.erase_node(dead)
        changed = True
    if changed:
        module.graph.eliminate_dead_code()
        module.recompile()


MAX_CAST_ROUNDS = 3
_SSA_SUFFIX = re.compile(r"\.\d+$")


def _eager_dtypes(gm: torch.fx.GraphModule, graph: torch.Graph) -> dict:
    """FX node name -> eager's dtype, for the FX values the typed TorchScript graph computes in
    another dtype. TorchScript has no bool Scalar (``bool_tensor & True`` scripts as ``& 1``:
    int64, eager bool) and freezing drops ``x * 1`` whatever x's dtype (``mask * 1``: bool, eager
    int64). Such a value holds eager's numbers (0 and 1) in another dtype, so a cast to eager's
    dtype right after it makes it, and everything computed from it, eager's again. TorchScript
    values keep their FX name (with an SSA suffix); a name that matches the wrong value only
    adds a cast that changes nothing."""
    eager = {node.name: node.meta["example_value"].dtype for node in gm.graph.nodes
             if isinstance(node.meta.get("example_value"), torch.Tensor)}
    diverged = {}
    for node in graph.nodes():
        for value in node.outputs():
            name = _SSA_SUFFIX.sub("", value.debugName())
            if name in eager and isinstance(value.type(), torch.TensorType) and \
                    value.type().dtype() not in (None, eager[name]):
                diverged[name] = eager[name]
    return diverged


# x * 1, x / 1, x + 0, x - 0 (and 1 * x, 0 + x): freezing removes them as no-ops, also where
# they change x's dtype
IDENTITY_SCALARS = {"mul": 1, "truediv": 1, "div": 1, "add": 0, "sub": 0}
COMMUTATIVE = ("mul", "add")


def _identity_casts(gm: torch.fx.GraphModule) -> dict:
    """FX node name -> eager dtype, for identity arithmetic that changes its operand's dtype
    (``mask * 1``: bool to int64). Freezing drops the node, leaving no value to check; a cast
    after it keeps eager's dtype whether or not the node survives."""
    casts = {}
    for node in gm.graph.nodes:
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if node.op not in ("call_function", "call_method") or name not in IDENTITY_SCALARS or \
                len(node.args) != 2 or node.kwargs:
            continue
        tensor, scalar = node.args if isinstance(node.args[0], torch.fx.Node) or name not in COMMUTATIVE \
            else node.args[::-1]
        value, operand = node.meta.get("example_value"), getattr(tensor, "meta", {}).get("example_value")
        if isinstance(value, torch.Tensor) and isinstance(operand, torch.Tensor) and \
                type(scalar) in (int, float) and scalar == IDENTITY_SCALARS[name] and value.dtype != operand.dtype:
            casts[node.name] = value.dtype
    return casts


def _cast_to(module: torch.fx.GraphModule, casts: dict) -> torch.fx.GraphModule:
    """module with FX node `name`'s value cast to casts[name] for all its users."""
    if not casts:
        return module
    for node in list(module.graph.nodes):
        if node.name in casts:
            with module.graph.inserting_after(node):
                cast = module.graph.call_method("to", (node, casts[node.name]))
            node.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
    module.recompile()
    return module


def _written_attributes(scripted) -> set:
    graph = scripted.graph.copy()
    torch._C._jit_pass_inline(graph)
    return written_attributes(graph)
