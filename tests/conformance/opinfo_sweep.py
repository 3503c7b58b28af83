"""Differential sweep: PyTorch's OpInfo samples through tt_infer (engines forced on) vs eager.

Each case is one (op, dtype, sample) from ``torch.testing._internal.common_methods_invocations.op_db``:
``fn(*tensors)`` calls the op on the sample with every tensor as a graph input, compiled with
``tt_infer`` and ``min_cluster_size=1`` so even one-op graphs get an engine. A case compares the
outputs and the inputs after the call (mutation) with eager, and records whether an engine ran.
Expected failures live in ``expected_failures.py``; a case of a listed group that passes is an
XPASS, a failure of that table.

    python -m tests.conformance.opinfo_sweep --out bench/CONFORMANCE.md [--ops add,div] [--samples 2] [--resume]
        [--suites opinfo,composite]     (--ops composite:permute: that kind's composite cases)

By default every op runs its first sample on float32 (on every dtype it supports, for the few ops
without float32), and the ops where such a case reached an engine run every dtype and --samples
samples (--exhaustive: every op that way; hours on 2 cores). Then every case of the composite
table (composite_cases.py) runs: hand-written graphs, one or more per lowering-table kind, that
OpInfo's one-op graphs cannot give an engine (a view returned as is, an aten spelling OpInfo's
wrapper does not produce); such a case passes only when an engine computed its kind.

The CLI runs the cases in a worker subprocess that streams one JSON line per case; when a worker
dies or hangs, its current case is recorded as a crash and a new worker continues after it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
import warnings
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch._dynamo
from torch.utils import _pytree as pytree

from .expected_failures import expected_failure

DTYPES = {"f32": torch.float32, "f64": torch.float64, "i32": torch.int32, "i64": torch.int64, "bool": torch.bool}
# rtol, atol per dtype; integers and bool compare exactly
TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-7, 1e-7)}
OPTIONS = {"min_cluster_size": 1, "compile_parallelism": 1, "compile_timeout_s": 120.0, "progress": False}
# Outputs that are uninitialized memory or random draws: eager is no reference for them.
UNDEFINED_OUTPUT_OPS = ("empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
                        "empty_permuted", "bernoulli", "normal", "multinomial", "rand_like", "randn_like",
                        "randint_like", "randint", "uniform", "nn.functional.dropout", "nn.functional.dropout2d",
                        "nn.functional.dropout3d", "nn.functional.alpha_dropout",
                        "nn.functional.feature_alpha_dropout", "nn.functional.rrelu", "cauchy", "exponential",
                        "geometric", "log_normal", "nn.functional.fractional_max_pool2d",
                        "nn.functional.fractional_max_pool3d", "torch.ops.aten._efficientzerotensor")
REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER_SILENCE_S = 300   # a worker that reports nothing for this long is hung: kill it


@dataclass
class CaseResult:
    op: str
    dtype: str
    sample: int
    status: str          # pass | mismatch | mutation | refused | error | crash | skip
    engine: bool = False  # an engine call was in the compiled graph(s) that ran
    detail: str = ""
    seconds: float = 0.0
    engine_ops: list = field(default_factory=list)  # the op kinds those engines computed
    kind: str = ""       # a composite case: the kind an engine must compute (else "refused")

    @property
    def failed(self) -> bool:
        return self.status in FAILED


FAILED = ("mismatch", "mutation", "refused", "error", "crash")
# What expected_failures.py may excuse: a kind left in TorchScript. Never a wrong result, nor an
# exception or crash (tt_infer must not raise).
EXPECTABLE = ("refused",)


def op_name(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def op_db() -> list:
    from torch.testing._internal.common_methods_invocations import op_db as database
    return list(database)


def _extra_reference_inputs(op, dtype: torch.dtype):
    """The samples reference_inputs adds after sample_inputs: extremal, large and edge values."""
    regular = sum(1 for _ in op.sample_inputs("cpu", dtype, requires_grad=False))
    torch.manual_seed(0)
    return itertools.islice(op.reference_inputs("cpu", dtype, requires_grad=False), regular, None)


SAMPLE_SOURCES = {
    "sample": lambda op, dtype: op.sample_inputs("cpu", dtype, requires_grad=False),
    "reference": _extra_reference_inputs,
}


def samples_of(op, dtype: torch.dtype, limit, source: str = "sample") -> list:
    """The first `limit` (None: all) CPU samples of op for dtype (seeded: the same tensors on every run)."""
    if dtype not in op.supported_dtypes("cpu"):
        return []
    torch.manual_seed(0)
    try:
        found = []
        for sample in SAMPLE_SOURCES[source](op, dtype):
            found.append(sample)
            if len(found) == limit:
                break
        return found
    except Exception:  # noqa: BLE001 - an op whose generator fails on CPU has no cases
        return []


# ---------------------------------------------------------------------------------------------
# One case
# ---------------------------------------------------------------------------------------------

class Recorder:
    """A tt_infer backend that remembers whether the graphs it compiled hold engine calls."""

    def __init__(self):
        self.engine_calls = 0
        self.engine_ops: set = set()
        self.fallbacks: list = []
        self.left_out: dict = {}  # kind -> why the first such op stayed in TorchScript

    def __call__(self, gm, example_inputs):
        from blade.dynamo import tt_infer
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = tt_infer(gm, example_inputs, options=OPTIONS)
        report = getattr(result, "report", None)
        if report is None:
            self.fallbacks += [str(w.message) for w in caught if "tt_infer could not compile" in str(w.message)]
        else:
            self.engine_calls += report.engine_calls
            self.engine_ops |= {kind for c in report.clusters if c.status == "compiled" for kind in c.op_kinds}
            for node in report.left_out_nodes:
                self.left_out.setdefault(node.kind, node.reason)
        return result

    def why_not(self, kind: str) -> str:
        """Why no engine computed `kind` in the graphs compiled so far."""
        if kind in self.left_out:
            return f"{kind} left in TorchScript: {self.left_out[kind]}"
        if self.fallbacks:
            return "; ".join(self.fallbacks)
        return f"{kind} is not in the graph blade compiled (dynamo or the frontend turned it into other ops)"


def as_graph_function(op, sample):
    """(fn, tensors): fn(*tensors) calls the op on the sample, every tensor a graph input."""
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def fn(*tensors):
        filled = list(leaves)
        for position, tensor in zip(positions, tensors):
            filled[position] = tensor
        inp, args, kwargs = pytree.tree_unflatten(filled, spec)
        return op.op(inp, *args, **kwargs)
    return fn, [leaves[i] for i in positions]


def _clones(tensors: list) -> list:
    """Copies with the sizes, strides and storage offsets of the originals (Tensor.clone makes a
    non-dense input contiguous) and views of one storage still sharing one copied storage; sparse
    tensors, which have no storage to copy, through clone."""
    from blade.frontend import copied_tensors
    copies = iter(copied_tensors([t for t in tensors if t.layout == torch.strided]))
    return [next(copies) if t.layout == torch.strided else t.clone() for t in tensors]


def _leaves(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _leaves(item)]
    if isinstance(value, dict):
        return _leaves(list(value.values()))
    return [value]


def compare(actual, expected, what: str):
    """None when equal within the dtype's tolerance (NaN positions equal), else the difference."""
    got, want = _leaves(actual), _leaves(expected)
    if len(got) != len(want):
        return f"{what}: {len(got)} values, eager has {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if not isinstance(w, torch.Tensor):
            if g != w and not (g != g and w != w):
                return f"{what} {i}: {g!r} vs eager {w!r}"
            continue
        if not isinstance(g, torch.Tensor):
            return f"{what} {i}: {type(g).__name__}, eager has a tensor"
        rtol, atol = TOLERANCES.get(w.dtype, (0.0, 0.0))
        try:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True, check_stride=False)
        except AssertionError as err:
            return f"{what} {i}: " + " ".join(str(err).split("\n")[:4])[:300]
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip().split("\n")[0]
    return f"{type(err).__name__}: {text}"[:300]


def run_case(op, dtype_name: str, index: int, sample) -> CaseResult:
    """Compile op on one sample with engines forced on; compare outputs and inputs with eager.
    A composite case (an op with an ``engine_kind``) that matches eager without an engine
    computing that kind is "refused", with the reason blade gave."""
    kind = getattr(op, "engine_kind", "")
    result = CaseResult(op_name(op), dtype_name, index, "skip", kind=kind)
    started = time.perf_counter()
    torch._dynamo.reset()
    recorder = Recorder()
    try:
        result.status, result.detail = _differential(op, sample, recorder)
        result.engine, result.engine_ops = recorder.engine_calls > 0, sorted(recorder.engine_ops)
        if kind and result.status == "pass" and kind not in recorder.engine_ops:
            result.status, result.detail = "refused", recorder.why_not(kind)[:300]
    finally:
        torch._dynamo.reset()
        result.seconds = round(time.perf_counter() - started, 3)
    return result


def _differential(op, sample, recorder: Recorder) -> tuple[str, str]:
    if op.name in UNDEFINED_OUTPUT_OPS:
        return "skip", "outputs are random or uninitialized"
    fn, tensors = as_graph_function(op, sample)
    eager_inputs, compiled_inputs = _clones(tensors), _clones(tensors)
    with torch.no_grad():
        try:
            expected = fn(*eager_inputs)
        except Exception as err:  # noqa: BLE001 - eager itself rejects the sample
            return "skip", "eager raises " + _first_line(err)
        try:
            actual = torch.compile(fn, backend=recorder, dynamic=False)(*compiled_inputs)
        except Exception as err:  # noqa: BLE001 - recorded, the sweep goes on
            return "error", _first_line(err)
    difference = compare(actual, expected, "output")
    if difference:
        return "mismatch", difference
    difference = compare(compiled_inputs, eager_inputs, "input after the call")
    if difference:
        return "mutation", difference
    return "pass", "; ".join(recorder.fallbacks)[:300]


# ---------------------------------------------------------------------------------------------
# Enumeration and classification
# ---------------------------------------------------------------------------------------------

def cases(ops: list, dtypes: list, limit: int, source: str = "sample", probe: bool = False):
    """(op, dtype name, sample index, sample) for every op, dtype and sample (up to limit);
    probe: only float32 of the ops that support it (dtypes is then the fallback for the others)."""
    for op in ops:
        for dtype_name in probe_dtypes(op, dtypes) if probe else dtypes:
            for index, sample in enumerate(samples_of(op, DTYPES[dtype_name], limit, source)):
                yield op, dtype_name, index, sample


def probe_dtypes(op, dtypes: list) -> list:
    """float32 when op supports it, else every one of dtypes it supports (bitwise ops: ints, bool)."""
    supported = op.supported_dtypes("cpu")
    return ["f32"] if torch.float32 in supported else [d for d in dtypes if DTYPES[d] in supported]


def classify(results: list) -> dict:
    """Per (op, dtype) group: PASS, FAIL (an unlisted failure, or any but a refusal), XFAIL (listed,
    refused), XPASS (listed, passes)."""
    groups = defaultdict(list)
    for r in results:
        groups[(r.op, r.dtype)].append(r)
    verdicts = {}
    for (op, dtype), members in groups.items():
        failed = any(r.failed for r in members)
        listed = expected_failure(op, dtype) is not None
        ran = any(r.status != "skip" for r in members)
        if not ran:
            verdicts[(op, dtype)] = "SKIP"
        elif any(r.failed and r.status not in EXPECTABLE for r in members):
            verdicts[(op, dtype)] = "FAIL"   # listed or not
        elif listed:
            verdicts[(op, dtype)] = "XFAIL" if failed else "XPASS"
        else:
            verdicts[(op, dtype)] = "FAIL" if failed else "PASS"
    return verdicts


# ---------------------------------------------------------------------------------------------
# The whole sweep: worker subprocesses streaming JSON lines, a parent that survives their crashes
# ---------------------------------------------------------------------------------------------

def _case_key(op: str, dtype: str, index: int) -> str:
    return f"{op}|{dtype}|{index}"


def suite_ops(suite: str) -> list:
    """The cases' ops of a suite: OpInfo's database, or the composite table (op-like objects)."""
    if suite == "composite":
        from .composite_cases import COMPOSITE_CASES
        return list(COMPOSITE_CASES)
    return op_db()


SUITES = ("opinfo", "composite")


def worker(ops_filter: list, dtypes: list, limit: int, source: str, done_file: Path, suite: str = "opinfo",
           probe: bool = False) -> None:
    """Run every case not yet in done_file, appending a 'start' line before and a result after.
    A composite case runs all its samples: each is an edge it was written for."""
    import blade  # noqa: F401  (registers tt_infer)
    done = set()
    if done_file.exists():
        for line in done_file.read_text().splitlines():
            record = json.loads(line)
            if record["status"] != "start":
                done.add(_case_key(record["op"], record["dtype"], record["sample"]))
    selected = [op for op in suite_ops(suite)
                if not ops_filter or op_name(op) in ops_filter or op.name in ops_filter]
    with open(done_file, "a") as out:
        for op, dtype, index, sample in cases(selected, dtypes, limit if suite == "opinfo" else None, source, probe):
            key = _case_key(op_name(op), dtype, index)
            if key in done:
                continue
            out.write(json.dumps({"op": op_name(op), "dtype": dtype, "sample": index, "status": "start"}) + "\n")
            out.flush()
            result = run_case(op, dtype, index, sample)
            out.write(json.dumps(asdict(result)) + "\n")
            out.flush()
    print("worker done", flush=True)


def run_plan(ops_filter: list, dtypes: list, limit: int, source: str, results_file: Path, exhaustive: bool,
             suites=SUITES) -> list:
    """The named ops (or, exhaustive, all of op_db) over every dtype and `limit` samples; by default
    phases that fit a small machine: every op on its first sample of float32 (or, without float32,
    of each dtype it supports), then every dtype and `limit` samples of the ops where such a case
    ran an engine (the others never reach one). Then the composite table, every case."""
    results = []
    if "opinfo" in suites:
        if ops_filter or exhaustive:
            results = run_sweep(ops_filter, dtypes, limit, source, results_file)
        else:
            probed = run_sweep([], dtypes, 1, source, results_file, probe=True)
            engine_ops = sorted({r.op for r in probed if r.engine})
            results = run_sweep(engine_ops, dtypes, limit, source, results_file)
    if "composite" in suites:
        results = run_sweep(ops_filter, dtypes, limit, source, results_file, suite="composite")
    return results


def run_sweep(ops_filter: list, dtypes: list, limit: int, source: str, results_file: Path, suite: str = "opinfo",
              probe: bool = False) -> list:
    """Workers until every case has a result; a dead or silent worker's case becomes a crash."""
    while True:
        command = [sys.executable, "-m", "tests.conformance.opinfo_sweep", "--worker",
                   "--results", str(results_file), "--samples", str(limit), "--dtypes", ",".join(dtypes),
                   "--inputs", source, "--suites", suite] + (["--probe"] if probe else [])
        if ops_filter:
            command += ["--ops", ",".join(ops_filter)]
        worker_log = results_file.with_name(results_file.name + ".worker.log")  # what a dead worker said
        with open(worker_log, "w") as log:
            proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
            finished = _watch(proc, results_file)
        if finished:
            return load_results(results_file)
        _record_crash(results_file, "worker died" if proc.returncode else "worker hung", worker_log)


def _watch(proc: subprocess.Popen, results_file: Path) -> bool:
    """Wait for the worker; kill it when it stays silent too long. True when it finished cleanly."""
    last_size, last_change = -1, time.monotonic()
    while proc.poll() is None:
        size = results_file.stat().st_size if results_file.exists() else 0
        if size != last_size:
            last_size, last_change = size, time.monotonic()
        elif time.monotonic() - last_change > WORKER_SILENCE_S:
            proc.kill()
            proc.wait()
            return False
        time.sleep(2)
    return proc.returncode == 0 and "worker done" in (proc.stdout.read() if proc.stdout else "")


def _record_crash(results_file: Path, why: str, worker_log: Path) -> None:
    """The last case that started without a result gets a crash result, so the next worker skips it."""
    lines = results_file.read_text().splitlines() if results_file.exists() else []
    if not lines:
        tail = "\n".join(worker_log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"the sweep worker failed before its first case ({why}); {worker_log} ends:\n{tail}")
    last = json.loads(lines[-1])
    if last["status"] != "start":
        return
    crash = CaseResult(last["op"], last["dtype"], last["sample"], "crash", detail=why)
    with open(results_file, "a") as out:
        out.write(json.dumps(asdict(crash)) + "\n")


def load_results(results_file: Path) -> list:
    results = {}
    for line in results_file.read_text().splitlines():
        record = json.loads(line)
        if record["status"] != "start":
            results[_case_key(record["op"], record["dtype"], record["sample"])] = CaseResult(**record)
    return list(results.values())


# ---------------------------------------------------------------------------------------------
# The summary table
# ---------------------------------------------------------------------------------------------

def failure_class(result: CaseResult) -> str:
    """A short bucket for a failure: status plus the exception type or the first words."""
    if result.status in ("mismatch", "mutation", "crash", "refused"):
        return result.status
    return "error: " + result.detail.split(":")[0]


def summary(results: list, seconds: float, command: str) -> str:
    verdicts = classify(results)
    ran = [r for r in results if r.status != "skip"]
    groups = Counter(verdicts.values())
    opinfo = [r for r in results if not r.kind]
    lines = [
        "# OpInfo conformance sweep (tt_infer, min_cluster_size=1, vs eager)",
        "",
        f"Generated by `{command}`{_duration(seconds, results)}. Dtypes "
        f"{', '.join(d for d in DTYPES if any(r.dtype == d for r in results))}, up to "
        f"{1 + max((r.sample for r in opinfo), default=0)} OpInfo samples per op and dtype. The default plan "
        "runs every op's first float32 sample (each supported dtype's, for ops without float32), then every "
        "dtype of the ops where such a case reached an engine; then every case of the composite table "
        "(composite_cases.py: graphs written to put one lowering-table kind in an engine, with edge shapes; "
        "a composite case whose kind stayed in TorchScript is `refused`, a failure).",
        "",
        "| cases from | ops | ops reaching an engine | cases | ran | passed | engine ran | "
        "skipped (eager raises / undefined) |",
        "|---|---|---|---|---|---|---|---|",
        _table_row("OpInfo", opinfo),
        _table_row("composite", [r for r in results if r.kind]),
        "",
        "Per (op, dtype) group: " + ", ".join(f"{v} {groups[v]}" for v in ("PASS", "XFAIL", "FAIL", "XPASS", "SKIP")),
        "",
        "## Failed cases by class",
        "",
        "| class | cases | cases with an engine | listed (xfail) | ops |",
        "|---|---|---|---|---|",
    ]
    by_class = defaultdict(list)
    for r in ran:
        if r.failed:
            by_class[failure_class(r)].append(r)
    for name, members in sorted(by_class.items(), key=lambda kv: -len(kv[1])):
        listed = [r for r in members if expected_failure(r.op, r.dtype) is not None]
        names = sorted({r.op for r in members})
        shown = ", ".join(names[:12]) + (f", ... ({len(names)} ops)" if len(names) > 12 else "")
        lines.append(f"| {name} | {len(members)} | {sum(r.engine for r in members)} | {len(listed)} | {shown} |")
    lines += ["", "## Expected failures (expected_failures.py)", ""]
    lines += [f"- `{op}` {dtype}: {expected_failure(op, dtype)}"
              for (op, dtype), verdict in sorted(verdicts.items()) if verdict == "XFAIL"]
    lines += _unreached_kinds(results)
    lines += _verdict_section(results, verdicts, "FAIL", "Unexpected failures (not in expected_failures.py)")
    lines += _verdict_section(results, verdicts, "XPASS", "Unexpected passes (remove from expected_failures.py)")
    return "\n".join(lines) + "\n"


def _table_row(label: str, results: list) -> str:
    ran = [r for r in results if r.status != "skip"]
    passed = [r for r in ran if r.status == "pass"]
    with_engine = [r for r in ran if r.engine]
    return (f"| {label} | {len({r.op for r in results})} | {len({r.op for r in with_engine})} | {len(results)} | "
            f"{len(ran)} | {len(passed)} ({_share(passed, ran)}) | {len(with_engine)} ({_share(with_engine, ran)}) | "
            f"{len(results) - len(ran)} |")


# Kinds a static graph never puts in an engine (freezing folds them to constants): checked with
# run-time sizes in tests/e2e/test_dynamic_sizes.py, which the sweep's static graphs cannot give.
RUN_TIME_SIZE_KINDS = {"aten::arange", "aten::zeros", "aten::ones", "aten::full"}


def lowering_kinds() -> set:
    """The aten kinds of the lowering table (Tensor[] glue and RUN_TIME_SIZE_KINDS aside): each
    needs a case in an engine."""
    from blade.cluster.partition import GLUE_KINDS
    from blade.cluster.support import LOWERING
    return {kind for kind in LOWERING if kind.startswith("aten::") and kind not in GLUE_KINDS | RUN_TIME_SIZE_KINDS}


def unreached_kinds(results: list) -> dict:
    """Kind -> why: the lowering-table kinds no passing case computed in an engine, with what
    their composite cases recorded (or that none exists)."""
    reached = {kind for r in results if r.status == "pass" for kind in r.engine_ops}
    missing = {}
    for kind in sorted(lowering_kinds() - reached):
        tried = [r for r in results if r.kind == kind and r.status != "pass"]
        missing[kind] = (f"{tried[0].op} {tried[0].dtype} sample {tried[0].sample}: {tried[0].status}: "
                         f"{tried[0].detail}" if tried else "no composite case")
    return missing


def _unreached_kinds(results: list) -> list:
    missing = unreached_kinds(results)
    lines = ["", f"## Lowering-table kinds no passing case computed in an engine: {len(missing)} of "
             f"{len(lowering_kinds())}", ""]
    return lines + ([f"- `{kind}`: {why.replace('|', '/')}" for kind, why in missing.items()] or ["none"])


def _duration(seconds, results: list) -> str:
    case_time = f"the cases took {sum(r.seconds for r in results) / 60:.1f} min"
    if seconds is not None:
        return f" in {seconds / 60:.1f} min ({case_time})"
    return f" from stored results ({case_time}; the sweep's wall time adds sample generation and workers)"


def _share(part: list, whole: list) -> str:
    return f"{100 * len(part) / len(whole):.1f}%" if whole else "-"


def _verdict_section(results: list, verdicts: dict, verdict: str, title: str) -> list:
    keys = sorted(k for k, v in verdicts.items() if v == verdict)
    lines = ["", f"## {title}: {len(keys)}", ""]
    for op, dtype in keys:
        bad = [r for r in results if r.op == op and r.dtype == dtype and r.failed]
        first = bad[0] if bad else None
        detail = f" sample {first.sample}: {first.status}: {first.detail}" if first else ""
        lines.append(f"- `{op}` {dtype}{detail.replace('|', '/')}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/CONFORMANCE.md")
    parser.add_argument("--results", default=None, help="JSON lines of case results (resumable)")
    parser.add_argument("--ops", default="", help="comma-separated op names (default: all of op_db)")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--samples", type=int, default=2, help="samples per op and dtype")
    parser.add_argument("--inputs", choices=sorted(SAMPLE_SOURCES), default="sample",
                        help="OpInfo's sample_inputs, or the edge-value samples reference_inputs adds to them")
    parser.add_argument("--exhaustive", action="store_true",
                        help="every op over every dtype (default: dtypes only for ops that reach an engine)")
    parser.add_argument("--resume", action="store_true", help="keep the results of an interrupted run")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite --out from the stored results (after editing expected_failures.py)")
    parser.add_argument("--suites", default=",".join(SUITES),
                        help="opinfo (OpInfo's samples), composite (composite_cases.py) or both")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    ops_filter = [o for o in args.ops.split(",") if o]
    dtypes = [d for d in args.dtypes.split(",") if d]
    results_file = Path(args.results or Path(args.out).with_suffix(".jsonl"))
    suites = [name for name in args.suites.split(",") if name]
    if args.worker:
        worker(ops_filter, dtypes, args.samples, args.inputs, results_file, suites[0], args.probe)
        return 0
    command = "python -m tests.conformance.opinfo_sweep " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.report_only:
        results, seconds = load_results(results_file), None
    else:
        if not args.resume:
            results_file.unlink(missing_ok=True)
        started = time.monotonic()
        results = run_plan(ops_filter, dtypes, args.samples, args.inputs, results_file, args.exhaustive, suites)
        seconds = time.monotonic() - started
    Path(args.out).write_text(summary(results, seconds, command))
    verdicts = classify(results)
    print(f"{Path(args.out)}: {Counter(verdicts.values())}")
    return 1 if any(v in ("FAIL", "XPASS") for v in verdicts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
