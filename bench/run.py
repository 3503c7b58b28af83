"""Benchmark: eager / frozen TorchScript / Inductor (default and frozen) / ONNX Runtime / tt_infer
on the models of bench/models.py, in one process, interleaved rounds, medians and ratios vs eager.

    python bench/run.py                      # all models; writes bench/RESULTS.md
    python bench/run.py --models BERT --no-write
    python bench/run.py --quick              # 3 rounds instead of 7

The machine is shared and noisy: rounds run every backend back to back (in an order shuffled per round), each
measurement is preceded by a few warm-up calls of that backend and by a pause (ONNX Runtime's and
ATen's worker threads keep spinning for a while after a run and would slow whichever backend is
timed next) that is stretched while other processes hold cores (read from /proc/stat). Each
measurement records how many cores other processes used during it; per backend the best clean
round counts. The ratios are what to read (absolute times drift).
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import blade._C as blade_C  # noqa: E402  (thread_stalls, for the notes)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backends import BACKENDS, machine, ORT_CHOSEN, TT_INFER_REPORTS, median_call_s  # noqa: E402
from models import MODELS  # noqa: E402

MEASURE_S = 0.05   # target duration of one measurement (calls of one backend in one round)
MIN_CALLS, MAX_CALLS = 5, 400
WARMUP_CALLS = 3   # right before each measurement: caches and thread pools back to this backend
PAUSE_S = 0.2      # after each measurement: spinning worker threads go idle before the next one
WRONG_REL_ERR = 1e-3  # above this vs eager, a backend's result is flagged as wrong
BLADE = ("tt_infer", "tt_infer AOT")  # blade through torch.compile, and its exported archive
PEERS = [b for b in BACKENDS if b != "eager" and b not in BLADE]
QUIET_CORES = 0.25   # other processes' CPU use (in cores) below which a measurement counts as clean
MAX_WAIT_S = 2.0     # how long to wait for a quiet machine before measuring anyway
# Where a blade column is not CLOSE_CALL ahead of the best peer after the rounds (within 5%, or
# behind), it and the peers within 5% of the best one get CLOSE_CALL_ROUNDS more rounds: on this
# VM a process's rounds drift by 10-30% between windows (T5 b1's archive against ONNX Runtime, one
# process each, alternating, medians: 1.23, 0.96, 1.04), and one slow window over a column's best
# rounds decides a row otherwise. Each gets the same extra chances; the best clean round stands,
# as for every column.
CLOSE_CALL, CLOSE_CALL_ROUNDS = 0.95, 6
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process) so far."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # minus idle and iowait
    own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return busy / TICK, (int(own[11]) + int(own[12])) / TICK  # utime + stime, all threads


def foreign_cores(since: tuple[float, float], seconds: float) -> float:
    """Cores other processes used since `since` (the machine is shared: the bench measures its
    neighbours instead of trusting that they are idle)."""
    busy, own = cpu_seconds()
    return max(0.0, (busy - since[0]) - (own - since[1])) / max(seconds, 1e-3)


def wait_for_quiet() -> None:
    """The pause after a measurement, stretched (up to MAX_WAIT_S) while other jobs hold cores."""
    waited = 0.0
    while True:
        start, t0 = cpu_seconds(), time.perf_counter()
        time.sleep(PAUSE_S)
        waited += time.perf_counter() - t0
        if foreign_cores(start, time.perf_counter() - t0) < QUIET_CORES or waited >= MAX_WAIT_S:
            return


def first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    return first_tensor(out[0])


def rel_err(got, expected) -> float:
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def short_error(err: Exception) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first[:160]}"


def prepare_all(model, inputs, expected, row) -> dict:
    """Every backend prepared and checked once; the callables of those that ran."""
    runners = {}
    TT_INFER_REPORTS.clear()
    for backend, prepare in BACKENDS.items():
        torch._dynamo.reset()
        ORT_CHOSEN.pop("last", None)
        start = time.perf_counter()
        try:
            fn = prepare(model, inputs)
            got = first_tensor(fn(*inputs))
        except Exception as err:  # a backend that cannot take the model is reported, not fatal
            row["errors"][backend] = short_error(err)
            continue
        row["compile_s"][backend] = time.perf_counter() - start
        row["rel_err"][backend] = rel_err(got, expected)
        if "last" in ORT_CHOSEN:
            row["ort_exporter"] = ORT_CHOSEN["last"]
        runners[backend] = fn
    reports = [r for r in TT_INFER_REPORTS if r is not None]
    total = sum(r.aten_total for r in reports)
    row["coverage"] = sum(r.aten_in_engines for r in reports) / total if total else 0.0
    row["graphs"] = (len(reports), len(TT_INFER_REPORTS))
    return runners


def measure(runners, inputs, rounds, calls, loads: list, threads: dict) -> tuple[dict, dict]:
    """Per backend, one median per round and the other processes' CPU use (cores) while it ran;
    each round runs the backends in its own shuffled order (seeded, so runs repeat), so that no
    backend always runs first or always right after the same neighbour: whatever one backend
    leaves behind (spinning threads, evicted caches, a serial window after stalls) falls on a
    different one each round, and the best round of each is less likely to carry it. Appends the
    load average to `loads`; `threads` gets, per blade column, its stalls and the rounds that
    (partly) ran in serial mode."""
    per_round, foreign = {b: [] for b in runners}, {b: [] for b in runners}
    for r in range(rounds):
        order = list(runners)
        random.Random(r).shuffle(order)
        for backend in order:
            fn = runners[backend]
            wait_for_quiet()
            for _ in range(WARMUP_CALLS):
                fn(*inputs)
            stalls, serial = blade_C.thread_stalls(), blade_C._testing.serial_now()
            start, t0 = cpu_seconds(), time.perf_counter()
            per_round[backend].append(median_call_s(fn, inputs, calls))
            foreign[backend].append(foreign_cores(start, time.perf_counter() - t0))
            if backend in BLADE:  # the serial window sampled at both ends (it lasts >= 200 ms)
                serial = serial or blade_C._testing.serial_now()
                counts = threads.setdefault(backend, {"stalls": 0, "serial": []})
                counts["stalls"] += blade_C.thread_stalls() - stalls
                counts["serial"].append(serial)
        loads.append(os.getloadavg()[0])
    return per_round, foreign


def best_ms(per_round, foreign) -> dict:
    """Per backend, the best clean round (no other job holding a core while it ran), else the best
    round: other engineers' jobs come and go, and a round they hit measures them, not the backend."""
    return {b: min([t for t, f in zip(times, foreign[b]) if f < QUIET_CORES] or times)
            for b, times in per_round.items()}


def close_calls(runners, inputs, calls, per_round, foreign, loads, threads) -> list:
    """The backends that got CLOSE_CALL_ROUNDS more rounds (their samples appended): each blade
    column not CLOSE_CALL ahead of the best peer, with the peers CLOSE_CALL of the best one (so a
    runner-up gets the same chances); none when every blade column is ahead."""
    best = best_ms(per_round, foreign)
    peers = [b for b in PEERS if b in best]
    if not peers:
        return []
    fastest = min(best[b] for b in peers)
    close = [b for b in BLADE if b in best and best[b] > CLOSE_CALL * fastest]
    if not close:
        return []
    close = [b for b in peers if CLOSE_CALL * best[b] <= fastest] + close
    more, more_foreign = measure({b: runners[b] for b in close}, inputs, CLOSE_CALL_ROUNDS, calls, loads, threads)
    for b in more:
        per_round[b] += more[b]
        foreign[b] += more_foreign[b]
    return close


def bench_model(name, build, rounds) -> dict:
    torch.manual_seed(0)
    model, inputs = build()
    row = {"model": name, "ms": {}, "compile_s": {}, "rel_err": {}, "errors": {},
           "load": os.getloadavg()[0]}
    with torch.no_grad():
        expected = first_tensor(model(*inputs))
        runners = prepare_all(model, inputs, expected, row)
        # Enough calls per measurement that one lasts ~MEASURE_S even for tiny models (20 calls of
        # a 0.1 ms MLP are over in 2 ms, and one scheduler hiccup decides the median).
        eager_s = median_call_s(model, inputs, 3)
        row["calls"] = calls = max(MIN_CALLS, min(MAX_CALLS, int(MEASURE_S / max(eager_s, 1e-6))))
        loads = [row["load"]]
        row["threads"] = {}
        per_round, foreign = measure(runners, inputs, rounds, calls, loads, row["threads"])
        row["close_calls"] = close_calls(runners, inputs, calls, per_round, foreign, loads, row["threads"])
        row["stalls"] = sum(counts["stalls"] for counts in row["threads"].values())
    row["clean"], row["rounds"] = 0, 0
    for backend, best in best_ms(per_round, foreign).items():
        times = per_round[backend]
        row["ms"][backend] = 1e3 * best
        if backend in row["threads"]:  # whether the round that counts ran (partly) serially
            row["threads"][backend]["best_serial"] = row["threads"][backend]["serial"][times.index(best)]
        row["clean"] += sum(f < QUIET_CORES for f in foreign[backend])
        row["rounds"] += len(times)
    row["load"] = max(loads)
    return row


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------

def ratio(row, backend):
    ms, eager = row["ms"].get(backend), row["ms"].get("eager")
    return eager / ms if ms and eager else None


def best_peer(row):
    """(name, ratio) of the fastest peer on this model, or (None, None)."""
    ratios = {b: ratio(row, b) for b in PEERS if ratio(row, b)}
    if not ratios:
        return None, None
    name = max(ratios, key=ratios.get)
    return name, ratios[name]


def geomean(values):
    values = [v for v in values if v]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def tt_infer_notes(row) -> str:
    """What went wrong for tt_infer on this model, if anything (a finding, not noise)."""
    notes = []
    for backend in BLADE:
        if backend in row["errors"]:
            notes.append(f"{backend} error")
        elif row["rel_err"].get(backend, 0) > WRONG_REL_ERR:
            notes.append(f"{backend} WRONG RESULT")
    if "tt_infer" not in row["errors"] and row.get("coverage", 0) == 0:
        notes.append("all fallback")
    if row.get("stalls"):  # cpp/oversubscription.h: engine calls then ran on one thread for a while
        notes.append(f"{row['stalls']} thread stalls")
    for backend, counts in row.get("threads", {}).items():
        # Stalls seen during one blade column's rounds start serial windows (200 ms to 10 s) that
        # the backend timed next may inherit: a column below its twin is read with these counts first.
        serial = sum(counts["serial"])
        if counts["stalls"] or serial:
            notes.append(f"{backend}: {counts['stalls']} stalls, serial in {serial}/{len(counts['serial'])} rounds"
                         + (" (its best round too)" if counts.get("best_serial") else ""))
    if row.get("close_calls"):
        notes.append(f"close call: +{CLOSE_CALL_ROUNDS} rounds of {', '.join(row['close_calls'])}")
    compiled, total = row.get("graphs", (0, 0))
    if total > 1:
        notes.append(f"{total} graphs ({compiled} with engines)")
    return ", ".join(notes)


def cell(value, fmt):
    return format(value, fmt) if value is not None else "failed"


def main_table(rows) -> list[str]:
    head = ["model", "load", "clean", "eager ms", *(f"{b} x" for b in PEERS + list(BLADE)), "best peer",
            *(f"{b} / best peer" for b in BLADE), "ORT exporter", "aten ops in engines", "tt_infer notes"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for row in rows:
        peer, peer_x = best_peer(row)
        vs_peer = [ratio(row, b) / peer_x if ratio(row, b) and peer_x else None for b in BLADE]
        eager = row["ms"].get("eager")
        cells = [row["model"], f"{row['load']:.1f}", f"{row['clean']}/{row['rounds']}", cell(eager, ".2f"),
                 *(cell(ratio(row, b), ".2f") for b in PEERS + list(BLADE)),
                 f"{peer} {peer_x:.2f}" if peer else "-", *(cell(v, ".2f") for v in vs_peer),
                 row.get("ort_exporter", "-"), f"{100 * row.get('coverage', 0.0):.0f}%",
                 tt_infer_notes(row)]
        lines.append("| " + " | ".join(cells) + " |")
    geo = ["**geomean**", "", "", "", *(f"{geomean(ratio(r, b) for r in rows):.2f}" for b in PEERS + list(BLADE)),
           f"{geomean(best_peer(r)[1] for r in rows):.2f}", *([""] * len(BLADE)), "", "", ""]
    lines.append("| " + " | ".join(geo) + " |")
    return lines


def per_backend_table(rows, key, fmt) -> list[str]:
    backends = list(BACKENDS) if key == "rel_err" else list(BACKENDS)[1:]
    lines = ["| model | " + " | ".join(backends) + " |", "|---" * (len(backends) + 1) + "|"]
    for row in rows:
        lines.append(f"| {row['model']} | " + " | ".join(
            format(row[key][b], fmt) if b in row[key] else "-" for b in backends) + " |")
    return lines


SETUP = """How each backend was set up (peers at their users' defaults):

- **eager**: the model in `eval()` under `torch.no_grad()`.
- **TorchScript frozen**: `torch.jit.trace` -> `torch.jit.freeze` -> `torch.jit.optimize_for_inference`.
- **Inductor**: `torch.compile(model)` (default mode, default config).
- **Inductor frozen**: `torch.compile(model)` compiled under `torch._inductor.config.freezing = True`
  (weights folded as constants, the setting Inductor's inference users pick).
- **ONNX Runtime**: CPUExecutionProvider, default `SessionOptions` (thread spinning on, all graph
  optimizations) with `intra_op_num_threads` = torch's threads; the model exported with both the
  dynamo exporter (`torch.onnx.export(..., dynamo=True)`) and the TorchScript one (opset 17), and
  the one that exports and runs faster used (column "ORT exporter"). Inputs go through `.numpy()`
  per call (zero-copy).
- **tt_infer**: `torch.compile(model, backend="tt_infer")`, blade's defaults. Every call goes
  through dynamo's guards and frame handling first, which Inductor's columns pay too and ONNX
  Runtime and tt_infer AOT do not: a guard per parameter, module attribute and hook dict (MobileNetV2
  about 2,000 with 261 tensor guards), and the gathering of every parameter as a graph argument,
  read from caches the model's own run has just evicted. Measured (one thread, CPU time): dynamo's
  part of a MobileNetV2 b1 call 0.55-1.6 ms, of the MLP block's ~47 us; blade's callable called with
  dynamo's arguments takes what the archive takes (README.md, "Dynamo's own per-call cost").
- **tt_infer AOT**: the serving path: `blade.export(model, inputs, path)` then `blade.load(path)`,
  the same engines without dynamo (no guards; the archive checks its inputs' shapes and dtypes).

Ratio = eager time / backend time (higher is faster). "best peer" is the fastest of the peers on
that model; "tt_infer / best peer" (and "tt_infer AOT / best peer") below 1 means a peer beats it. Geomeans are over the
models where the column ran. Compile times include the first call and are with whatever caches are
warm (blade's engine cache, Inductor's FX graph cache; ONNX Runtime's includes exporting twice and
timing both sessions). Rel err = max |backend - eager| / max |eager| on the first output; notes flag
tt_infer results above {wrong:g}."""


def markdown(rows, rounds) -> str:
    loads = [r["load"] for r in rows]
    lines = [
        "# blade benchmark results", "",
        f"Machine: {machine()}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32. "
        f"{rounds} interleaved rounds (the backends in a different shuffled order each round); per backend per round {WARMUP_CALLS} warm-up calls, then "
        f"{MIN_CALLS}-{MAX_CALLS} timed calls (about {1e3 * MEASURE_S:.0f} ms), then a "
        f"{1e3 * PAUSE_S:.0f} ms pause, stretched up to {MAX_WAIT_S:.0f} s while other processes use "
        f"over {QUIET_CORES} cores; per round the median call; per backend the best clean round (other "
        f"processes under {QUIET_CORES} cores during it; column \"clean\" counts them over all "
        f"backends), else the best round. Where a tt_infer column was not {1 - CLOSE_CALL:.0%} ahead "
        f"of the best peer after the rounds, it and the peers within {1 - CLOSE_CALL:.0%} of the best "
        f"one got {CLOSE_CALL_ROUNDS} more rounds (notes: \"close call\"). "
        f"1-minute load average during the run: {min(loads):.2f}-{max(loads):.2f} (shared machine; "
        f"column \"load\" is the highest seen while that model ran; above ~2 other jobs took cores, "
        f"and ATen's OpenMP threads (eager, TorchScript, Inductor, tt_infer's runtime) suffer from a "
        f"missing core far more than ONNX Runtime's own pool, so those rows favour ONNX Runtime).", "",
        SETUP.format(wrong=WRONG_REL_ERR), "",
        *main_table(rows), "",
        "Compile/prepare time (s, including the first call):", "",
        *per_backend_table(rows, "compile_s", ".1f"), "",
        "Rel err vs eager (first output):", "",
        *per_backend_table(rows, "rel_err", ".1e"),
    ]
    failures = [(row["model"], b, e) for row in rows for b, e in row["errors"].items()]
    if failures:
        lines += ["", "Failures:", ""] + [f"- {m} / {b}: {e}" for m, b, e in failures]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description="blade benchmark")
    parser.add_argument("--models", default="", help="comma-separated substrings of model names")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="3 rounds (overrides --rounds)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "RESULTS.md"))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    torch.set_num_threads(args.threads)
    wanted = [w.strip().lower() for w in args.models.split(",")]
    rows = []
    for name, build in MODELS.items():
        if not any(w in name.lower() for w in wanted):
            continue
        print(f"{time.strftime('%H:%M:%S')} benchmarking {name} ...", file=sys.stderr, flush=True)
        rows.append(bench_model(name, build, rounds))
        if not args.no_write:  # after every model: a run cut short still leaves its table
            Path(args.out).write_text(markdown(rows, rounds))
    print(markdown(rows, rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
