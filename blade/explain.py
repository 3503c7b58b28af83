"""blade.explain(model, *example_inputs): what tt_infer does with a model, as a printable report.

Per graph dynamo captured: every cluster (op kinds, input/output shapes, source lines, compile
time, cache hit), every op left in TorchScript with its reason, and coverage, the share of aten
ops inside engines, checked against the engine calls really present in the spliced graph. Plus
the graph breaks dynamo reports (torch._dynamo.explain).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from blade.config import Config
from blade.debug import CapturingBackend
from blade.frontend import module_state, state_restored


@dataclass
class Explanation:
    reports: list                                    # CompileReport per graph, in order
    graph_breaks: list = field(default_factory=list)  # str, one per break dynamo reported

    @property
    def aten_total(self) -> int:
        return sum(r.aten_total for r in self.reports)

    @property
    def aten_in_engines(self) -> int:
        return sum(r.aten_in_engines for r in self.reports)

    @property
    def coverage(self) -> float:
        return self.aten_in_engines / self.aten_total if self.aten_total else 0.0

    @property
    def engines(self) -> int:
        """Engine calls in the spliced graphs (counted in the graphs, not in the reports)."""
        return sum(r.engine_calls for r in self.reports)

    def __str__(self) -> str:
        lines = [f"blade.explain: {len(self.reports)} graph(s), {len(self.graph_breaks)} graph break(s), "
                 f"{self.engines} engine(s); coverage {self.aten_in_engines}/{self.aten_total} aten ops "
                 f"in engines = {100 * self.coverage:.1f}%"]
        lines += [f"  graph break: {reason}" for reason in self.graph_breaks]
        for index, report in enumerate(self.reports):
            lines += _graph_lines(index, report)
        return "\n".join(lines)


def _graph_lines(index: int, report) -> list:
    lines = [f"", f"graph {index} ({report.how}): {report.engine_calls} engine(s), "
             f"{report.aten_in_engines}/{report.aten_total} aten ops in engines ({100 * report.coverage:.1f}%), "
             f"{report.aten_in_graph} left in TorchScript; compile {report.compile_wall_s:.2f} s wall, "
             f"total {report.total_s:.2f} s"]
    if report.size_symbols:
        lines.append(f"  size symbols: {report.size_symbols}")
    lines += [f"  run-time sizes refused: {refusal}" for refusal in report.symbolic_refusals]
    for c in report.clusters:
        cache = "cache hit" if c.cache_hit else "cache miss"
        lines.append(f"  {c.name}: {c.status}, {c.op_count} ops ({c.aten_count} aten), {c.seconds:.2f} s, {cache}")
        lines.append(f"    ops:     {', '.join(k.replace('aten::', '') for k in c.op_kinds)}")
        lines.append(f"    inputs:  {_shape_list(c.input_shapes)}")
        lines.append(f"    outputs: {_shape_list(c.output_shapes)}")
        if c.status != "compiled":
            log = f" (log: {c.log_path})" if c.log_path else ""  # kept only with dump_dir
            lines.append(f"    error:   {c.error.splitlines()[0] if c.error else ''}{log}")
        lines += [f"    {source}" for source in _unique(c.sources)]
    if report.left_out_nodes:
        lines.append(f"  left in TorchScript ({len(report.left_out_nodes)} ops):")
        groups = Counter((n.kind, n.reason) for n in report.left_out_nodes)
        where = {}
        for n in report.left_out_nodes:
            where.setdefault((n.kind, n.reason), []).append(n.source)
        for (kind, reason), count in groups.most_common():
            places = [p for p in _unique(where[(kind, reason)]) if p]
            at = f" at {places[0]}" + (f" (+{len(places) - 1} more)" if len(places) > 1 else "") if places else ""
            lines.append(f"    {count:4d} x {kind}: {reason}{at}")
    return lines


def _shape_list(shapes: list) -> str:
    return ", ".join("[" + ", ".join(map(str, s)) + "]" for s in shapes) or "-"


def _unique(items) -> list:
    return list(dict.fromkeys(items))


def explain(model, *example_inputs, dynamic: bool = False, **options) -> Explanation:
    """Compiles model for these inputs as torch.compile(backend="tt_infer", options=options)
    would, runs it once, and reports what happened. The model's state and the inputs are left as
    they were (dynamo's explain and the compiled call each run the model once). ``dynamic=True``
    compiles as ``torch.compile(dynamic=True)`` does: every size symbolic, engines taking sizes
    at run time (blade/dynamic.py); each graph then names its size symbols and ranges."""
    config = Config.from_options(options)
    inputs = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    with torch.no_grad(), state_restored(module_state(model) + inputs):
        dynamo_view = torch._dynamo.explain(model)(*example_inputs)
        torch._dynamo.reset()
        backend = CapturingBackend(config)
        torch.compile(model, backend=backend, dynamic=dynamic)(*example_inputs)
    breaks = [f"{b.reason}" + (f" ({b.user_stack[-1].filename}:{b.user_stack[-1].lineno})"
                               if getattr(b, "user_stack", None) else "")
              for b in dynamo_view.break_reasons]
    return Explanation(backend.reports(), breaks)
