"""Benchmark: eager / frozen TorchScript / Inductor / ONNX Runtime / tt_infer on the models of
bench/models.py, in one process, interleaved rounds, medians and ratios vs eager.

    python bench/run.py                    # all models; writes bench/RESULTS.md
    python bench/run.py --models BERT --no-write

The machine is shared and noisy: rounds run every backend back to back (in a rotating order), a
round whose eager median is more than 1.5x the best eager round is dropped as contended, and the
ratios are what to read (absolute times drift).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backends import BACKENDS, TT_INFER_REPORTS  # noqa: E402
from models import MODELS  # noqa: E402

CONTENDED = 1.5
MEASURE_S = 0.03   # target duration of one measurement (calls of one backend in one round)
MAX_CALLS = 400


def first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    return first_tensor(out[0])


def median_call_s(fn, inputs, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(*inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_model(name, build, rounds, calls) -> dict:
    torch.manual_seed(0)
    model, inputs = build()
    row = {"model": name, "ms": {}, "compile_s": {}, "rel_err": {}, "errors": {}}
    with torch.no_grad():
        expected = first_tensor(model(*inputs))
        runners = {}
        TT_INFER_REPORTS.clear()
        for backend, prepare in BACKENDS.items():
            torch._dynamo.reset()
            start = time.perf_counter()
            try:
                fn = prepare(model, inputs)
                got = first_tensor(fn(*inputs))
            except Exception as err:  # a backend that cannot take the model is reported, not fatal
                row["errors"][backend] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
                continue
            row["compile_s"][backend] = time.perf_counter() - start
            row["rel_err"][backend] = ((got - expected).abs().max() / expected.abs().max()).item()
            for _ in range(3):
                fn(*inputs)
            runners[backend] = fn
        reports = [r for r in TT_INFER_REPORTS if r is not None]
        total = sum(r.aten_total for r in TT_INFER_REPORTS if r) or 1
        row["coverage"] = sum(r.aten_in_engines for r in reports) / total if reports else 0.0
        # Enough calls per measurement that one lasts ~MEASURE_S even for tiny models (20 calls of
        # a 0.1 ms MLP are over in 2 ms, and one scheduler hiccup decides the median).
        calls = max(calls, min(MAX_CALLS, int(MEASURE_S / max(median_call_s(model, inputs, 5), 1e-6))))
        row["calls"] = calls
        per_round = {b: [] for b in runners}
        order = list(runners)
        for r in range(rounds):
            for backend in order[r % len(order):] + order[:r % len(order)]:
                per_round[backend].append(median_call_s(runners[backend], inputs, calls))
                time.sleep(0.05)  # let other runtimes' worker threads go idle
        eager_rounds = per_round["eager"]
        best = min(eager_rounds)
        kept = [i for i, t in enumerate(eager_rounds) if t <= CONTENDED * best]
        row["dropped_rounds"] = rounds - len(kept)
        for backend, times in per_round.items():
            row["ms"][backend] = 1e3 * statistics.median(times[i] for i in kept)
    return row


def markdown(rows, rounds, calls) -> str:
    backends = list(BACKENDS)
    lines = [
        "# blade benchmark results", "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32. "
        f"{rounds} interleaved rounds x at least {calls} calls (more for fast models, about "
        f"{1e3 * MEASURE_S:.0f} ms per measurement), medians; contended rounds dropped.", "",
        "Ratio = eager time / backend time (higher is faster). Compile times are with whatever "
        "caches are warm (blade's engine cache, Inductor's FX graph cache).", "",
        "| model | eager ms | " + " | ".join(f"{b} x" for b in backends[1:])
        + " | tt_infer compile s | tt_infer rel err | aten ops in engines |",
        "|---" * (len(backends) + 4) + "|",
    ]
    for row in rows:
        eager = row["ms"].get("eager")
        cells = []
        for b in backends[1:]:
            ms = row["ms"].get(b)
            cells.append(f"{eager / ms:.2f}" if ms and eager else "failed")
        lines.append(f"| {row['model']} | {eager:.2f} | " + " | ".join(cells)
                     + f" | {row['compile_s'].get('tt_infer', float('nan')):.1f}"
                     + f" | {row['rel_err'].get('tt_infer', float('nan')):.1e}"
                     + f" | {100 * row.get('coverage', 0.0):.0f}% |")
    lines += ["", "Compile/prepare time (s, including the first call):", ""]
    lines.append("| model | " + " | ".join(backends[1:]) + " |")
    lines.append("|---" * len(backends) + "|")
    for row in rows:
        lines.append(f"| {row['model']} | " + " | ".join(
            f"{row['compile_s'][b]:.1f}" if b in row["compile_s"] else "-" for b in backends[1:]) + " |")
    failures = [(row["model"], b, e) for row in rows for b, e in row["errors"].items()]
    if failures:
        lines += ["", "Failures:", ""] + [f"- {m} / {b}: {e}" for m, b, e in failures]
    dropped = [(row["model"], row["dropped_rounds"]) for row in rows if row["dropped_rounds"]]
    if dropped:
        lines += ["", "Contended rounds dropped: " + ", ".join(f"{m}: {n}" for m, n in dropped)]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description="blade benchmark")
    parser.add_argument("--models", default="", help="substring filter on model names")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "RESULTS.md"))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name, build in MODELS.items():
        if args.models.lower() in name.lower():
            print(f"benchmarking {name} ...", file=sys.stderr, flush=True)
            rows.append(bench_model(name, build, args.rounds, args.calls))
    table = markdown(rows, args.rounds, args.calls)
    print(table)
    if not args.no_write:
        Path(args.out).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
