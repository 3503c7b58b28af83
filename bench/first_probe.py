"""First call at a new shape over the steady call, tt_infer dynamic (issue 12): `python bench/first_probe.py
bert|gpt2 [BxS,...]` with REPO=<checkout> (default /work/main) on PYTHONPATH. One compile (at 2x32, called
once), then per point, in a server's order (right after a call at the previous point, as bench/dynamic.py
times it): the first call, calls 2-4, the steady call (best of the last 10 of 30), the slow calls
(> 1.3x steady) and the excess of the 30 calls over 30 steady ones, in steady calls. Thread CPU time
(NT threads, default 1), so other processes' load counts less than in wall time; 1x16 still varies
1.2-1.4x from call to call under load (likely its weights evicted from the shared L3; not profiled).

What the first call does that a steady one does not, per point:
- `faults`: page faults (ru_minflt) of the first call, 3.3 us of system time each on the 2026-11 AMD
  EPYC VM. An engine with run-time sizes plans its scratch arena at the size symbols' maxima, so a call
  at a larger shape than any before touched arena pages no call had touched (GPT-2 4L/256: 291 at 1x128,
  684 at 1x256, 2288 at 1x512, 27386 at 16x512) until the runtime made the arena resident at load
  (cpp/scratch_pool.h); what is left is the rest of the call's memory. Steady calls fault 0.
- `gemm`: GEMMs per kernel (mkl/panels/onednn) in the first call and in a steady one. A new GEMM
  bucket (cpp/gemm_choice.cpp) is sampled by its calls 2-12 (its first call runs the neighbouring
  bucket's choice); where the first call's mix differs from the steady one's, sampling ran in it."""
import os
import resource
import sys
import time

import torch

R = os.environ.get("REPO", "/work/main"); sys.path.insert(0, R + "/bench"); sys.path.insert(0, R)
torch.set_num_threads(int(os.environ.get("NT", "1")))
import blade  # noqa: E402
import dynamic as D  # noqa: E402

clock = time.thread_time
KERNELS = ("mkl", "panels", "onednn-matmul", "onednn-packed")


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def kernel_calls() -> list:
    return [blade._C._testing.gemm_kernel_calls(k) for k in KERNELS]


def gemm_mix(call) -> str:
    """GEMMs per kernel that call() ran, e.g. 'mkl 8 panels 16'."""
    before = kernel_calls()
    call()
    return " ".join(f"{k} {after - b}" for k, b, after in zip(KERNELS, before, kernel_calls()) if after > b)


POINTS = [(1, 16), (1, 64), (1, 128), (4, 16), (4, 64), (16, 128)]
points = [tuple(map(int, p.split("x"))) for p in sys.argv[2].split(",")] if len(sys.argv) > 2 else POINTS
torch.manual_seed(0)
inner, vocab = (D.bert if sys.argv[1] == "bert" else D.gpt2)()
model = D.Flat(inner).eval()
example = D.grid_inputs(vocab, 2, 32)
with torch.no_grad():
    m = D.tt_dynamic(model, example, 16, 512, {"g++": 0, "graphs": 0})
    m(*example)
    previous = example
    for b, s in points:
        x = D.grid_inputs(vocab, b, s)
        m(*previous)
        before = faults()
        t = clock()
        first_mix = gemm_mix(lambda: m(*x))
        first = clock() - t
        first_faults = faults() - before
        times = []
        for _ in range(30):
            t = clock(); m(*x); times.append(clock() - t)
        steady = min(times[-10:])
        print(f"{b}x{s}: first {first*1e3:.2f} ms, calls 2-4 {[round(v*1e3,2) for v in times[:3]]}, steady {steady*1e3:.2f} -> {first/steady:.2f}x; slow calls {sum(t > 1.3 * steady for t in times)}, excess {(sum(times) - 30 * steady) / steady:.1f} steady calls; "
              f"first call: {first_faults} faults, gemm {first_mix} (steady: {gemm_mix(lambda: m(*x))})", flush=True)
        previous = x
