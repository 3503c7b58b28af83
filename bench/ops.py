"""Per-op benchmark: every elementwise and reduction op of blade's lowering table, alone and inside
a fused chain, at [64, 4096] and [8, 256], tt_infer vs eager. Writes bench/OPS.md.

    python bench/ops.py                 # all ops
    python bench/ops.py --ops gelu,softmax --no-write

The op list comes from blade.cluster.support.LOWERING; CALLS says how to call each op. An op of the
table without a call here is listed under "not benchmarked" with the reason, never dropped.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from blade import _C
from blade.cluster.support import LOWERING

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backends import machine, median_call_s  # noqa: E402

SHAPES = ([64, 4096], [8, 256])
# The timing method (bench_case): SAMPLES short samples per side, the sides interleaved (the order
# reversed every round), each sample the median call of ~MEASURE_S of calls, per side the best
# sample. Why, measured on the 2-core machine shared with other jobs (load 2-5): a [64, 4096]
# memory-bound op takes ~10 us on 2 threads, and one call whose worker thread waits for a core
# takes milliseconds, so long samples and medians over them measure the other jobs (medians of
# 15 samples of neg gave x load 0.5-700 between runs; the best of them agreed within 2-5%; at load
# 7-8 a case can have no sample without a stall: both sides then read ~8 ms, one scheduler slice). The
# ops themselves are then at eager's speed within 2-4% (alone at 1 thread by CPU time too), so a
# row's x near 1.0 is a tie, not a regression.
SAMPLES = 15
MEASURE_S = 0.004
PAUSE_S = 0.002
F64 = torch.float64

# aten kind (or kind#variant, another dtype of it) -> (input domain, call). The call gets x (the domain's tensor) and y (a second float
# tensor of the same shape, for binary ops); unary calls ignore y. Domains: "real" = randn,
# "pos" = |randn| + 0.1 (log, sqrt, pow), "bool" = randn > 0, "int" = int32 in +-3000.
CALLS = {
    "aten::add": ("real", lambda x, y: x + y),
    "aten::sub": ("real", lambda x, y: x - y),
    "aten::rsub": ("real", lambda x, y: 1.0 - x),
    "aten::mul": ("real", lambda x, y: x * y),
    "aten::div": ("real", lambda x, y: x / (y.abs() + 1.0)),
    "aten::true_divide": ("real", lambda x, y: torch.true_divide(x, 3.0)),
    "aten::maximum": ("real", lambda x, y: torch.maximum(x, y)),
    "aten::minimum": ("real", lambda x, y: torch.minimum(x, y)),
    "aten::pow": ("pos", lambda x, y: torch.pow(x, 1.7)),
    "aten::pow#tensor": ("pos", lambda x, y: torch.pow(x, y)),
    "aten::neg": ("real", lambda x, y: -x),
    "aten::abs": ("real", lambda x, y: x.abs()),
    "aten::relu": ("real", lambda x, y: torch.relu(x)),
    "aten::sigmoid": ("real", lambda x, y: torch.sigmoid(x)),
    "aten::tanh": ("real", lambda x, y: torch.tanh(x)),
    "aten::exp": ("real", lambda x, y: torch.exp(x)),
    "aten::log": ("pos", lambda x, y: torch.log(x)),
    "aten::sqrt": ("pos", lambda x, y: torch.sqrt(x)),
    "aten::rsqrt": ("pos", lambda x, y: torch.rsqrt(x)),
    "aten::reciprocal": ("pos", lambda x, y: torch.reciprocal(x)),
    "aten::erf": ("real", lambda x, y: torch.erf(x)),
    "aten::floor": ("real", lambda x, y: torch.floor(x)),
    "aten::ceil": ("real", lambda x, y: torch.ceil(x)),
    "aten::sign": ("real", lambda x, y: torch.sign(x)),
    "aten::sin": ("real", lambda x, y: torch.sin(x)),
    "aten::cos": ("real", lambda x, y: torch.cos(x)),
    "aten::gelu": ("real", lambda x, y: F.gelu(x)),
    "aten::hardswish": ("real", lambda x, y: F.hardswish(x)),
    "aten::hardsigmoid": ("real", lambda x, y: F.hardsigmoid(x)),
    "aten::hardtanh": ("real", lambda x, y: F.hardtanh(x)),
    "aten::relu6": ("real", lambda x, y: F.relu6(x)),
    "aten::leaky_relu": ("real", lambda x, y: F.leaky_relu(x)),
    "aten::elu": ("real", lambda x, y: F.elu(x)),
    "aten::softplus": ("real", lambda x, y: F.softplus(x)),
    "aten::mish": ("real", lambda x, y: F.mish(x)),
    "aten::silu": ("real", lambda x, y: F.silu(x)),
    "aten::clamp": ("real", lambda x, y: torch.clamp(x, -0.5, 0.5)),
    "aten::clamp_min": ("real", lambda x, y: torch.clamp_min(x, 0.1)),
    "aten::clamp_max": ("real", lambda x, y: torch.clamp_max(x, 0.1)),
    "aten::where": ("real", lambda x, y: torch.where(x > y, x, y)),
    "aten::masked_fill": ("real", lambda x, y: x.masked_fill(y > 0, -1e4)),
    "aten::eq": ("real", lambda x, y: x == y),
    "aten::ne": ("real", lambda x, y: x != y),
    "aten::lt": ("real", lambda x, y: x < y),
    "aten::le": ("real", lambda x, y: x <= y),
    "aten::gt": ("real", lambda x, y: x > y),
    "aten::ge": ("real", lambda x, y: x >= y),
    "aten::logical_not": ("bool", lambda x, y: torch.logical_not(x)),
    "aten::logical_and": ("bool", lambda x, y: torch.logical_and(x, y > 0)),
    "aten::logical_or": ("bool", lambda x, y: torch.logical_or(x, y > 0)),
    "aten::__and__": ("bool", lambda x, y: x & (y > 0)),
    "aten::__or__": ("bool", lambda x, y: x | (y > 0)),
    "aten::bitwise_and": ("bool", lambda x, y: torch.bitwise_and(x, y > 0)),
    "aten::bitwise_or": ("bool", lambda x, y: torch.bitwise_or(x, y > 0)),
    "aten::bitwise_not": ("bool", lambda x, y: torch.bitwise_not(x)),
    "aten::__xor__": ("bool", lambda x, y: x ^ (y > 0)),
    "aten::bitwise_xor": ("bool", lambda x, y: torch.bitwise_xor(x, y > 0)),
    # the integer forms, as masks and hashes use them
    "aten::bitwise_and#int": ("int", lambda x, y: x & 0xFF0),
    "aten::bitwise_or#int": ("int", lambda x, y: x | y.to(torch.int32)),
    "aten::bitwise_xor#int": ("int", lambda x, y: x ^ y.to(torch.int32)),
    "aten::bitwise_not#int": ("int", lambda x, y: ~x),
    "aten::remainder": ("int", lambda x, y: x % 1000),      # integers only (floats stay in TorchScript)
    "aten::fmod": ("int", lambda x, y: torch.fmod(x, y.to(torch.int32).abs() + 1)),
    "aten::to": ("real", lambda x, y: x.to(F64)),
    "aten::type_as": ("real", lambda x, y: x.type_as(y.double())),
    "aten::sum": ("real", lambda x, y: x.sum(-1)),
    "aten::mean": ("real", lambda x, y: x.mean(-1)),
    "aten::amax": ("real", lambda x, y: x.amax(-1)),
    "aten::amin": ("real", lambda x, y: x.amin(-1)),
    "aten::softmax": ("real", lambda x, y: torch.softmax(x, -1)),
    "aten::log_softmax": ("real", lambda x, y: torch.log_softmax(x, -1)),
    "aten::layer_norm": ("real", lambda x, y: F.layer_norm(x, x.shape[-1:])),
    "aten::prod": ("pos", lambda x, y: (x * 0.01 + 0.995).prod(-1)),
    "aten::max": ("real", lambda x, y: x.max(-1).values),
    "aten::min": ("real", lambda x, y: x.min(-1).values),
    "aten::any": ("bool", lambda x, y: x.any(-1)),
    "aten::all": ("bool", lambda x, y: x.all(-1)),
    "aten::var": ("real", lambda x, y: x.var(-1)),
    "aten::std": ("real", lambda x, y: x.std(-1)),
    "aten::norm": ("real", lambda x, y: x.norm(dim=-1)),
    "aten::linalg_vector_norm": ("real", lambda x, y: torch.linalg.vector_norm(x, dim=-1)),
    "aten::logsumexp": ("real", lambda x, y: torch.logsumexp(x, -1)),
    "aten::cumsum": ("real", lambda x, y: x.cumsum(-1)),
    "aten::group_norm": ("real", lambda x, y: F.group_norm(x.unsqueeze(-1), 4)),
    "aten::instance_norm": ("real", lambda x, y: F.instance_norm(x.unsqueeze(0))),
    "aten::batch_norm": ("real", lambda x, y: F.batch_norm(
        x, torch.zeros(x.shape[1]), torch.ones(x.shape[1]), training=False)),
}

# Why the rest of the table is not here: this benchmark is about elementwise and reduction
# lowering; these families have their own benchmarks (the models) or no standalone cost.
OTHER_FAMILIES = {
    "conv/pool/pad": ("conv", "pool", "pad"),
    "linear algebra (the model benchmark)": ("linear", "matmul", "bmm", "aten::mm", "addmm", "sdpa",
                                             "scaled_dot_product_attention"),
    "shape/data movement": ("view", "reshape", "flatten", "permute", "transpose", "aten::t",
                            "squeeze", "expand", "contiguous", "clone", "detach", "dropout", "slice",
                            "narrow", "select", "cat", "concat", "embedding", "index", "gather", "tril",
                            "triu", "repeat", "roll", "stack", "unbind", "split", "chunk", "upsample"),
    "tensor creation": ("zeros", "ones", "full", "arange"),
    "Tensor[] glue": ("prim::", "__getitem__"),
}


def family_of(kind: str) -> str:
    for family, needles in OTHER_FAMILIES.items():
        if any(needle in kind for needle in needles):
            return family
    return "no call in bench/ops.py CALLS (elementwise/reduction op not yet benchmarked)"


def make_inputs(domain, shape):
    x, y = torch.randn(shape), torch.randn(shape)
    return {"real": (x, y), "pos": (x.abs() + 0.1, y), "bool": (x > 0, y),
            "int": ((x * 1000).to(torch.int32), y * 1000)}[domain]


def chained(call, domain):
    """The op between an elementwise prologue and epilogue, as a fusing compiler sees it in models."""
    def prologue(x):
        return {"bool": x, "int": x * 3 + 1}.get(domain, x * 1.5 + 0.25)

    def fn(x, y):
        out = call(prologue(x), y * 0.5 - 0.1)   # (an int op's y is cast to int32 inside its call)
        return out.float() * 0.5 + 1.0 if out.dtype != torch.bool else torch.where(out, 2.0, -1.0)
    return fn


def tt_infer_compiled(fn):
    """(compiled fn, reports): torch.compile with tt_infer, engines forced on for single ops."""
    from blade.dynamo import tt_infer
    reports = []

    def recording(gm, example_inputs):
        compiled = tt_infer(gm, example_inputs, {"min_cluster_size": 1})
        reports.append(getattr(compiled, "report", None))
        return compiled
    return torch.compile(fn, backend=recording), reports


class _Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, y):
        return self.fn(x, y)


def loaded(fn, inputs, directory):
    """The same engines saved with blade.export and served by blade.load: no dynamo per call."""
    import blade
    from blade.config import Config
    path = os.path.join(directory, "op.pt")
    blade.export(_Call(fn), inputs, path, Config(min_cluster_size=1))
    module = blade.load(path)
    return lambda x, y: module(x, y)


def median_two_thread_call_s(fn, inputs, calls: int) -> float:
    """The median wall time of one call of fn(*inputs), every call on the threads the bench set.
    Engine calls run on one thread for a while after a parallel region stalled
    (cpp/oversubscription.h); under load that starts within a sample and would time blade on one
    thread against eager on two (sum [64,4096] at load 7: x load 0.73-0.79, 1.04 at 1 thread), so
    it is switched off before every call, outside the timed part."""
    times = []
    for _ in range(calls):
        _C._testing.force_serial_for(0)
        start = time.perf_counter()
        fn(*inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_case(fn, inputs) -> dict:
    """One (op, variant, shape): eager, eager through dynamo (torch.compile with a backend that runs
    the captured graph itself: the per-call cost every torch.compile backend has), tt_infer through
    torch.compile and through blade.load; times, rel err, share of ops in engines."""
    torch._dynamo.reset()
    compiled, reports = tt_infer_compiled(fn)
    expected, got = fn(*inputs), compiled(*inputs)
    err = ((got.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30)).item()
    reports = [r for r in reports if r is not None]
    total = sum(r.aten_total for r in reports)
    coverage = sum(r.aten_in_engines for r in reports) / total if total else 0.0
    through_dynamo = torch.compile(fn, backend=lambda gm, example_inputs: gm.forward)
    with tempfile.TemporaryDirectory() as directory:
        served = loaded(fn, inputs, directory)
        torch.testing.assert_close(served(*inputs).double(), expected.double(), rtol=1e-4, atol=1e-4 * max(
            1.0, expected.double().abs().max().item()))
        sides = {"eager": fn, "dynamo": through_dynamo, "tt_infer": compiled, "load": served}
        calls = max(5, min(200, int(MEASURE_S / max(median_call_s(fn, inputs, 3), 1e-7))))
        times = {name: [] for name in sides}
        stalls = _C.thread_stalls()
        for r in range(SAMPLES):
            for name, f in list(sides.items())[:: 1 if r % 2 else -1]:
                f(*inputs)
                times[name].append(median_two_thread_call_s(f, inputs, calls))
                time.sleep(PAUSE_S)
        stalls = _C.thread_stalls() - stalls
    # the best sample of each: on a shared machine a sample another job hit measures that job
    us = {name: 1e6 * min(t) for name, t in times.items()}
    return {"eager_us": us["eager"], "dynamo_us": us["dynamo"], "tt_us": us["tt_infer"], "load_us": us["load"],
            "x": us["eager"] / us["tt_infer"], "x_load": us["eager"] / us["load"], "err": err, "coverage": coverage,
            "stalls": stalls}


def bench_op(kind, shapes=SHAPES, variants=("alone", "chain")) -> list[dict]:
    domain, call = CALLS[kind]
    rows = []
    for shape in shapes:
        for variant, fn in (("alone", call), ("chain", chained(call, domain))):
            if variant not in variants:
                continue
            row = {"op": kind, "shape": "x".join(map(str, shape)), "variant": variant}
            try:
                row.update(bench_case(fn, make_inputs(domain, shape)))
            except Exception as err:  # noqa: BLE001  a failing op is a row of the table
                row["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:120] if str(err).strip() else ''}"
            rows.append(row)
            print(f"  {kind} {row['shape']} {variant}: " + (
                f"{row['x']:.2f}x, {row['x_load']:.2f}x load" if "x" in row else row["error"]), file=sys.stderr, flush=True)
    return rows


def markdown(rows, skipped) -> str:
    lines = [
        "# blade per-op benchmark", "",
        f"Machine: {machine()}; torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, float32 inputs. tt_infer with "
        f"min_cluster_size=1 (a single op gets an engine). Columns: eager; \"eager via dynamo\" is "
        f"torch.compile with a backend that runs the captured graph itself, i.e. eager plus the per-call "
        f"cost every torch.compile backend (Inductor's too) pays; tt_infer through torch.compile (x); the "
        f"same engines saved with blade.export and called through blade.load, no dynamo (x load). "
        f"{SAMPLES} interleaved samples per side (the order reversed every round), each the median call "
        f"of ~{MEASURE_S * 1e3:.0f} ms of calls, per side the best sample; blade's serial mode "
        f"(cpp/oversubscription.h) is switched off before every call, and \"stalls\" counts the parallel "
        f"regions that waited for a core meanwhile (the machine was busy). Two runs at load 6-7 agreed "
        f"within 5% on 9 of 11 [64, 4096] alone rows (not: the 3 us bool bitwise_not, and a case whose "
        f"every sample stalled, both sides ~8 ms); an x within 0.95-1.05 is a tie. "
        f"1-minute load average at the end: {os.getloadavg()[0]:.2f}.", "",
        "\"alone\" is the op by itself; \"chain\" is `op(x * 1.5 + 0.25, y * 0.5 - 0.1) * 0.5 + 1.0` "
        "(bool results through `where`), as a fusing compiler sees it inside a model. "
        "x = eager time / tt_infer time (higher is faster). Ops sorted by their worst x.", "",
        "| op | shape | variant | eager us | eager via dynamo us | tt_infer us | x | blade.load us | x load | rel err | ops in engines | stalls |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    worst = {}
    for row in rows:
        worst[row["op"]] = min(worst.get(row["op"], math.inf), row.get("x", 0.0))
    for row in sorted(rows, key=lambda r: (worst[r["op"]], r["op"])):
        if "error" in row:
            lines.append(f"| {row['op']} | {row['shape']} | {row['variant']} | - | - | - | failed | - | - | {row['error']} | - | - |")
            continue
        lines.append(f"| {row['op']} | {row['shape']} | {row['variant']} | {row['eager_us']:.1f} | "
                     f"{row['dynamo_us']:.1f} | {row['tt_us']:.1f} | {row['x']:.2f} | {row['load_us']:.1f} | "
                     f"{row['x_load']:.2f} | {row['err']:.1e} | {100 * row['coverage']:.0f}% | {row['stalls']} |")
    lines.append("")
    for column, what in (("x", "through torch.compile"), ("x_load", "through blade.load")):
        for shape in sorted({r["shape"] for r in rows}, reverse=True):
            for variant in ("alone", "chain"):
                xs = [r[column] for r in rows if column in r and r["shape"] == shape and r["variant"] == variant]
                if xs:
                    below = sum(x < 1.0 for x in xs)
                    lines.append(f"- {what}, {shape} {variant}: geomean {math.exp(sum(map(math.log, xs)) / len(xs)):.2f}x "
                                 f"over {len(xs)} cases, {below} below 1.0x")

    lines += ["", "Ops of the lowering table not benchmarked here:", "",
              "| op | why |", "|---|---|", *(f"| {k} | {why} |" for k, why in skipped)]
    return "\n".join(lines) + "\n"


def main() -> int:
    global SAMPLES
    parser = argparse.ArgumentParser(description="blade per-op benchmark")
    parser.add_argument("--ops", default="", help="comma-separated substrings of aten op names")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help=f"9 samples per side instead of {SAMPLES}")
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES),
                        help="comma-separated shapes, e.g. 64x4096")
    parser.add_argument("--variants", default="alone,chain", help="alone, chain or both")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "OPS.md"))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    SAMPLES = 9 if args.quick else SAMPLES
    shapes = [[int(n) for n in shape.split("x")] for shape in args.shapes.split(",")]
    variants = args.variants.split(",")
    wanted = [w.strip() for w in args.ops.split(",")]
    kinds = [k for k in LOWERING if any(w in k for w in wanted)]
    skipped = [(k, family_of(k)) for k in kinds if k not in CALLS]
    rows = []
    with torch.no_grad():
        for kind in (k for k in kinds if k in CALLS):
            for variant in [kind] + [key for key in CALLS if key.startswith(kind + "#")]:  # e.g. "#int"
                rows += bench_op(variant, shapes, variants)
            if not args.no_write:  # after every op: a run cut short still leaves its table
                Path(args.out).write_text(markdown(rows, skipped))
    print(markdown(rows, skipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
