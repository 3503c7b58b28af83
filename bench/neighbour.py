"""An archive's calls at 2 threads while a neighbour process takes one core part of the time:
blade's serial windows (cpp/oversubscription.h: each engine runs the mode its own calls measured
faster) against serial windows turned off, and ONNX Runtime at its defaults, in one process,
alternating blocks of calls (a pause between blocks), per duty cycle of the neighbour.

    PYTHONPATH=$PWD python bench/neighbour.py [--models "MobileNetV2 (160x160) b1;MLP block [8,256]"] [--duty 3/12,6/6,10/3]

--duty: the neighbour's busy/idle milliseconds (a Python loop spinning, then sleeping). Prints per
model and duty each column's median and mean call over all its calls, and their ratios (a server's
throughput follows the means, its typical latency the medians).
"""
import argparse
import statistics
import subprocess
import sys
import time
import warnings

import torch

NEIGHBOUR = """
import sys, time
busy, idle, end = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3, time.time() + float(sys.argv[3])
while time.time() < end:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(idle)
"""


def runners(name):
    import blade._C as C
    from bench import backends, models
    model, inputs = models.MODELS[name]()
    archive = backends.tt_infer_aot(model, inputs)
    ort = backends.onnxruntime_cpu(model, inputs)

    def windows(on):
        def run(*args):
            C._testing.set_serial_windows(on)
            return archive(*args)
        return run
    return {"windows": windows(True), "no windows": windows(False), "ONNX Runtime": ort}, inputs


def measure(columns, inputs, rounds):
    """Per column, every call's time (ms), in blocks of about 50 ms alternating between columns."""
    from bench.backends import median_call_s
    calls = max(5, int(0.05 / median_call_s(columns["windows"], inputs, 5)))
    times = {name: [] for name in columns}
    for _ in range(rounds):
        for name, run in columns.items():
            time.sleep(0.05)
            for _ in range(calls):
                start = time.perf_counter()
                run(*inputs)
                times[name].append(1e3 * (time.perf_counter() - start))
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="MobileNetV2 (160x160) b1;BERT (4L, 256, seq 128)",
                        help="bench/models.py names, separated by ';'")
    parser.add_argument("--duty", default="3/12,6/6,10/3", help="busy/idle ms of the neighbour, comma-separated")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    import blade._C as C
    torch.set_num_threads(2)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in args.models.split(";"):
            columns, inputs = runners(name)
            for run in columns.values():
                for _ in range(60):  # past the GEMM kernels' choice on first calls
                    run(*inputs)
            for duty in args.duty.split(","):
                busy, idle = duty.split("/")
                neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, busy, idle, "600"])
                try:
                    stalls = C.thread_stalls()
                    times = measure(columns, inputs, args.rounds)
                finally:
                    neighbour.kill()
                    C._testing.set_serial_windows(True)
                print(f"{name}, neighbour {busy} ms busy / {idle} ms idle, {C.thread_stalls() - stalls} stalls:")
                for column, values in times.items():
                    print(f"  {column:13s} median {statistics.median(values):.3f} ms, mean {statistics.mean(values):.3f}")
                pairs = (("windows", "no windows"), ("windows", "ONNX Runtime"), ("no windows", "ONNX Runtime"))
                for stat in (statistics.median, statistics.mean):
                    ratios = ", ".join(f"{a} / {b} {stat(times[a]) / stat(times[b]):.3f}" for a, b in pairs)
                    print(f"  {stat.__name__}s: {ratios}", flush=True)
                time.sleep(5)


if __name__ == "__main__":
    main()
