"""The tt_infer pipeline: FX graph -> typed TorchScript -> clusters -> engines -> spliced module.

Each stage is a function of the previous stage's output; failures stay local: a cluster that does
not lower or compile stays in TorchScript with a warning naming it and the tail of its log (the
work dir is a temp dir removed on return, unless `Config.dump_dir` keeps it), and the model runs.
With ``Config.fallback`` on, every engine also carries its cluster's TorchScript subgraph
(blade/subgraph.py); with ``Config.dump_dir`` set, every cluster's artifacts stay in
``<dump_dir>/cluster_<k>/`` (blade/dump.py).
"""
from __future__ import annotations

import logging
import operator
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch

from blade import dump
from blade.cluster.lower import lower_cluster
from blade.cluster.partition import GLUE_KINDS, partition
from blade.cluster.splice import splice
from blade.cluster.rules.base import LoweringError
from blade.config import Config
from blade.direct import direct_call
from blade.dynamic import exclusions, lower_symbolic, probe_types
from blade.engine.driver import compile_many
from blade.errors import translate_engine_error
from blade.executor import unoptimized
from blade.frontend import ProbeFailed, to_torchscript
from blade.guards import FrozenWeights, ScalarValues, first_requiring_grad, module_tensors, placeholder_names
from blade.heap import frozen_heap
from blade.progress import Progress
from blade.runtime import make_engine
from blade.shared_constants import sharing_constants
from blade.sources import fx_locations, node_location
from blade.subgraph import saved_subgraph, subgraph

log = logging.getLogger("blade")
log.addHandler(logging.NullHandler())  # quiet unless the application configures logging


@dataclass
class ClusterReport:
    name: str
    op_kinds: list
    op_count: int
    input_shapes: list
    output_shapes: list
    status: str = "pending"      # "compiled", "lowering failed", "compile failed", "engine failed"
    seconds: float = 0.0
    started: float = 0.0         # time.monotonic() when its compile started / finished
    finished: float = 0.0
    cache_hit: bool = False
    isa: str = ""                # the -march level its engine needs
    work_dir: str = ""
    log_path: str = ""
    error: str = ""
    aten_count: int = 0          # aten ops inside (what coverage counts)
    sources: list = field(default_factory=list)  # "aten::kind  path:line: code", one per op

    @property
    def ops_source(self) -> str:
        return "\n".join(f"  {line}" for line in self.sources)


@dataclass
class LeftOutNode:
    kind: str
    reason: str
    source: str = ""


@dataclass
class CompileReport:
    how: str = ""                                  # "script" or "trace"
    clusters: list = field(default_factory=list)   # ClusterReport
    left_out_nodes: list = field(default_factory=list)  # LeftOutNode, every op left in TorchScript
    aten_total: int = 0
    aten_in_engines: int = 0
    aten_in_graph: int = 0                         # aten ops still in the spliced TorchScript graph
    engine_calls: int = 0                          # engine calls in the spliced graph
    fallback: str = "off"
    dump_dir: str = ""
    size_symbols: str = ""                         # with symbolic sizes: "s0 in [2, 1024], ..."
    symbolic_refusals: list = field(default_factory=list)  # "cluster_k: why it cannot take run-time sizes"
    compile_wall_s: float = 0.0
    total_s: float = 0.0

    @property
    def coverage(self) -> float:
        return self.aten_in_engines / self.aten_total if self.aten_total else 0.0

    @property
    def left_out(self) -> list:
        """(kind, reason) of every op left in TorchScript."""
        return [(n.kind, n.reason) for n in self.left_out_nodes]


MAX_RECOMPILES = 4   # frozen weights changed more often than this: the graph runs eagerly
MAX_VARIANTS = 8     # compiles kept per graph for different frozen tensors (instances of one module)


@dataclass
class GraphSource:
    """What a live compile keeps to run its graph eagerly or compile it again (never serialized:
    a deserialized CompiledModule has engines only)."""
    gm: torch.fx.GraphModule
    config: Config
    input_names: list            # a readable name per graph input (blade/guards.py)
    attributes: dict             # parameters and buffers the graph reads as attributes
    frozen: FrozenWeights        # the tensors frozen into the engines, as they were then
    scalars: ScalarValues = None  # the wrapped Python scalars frozen too, and their values then
    example_inputs: list = field(default_factory=list)  # with size symbols: dynamo's (SymInts kept)
    symbols: object = None       # blade.dynamic.SizeSymbols of a graph compiled with run-time sizes


class CompiledModule:
    """What the backend hands to dynamo: calls the spliced ScriptModule with the runtime inputs,
    after the checks of blade/guards.py (autograd recording, frozen weights changed)."""

    signature = None  # blade.export's compile_model sets how to call it like the model (blade/signature.py)

    def __init__(self, module: torch.jit.ScriptModule, runtime_inputs: list, report: CompileReport,
                 source: GraphSource | None = None):
        self._bind(module, runtime_inputs)
        self.report = report
        self.source = source
        self._warned_eager = False
        self._recompiling = threading.Lock()
        self._recompiles = 0
        self._outside = None        # ShapeSpecialized for sizes outside the size symbols' ranges
        self._variants: list = []   # CompiledModules of this graph for other frozen tensors

    def _bind(self, module: torch.jit.ScriptModule, runtime_inputs: list) -> None:
        """The module and which of dynamo's arguments it takes, ready for __call__: its forward
        method called directly skips nn.Module.__call__'s hook machinery (ScriptModules run no
        Python hooks), and an itemgetter picks the inputs without a Python loop (together about
        1 us of the 4.6 us this class and its engine cost per call on a one-engine graph). A forward
        that is one engine call runs the engine without TorchScript (blade/direct.py, ~1.7 us);
        any other, without the graph executor's optimization (blade/executor.py)."""
        self.module, self.runtime_inputs = module, runtime_inputs
        forward = unoptimized(module.forward)
        self._forward = direct_call(module) or (lambda flat: forward(*flat))
        self._pick = picker(runtime_inputs)

    def __call__(self, *args):
        if torch.is_grad_enabled():  # the only cost under no_grad / inference_mode
            recording = first_requiring_grad(args, *self._grad_names())
            if recording is not None:
                return self._run_eagerly(args, recording)
        if self.source is not None:
            stale = self.source.frozen.changed(args)
            if stale is not None and not self._recompiled(args, stale):
                return self.source.gm(*args)
            if self.source.scalars.positions and self._scalar_changed(args):
                return self.source.gm(*args)
            if self.source.symbols is not None:
                outside = self.source.symbols.out_of_range(args)
                if outside is not None:
                    return self._per_shape(args, outside)
        try:
            return self._forward(self._pick(args))
        except RuntimeError as err:
            translated = translate_engine_error(err, self.report)
            if translated is None:
                raise
            raise translated from err

    def _per_shape(self, args, outside: str):
        """A size outside the engines' ranges (past Config.dynamic_max_size, where dynamo left
        the maximum open): such calls get one static compile per shape (blade/specialize.py)."""
        if self._outside is None:
            from blade.specialize import ShapeSpecialized  # it imports this module
            log.info("blade: %s: compiling this graph for such shapes one by one", outside)
            self._outside = ShapeSpecialized(self.source.gm, self.source.config, outside)
        return self._outside(*args)

    def _scalar_changed(self, args) -> bool:
        """A frozen Python scalar has another value now: this call runs eagerly (warned once)."""
        changed = self.source.scalars.changed(args)
        if changed is not None and not self._warned_eager:
            self._warned_eager = True
            warnings.warn(f"blade: {changed} has another value than when this graph was compiled and "
                          f"its engines hold the old one: the graph runs eagerly for such calls")
        return changed is not None

    def _grad_names(self) -> tuple:
        return (self.source.input_names, self.source.attributes) if self.source else ([], {})

    def _run_eagerly(self, args, recording: str):
        if self.source is None:
            raise RuntimeError(f"blade: autograd is recording ({recording} requires grad) but this "
                               f"deserialized compiled graph has only engines, which compute no "
                               f"gradients: call it under torch.no_grad() or torch.inference_mode()")
        if not self._warned_eager:
            self._warned_eager = True
            warnings.warn(eager_for_grad_message(recording))
        return self.source.gm(*args)

    def _recompiled(self, args, stale: str) -> bool:
        """Switch to, or compile, the variant of this graph for the frozen tensors passed now (one
        thread at a time; the others wait and find it done). dynamo hands one graph the tensors of
        every instance of a module class, so up to MAX_VARIANTS compiles are kept, one per set of
        tensors. Tensors written in place since their compile are compiled again, MAX_RECOMPILES
        times at most: False then, as weights that keep changing are better read eagerly (the
        caller runs the FX graph, always current)."""
        with self._recompiling:
            if self.source.frozen.changed(args) is None:
                return True
            fitting = next((v for v in self._variants if v.source.frozen.changed(args) is None), None)
            if fitting is not None:
                self._variants.remove(fitting)
                self._switch_to(fitting)
                return True
            written_in_place = self.source.frozen.same_objects(args)
            if written_in_place and self._recompiles >= MAX_RECOMPILES:
                if self._recompiles == MAX_RECOMPILES:
                    self._recompiles += 1
                    warnings.warn(f"blade: {stale} changed after this graph was compiled, which "
                                  f"was compiled {MAX_RECOMPILES} times already for changed weights: "
                                  f"it runs eagerly from now on (freeze_params=False keeps weights "
                                  f"out of the engines)")
                return False
            if written_in_place:
                self._recompiles += 1
                warnings.warn(f"blade: {stale} changed after this graph was compiled (written in place) "
                              f"and its engines hold the old value: compiling it again "
                              f"(freeze_params=False keeps weights out of the engines)")
            else:
                warnings.warn(f"blade: {stale} changed after this graph was compiled (another tensor is "
                              f"passed: a replaced parameter, or another instance of the module): "
                              f"compiling a variant for it (up to {MAX_VARIANTS} are kept)")
            with self.source.config:
                if self.source.symbols is not None:  # again with run-time sizes
                    inputs, symbols = self.source.symbols.with_frozen(self.source.example_inputs, list(args))
                    fresh = compile_fx(self.source.gm, inputs, self.source.config, symbols)
                else:
                    fresh = compile_fx(self.source.gm, list(args), self.source.config)
            self._switch_to(fresh, keep_current=not written_in_place)
            return True

    def _switch_to(self, variant: "CompiledModule", keep_current: bool = True) -> None:
        """Make variant's engines current; the current ones join the kept variants (newest first)."""
        if keep_current:
            current = CompiledModule(self.module, self.runtime_inputs, self.report, self.source)
            self._variants = [current, *self._variants][:MAX_VARIANTS - 1]
        self._bind(variant.module, variant.runtime_inputs)
        self.report = variant.report
        self.source = variant.source

    def engines(self) -> dict:
        """cluster name -> its torch.classes.blade.Engine, for the clusters that got one."""
        return {c.name: getattr(self.module, c.name) for c in self.report.clusters if c.status == "compiled"}


def picker(positions: list):
    """args -> the tuple of args at `positions` (itemgetter returns a bare item for one position)."""
    if len(positions) == 1:
        position = positions[0]
        return lambda args: (args[position],)
    return operator.itemgetter(*positions) if positions else (lambda args: ())


def _is_aten(node: torch.Node) -> bool:
    return node.kind().startswith("aten::") and node.kind() not in GLUE_KINDS


def _shapes(values) -> list:
    return [list(v.type().sizes() or []) for v in values]


@dataclass
class _Lowered:
    """A cluster ready to compile, with what must be read before splicing destroys its nodes."""
    cluster: object
    model: onnx.ModelProto
    fallback_module: bytes


def compile_fx(gm: torch.fx.GraphModule, example_inputs: list, config: Config, symbols=None) -> CompiledModule:
    """Compiles in <dump_dir>/ when set (kept on purpose), else in a temp dir removed on every path
    (success, failed lowering or compile, timeout, exception); warnings then carry the log tails.
    With ``symbols`` (blade.dynamic.SizeSymbols), the engines take those sizes at run time. The
    engines hold one tensor per distinct constant (also with those of the other graphs of an
    export's captures: blade/shared_constants.py). The heap alive on entry is frozen (blade/heap.py):
    lowering a large cluster at every probe point allocates enough to trigger a full collection,
    which walked the whole process (torch, sympy, the model) for 0.3 s of a dynamic GPT-2 compile."""
    with sharing_constants(), frozen_heap():
        if config.dump_dir:
            return _compile_fx_in(Path(config.dump_dir), gm, example_inputs, config, symbols)
        with tempfile.TemporaryDirectory(prefix="blade-", ignore_cleanup_errors=True) as work_root:
            return _compile_fx_in(Path(work_root), gm, example_inputs, config, symbols)


def _script(gm: torch.fx.GraphModule, example_inputs: list, config: Config, symbols=None):
    """The graph in TorchScript, typed at the symbols' probe points; when the graph fails at some,
    at the next probe points the symbols offer (blade/dynamic.py)."""
    while True:
        try:
            return to_torchscript(gm, example_inputs, config.freeze_params, probes=symbols.probes if symbols else ())
        except ProbeFailed as err:
            if not symbols.next_points():
                raise
            log.info("blade: %s; trying the probe points %s", err, symbols.points[1:])


def _compile_fx_in(work_root: Path, gm: torch.fx.GraphModule, example_inputs: list, config: Config,
                   symbols=None) -> CompiledModule:
    started = time.perf_counter()
    report = CompileReport(fallback=config.fallback, dump_dir=config.dump_dir)
    front = _script(gm, example_inputs, config, symbols)
    types_at_probes = probe_types(front) if symbols else []
    if symbols:
        symbols.fit_caps(front.graph, types_at_probes, config.dynamic_memory_budget)
    report.how = front.how
    report.size_symbols = symbols.describe() if symbols else ""
    def partition_graph(excluded_nodes=None):
        return partition(front.graph, min_cluster_size=config.min_cluster_size,
                         excluded_ops=config.excluded_ops, excluded_nodes=excluded_nodes)

    # with symbols: the partition that leaves out what cannot take run-time sizes, and its clusters' ONNX
    parts, symbolic_models = exclusions(front.graph, symbols, types_at_probes, partition_graph) if symbols \
        else (partition_graph(), {})
    # read everything reports need before splicing destroys the clustered nodes
    locations = fx_locations(gm)
    report.aten_total = sum(1 for n in parts.ops if _is_aten(n))
    report.left_out_nodes = [LeftOutNode(n.kind(), reason, node_location(n, locations))
                             for n, reason in parts.reasons.items()]
    work_root.mkdir(parents=True, exist_ok=True)

    lowered, jobs = {}, []
    cluster_reports = {}
    for cluster in parts.clusters:
        name = f"cluster_{cluster.index}"
        cluster_reports[name] = rep = ClusterReport(
            name, sorted({n.kind() for n in cluster.nodes}), cluster.op_count,
            _shapes(cluster.inputs), _shapes(cluster.outputs), work_dir=str(work_root / name),
            aten_count=sum(1 for n in cluster.nodes if _is_aten(n)),
            sources=[f"{n.kind():<24} {node_location(n, locations)}".rstrip()
                     for n in cluster.nodes if n.kind() not in GLUE_KINDS])
        cluster_dir = work_root / name
        cluster_dir.mkdir(parents=True, exist_ok=True)
        graph = subgraph(cluster)
        fallback_module = saved_subgraph(graph) if config.fallback != "off" or config.dump_dir else b""
        dump.write_subgraph(cluster_dir, graph, fallback_module)
        try:
            model = symbolic_models.get(name) or (
                lower_symbolic(cluster, name, symbols, types_at_probes) if symbols else lower_cluster(cluster, name))
        except LoweringError as err:
            rep.status, rep.error = "lowering failed", str(err)
            warnings.warn(f"blade: {name} could not be lowered to ONNX and stays in TorchScript: {err}")
            continue
        if symbols:
            rep.input_shapes, rep.output_shapes = onnx_shapes(model.graph.input), onnx_shapes(model.graph.output)
        onnx_path = cluster_dir / f"{name}.onnx"
        onnx.save(model, onnx_path)
        lowered[name] = _Lowered(cluster, model, fallback_module)
        jobs.append((name, str(onnx_path), str(cluster_dir)))

    compile_options = {"isa": config.target_isa, "cxx": config.cxx,
                       "extra_flags": ["-DBLADE_PROFILE"] if config.profile else []}
    compile_started = time.perf_counter()
    progress = Progress(len(jobs), enabled=config.progress)
    results = compile_many(jobs, parallelism=config.compile_parallelism,
                           timeout_s=config.compile_timeout_s, options=compile_options,
                           cache_dir=config.cache_dir if config.use_cache else None,
                           cache_max_bytes=config.cache_max_bytes, on_result=progress)
    progress.close()
    report.compile_wall_s = time.perf_counter() - compile_started

    spliced, replaced = set(), {}
    for result in results:
        rep = cluster_reports[result.name]
        rep.seconds, rep.cache_hit = result.seconds, result.cache_hit
        rep.log_path = result.log_path if config.dump_dir else ""  # a temp work dir is gone on return
        log_note = f" (log: {result.log_path})" if config.dump_dir else ""
        rep.started, rep.finished = result.started, result.finished
        rep.isa = result.manifest.isa if result.manifest else ""
        if config.dump_dir:
            dump.write_compile_artifacts(Path(result.work_dir), result, compile_options)
        if not result.ok:
            rep.status, rep.error = "compile failed", result.error or ""
            if symbols and "run-time sizes" in (result.error or ""):  # the engine's slice of them
                report.symbolic_refusals.append(f"{result.name}: {(result.error or '').strip().splitlines()[-1]}")
                continue
            warnings.warn(f"blade: {result.name} failed to compile and stays in TorchScript: "
                          f"{result.error}{log_note}")
            continue
        done = lowered[result.name]
        try:
            engine = make_engine(result.name, Path(result.so_path).read_bytes(), result.manifest, done.model,
                                 {"cluster": result.name, "ops": rep.op_kinds},
                                 fallback_module=done.fallback_module if config.fallback != "off" else b"",
                                 fallback_mode=config.fallback, rtol=config.rtol, atol=config.atol,
                                 ops_source=rep.ops_source)
        except Exception as err:  # noqa: BLE001 - a bad .so must not take the model down
            rep.status, rep.error = "engine failed", str(err)
            warnings.warn(f"blade: the engine of {result.name} could not be loaded; the cluster "
                          f"stays in TorchScript: {err}{log_note}")
            continue
        splice(front.module, done.cluster, engine, result.name, replaced)
        rep.status = "compiled"
        report.aten_in_engines += rep.aten_count
        spliced.add(result.name)

    _finish_graph(front.module.graph)
    report.clusters = list(cluster_reports.values())
    report.left_out_nodes += _failed_cluster_nodes(report.clusters, parts, locations)
    report.aten_in_graph = sum(1 for n in front.module.graph.nodes() if _is_aten(n))
    report.engine_calls = sum(1 for n in front.module.graph.nodes()
                              if n.kind() == "prim::CallMethod" and n.s("name") == "execute")
    report.total_s = time.perf_counter() - started
    log.info("blade: %d/%d aten ops in %d engine(s), compiled in %.2fs (total %.2fs)",
             report.aten_in_engines, report.aten_total, len(spliced), report.compile_wall_s, report.total_s)
    return CompiledModule(front.module, front.runtime_inputs, report,
                          _source(gm, example_inputs, front.runtime_inputs, config, symbols))


def _source(gm: torch.fx.GraphModule, example_inputs: list, runtime_inputs: list, config: Config,
            symbols=None) -> GraphSource:
    return GraphSource(gm, config, placeholder_names(gm), module_tensors(gm),
                       FrozenWeights.of(gm, example_inputs, runtime_inputs),
                       ScalarValues.of(gm, example_inputs, runtime_inputs),
                       list(example_inputs) if symbols else [], symbols)


def onnx_shapes(values) -> list:
    """Shapes of ONNX graph inputs/outputs, run-time dims by their dim_param."""
    return [[d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values]


def eager_for_grad_message(recording: str) -> str:
    return (f"blade: this graph runs eagerly: autograd is recording (grad is enabled and {recording} "
            f"requires grad) and engines compute no gradients; call the model under torch.no_grad() "
            f"or torch.inference_mode() to run its engines")


def _failed_cluster_nodes(clusters: list, parts, locations: dict) -> list:
    """The ops of clusters that got no engine: left in TorchScript, the reason names the log."""
    failed = {c.name: c for c in clusters if c.status != "compiled"}
    nodes = []
    for cluster in parts.clusters:
        rep = failed.get(f"cluster_{cluster.index}")
        if rep is None:
            continue
        where = f"log: {rep.log_path}" if rep.log_path else rep.error.splitlines()[0] if rep.error else ""
        nodes += [LeftOutNode(n.kind(), f"{rep.status} ({rep.name}; {where})", node_location(n, locations))
                  for n in cluster.nodes if n.kind() not in GLUE_KINDS]
    return nodes


def _finish_graph(graph: torch.Graph) -> None:
    torch._C._jit_pass_dce(graph)
    torch._C._jit_pass_lint(graph)
