"""The tt_infer pipeline: FX graph -> typed TorchScript -> clusters -> engines -> spliced module.

Each stage is a function of the previous stage's output; failures stay local: a cluster that does
not lower or compile stays in TorchScript with a warning naming it and its log, and the model runs.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch

from blade.cluster.lower import lower_cluster
from blade.cluster.partition import GLUE_KINDS, Partition, partition
from blade.cluster.splice import splice
from blade.cluster.support import LoweringError
from blade.config import Config
from blade.engine.driver import compile_many
from blade.frontend import to_torchscript
from blade.runtime import make_engine

log = logging.getLogger("blade")


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


@dataclass
class CompileReport:
    how: str = ""                                  # "script" or "trace"
    clusters: list = field(default_factory=list)   # ClusterReport
    left_out: list = field(default_factory=list)   # (kind, reason)
    aten_total: int = 0
    aten_in_engines: int = 0
    compile_wall_s: float = 0.0
    total_s: float = 0.0

    @property
    def coverage(self) -> float:
        return self.aten_in_engines / self.aten_total if self.aten_total else 0.0


class CompiledModule:
    """What the backend hands to dynamo: calls the spliced ScriptModule with the runtime inputs."""

    def __init__(self, module: torch.jit.ScriptModule, runtime_inputs: list, report: CompileReport):
        self.module = module
        self.runtime_inputs = runtime_inputs
        self.report = report

    def __call__(self, *args):
        return self.module(*[args[i] for i in self.runtime_inputs])


def _is_aten(node: torch.Node) -> bool:
    return node.kind().startswith("aten::") and node.kind() not in GLUE_KINDS


def _shapes(values) -> list:
    return [list(v.type().sizes() or []) for v in values]


def compile_fx(gm: torch.fx.GraphModule, example_inputs: list, config: Config) -> CompiledModule:
    started = time.perf_counter()
    report = CompileReport()
    front = to_torchscript(gm, example_inputs, config.freeze_params)
    report.how = front.how
    parts = partition(front.graph, min_cluster_size=config.min_cluster_size,
                      excluded_ops=config.excluded_ops)
    # read everything reports need before splicing destroys the clustered nodes
    report.aten_total = sum(1 for n in parts.ops if _is_aten(n))
    report.left_out = [(n.kind(), reason) for n, reason in parts.reasons.items()]
    work_root = Path(config.dump_dir) if config.dump_dir else Path(tempfile.mkdtemp(prefix="blade-"))
    work_root.mkdir(parents=True, exist_ok=True)

    lowered, jobs = {}, []
    cluster_reports = {}
    for cluster in parts.clusters:
        name = f"cluster_{cluster.index}"
        cluster_reports[name] = rep = ClusterReport(
            name, sorted({n.kind() for n in cluster.nodes}), cluster.op_count,
            _shapes(cluster.inputs), _shapes(cluster.outputs), work_dir=str(work_root / name))
        (work_root / name).mkdir(parents=True, exist_ok=True)
        (work_root / name / "subgraph.txt").write_text("".join(str(n) for n in cluster.nodes))
        try:
            model = lower_cluster(cluster, name)
        except LoweringError as err:
            rep.status, rep.error = "lowering failed", str(err)
            warnings.warn(f"blade: {name} could not be lowered to ONNX and stays in TorchScript: {err}")
            continue
        onnx_path = work_root / name / f"{name}.onnx"
        onnx.save(model, onnx_path)
        lowered[name] = (cluster, model)
        jobs.append((name, str(onnx_path), str(work_root / name)))

    compile_started = time.perf_counter()
    results = compile_many(jobs, parallelism=config.compile_parallelism,
                           timeout_s=config.compile_timeout_s,
                           options={"isa": config.target_isa, "cxx": config.cxx},
                           cache_dir=config.cache_dir if config.use_cache else None,
                           cache_max_bytes=config.cache_max_bytes)
    report.compile_wall_s = time.perf_counter() - compile_started

    spliced, replaced = set(), {}
    for result in results:
        rep = cluster_reports[result.name]
        rep.seconds, rep.cache_hit, rep.log_path = result.seconds, result.cache_hit, result.log_path
        rep.started, rep.finished = result.started, result.finished
        rep.isa = result.manifest.isa if result.manifest else ""
        if not result.ok:
            rep.status, rep.error = "compile failed", result.error or ""
            warnings.warn(f"blade: {result.name} failed to compile and stays in TorchScript: "
                          f"{result.error} (log: {result.log_path})")
            continue
        cluster, model = lowered[result.name]
        try:
            engine = make_engine(result.name, Path(result.so_path).read_bytes(), result.manifest, model,
                                 {"cluster": result.name, "ops": rep.op_kinds})
        except Exception as err:  # noqa: BLE001 - a bad .so must not take the model down
            rep.status, rep.error = "engine failed", str(err)
            warnings.warn(f"blade: the engine of {result.name} could not be loaded; the cluster "
                          f"stays in TorchScript: {err} (log: {result.log_path})")
            continue
        aten_inside = sum(1 for n in cluster.nodes if _is_aten(n))
        splice(front.module, cluster, engine, result.name, replaced)
        rep.status = "compiled"
        report.aten_in_engines += aten_inside
        spliced.add(result.name)

    _finish_graph(front.module.graph)
    report.clusters = list(cluster_reports.values())
    report.total_s = time.perf_counter() - started
    if not config.dump_dir:
        _remove_successful(work_root, spliced, cluster_reports)
    log.info("blade: %d/%d aten ops in %d engine(s), compiled in %.2fs (total %.2fs)",
             report.aten_in_engines, report.aten_total, len(spliced), report.compile_wall_s, report.total_s)
    return CompiledModule(front.module, front.runtime_inputs, report)


def _finish_graph(graph: torch.Graph) -> None:
    torch._C._jit_pass_dce(graph)
    torch._C._jit_pass_lint(graph)


def _remove_successful(work_root: Path, spliced: set, reports: dict) -> None:
    """Keep only what explains a failure (its log); the rest of a temp work dir goes away."""
    for name in spliced:
        shutil.rmtree(work_root / name, ignore_errors=True)
    if not os.listdir(work_root):
        shutil.rmtree(work_root, ignore_errors=True)
