"""First call at a new shape over the steady call, tt_infer dynamic (issue 12): `python bench/first_probe.py
bert|gpt2` with REPO=<checkout> (default /work/main) on PYTHONPATH. One compile (at 2x32, called once),
then per point: the first call, calls 2-4, the steady call (best of the last 10 of 30), the slow calls
(> 1.3x steady) and the excess of the 30 calls over 30 steady ones, in steady calls. Thread CPU time
(NT threads, default 1), so other processes' load counts less than in wall time; 1x16 still varies
1.2-1.4x from call to call under load (likely its weights evicted from the shared L3; not profiled)."""
import sys, time, os
import torch
R = os.environ.get("REPO", "/work/main"); sys.path.insert(0, R + "/bench"); sys.path.insert(0, R)
torch.set_num_threads(int(os.environ.get("NT", "1")))
import blade, dynamic as D
clock = time.thread_time
torch.manual_seed(0)
inner, vocab = (D.bert if sys.argv[1] == "bert" else D.gpt2)()
model = D.Flat(inner).eval()
example = D.grid_inputs(vocab, 2, 32)
with torch.no_grad():
    m = D.tt_dynamic(model, example, 16, 512, {"g++": 0, "graphs": 0})
    m(*example)
    for b, s in [(1, 16), (1, 64), (1, 128), (4, 16), (4, 64), (16, 128)]:
        x = D.grid_inputs(vocab, b, s)
        t = clock(); m(*x); first = clock() - t
        times = []
        for _ in range(30):
            t = clock(); m(*x); times.append(clock() - t)
        steady = min(times[-10:])
        print(f"{b}x{s}: first {first*1e3:.2f} ms, calls 2-4 {[round(v*1e3,2) for v in times[:3]]}, steady {steady*1e3:.2f} -> {first/steady:.2f}x; slow calls {sum(t > 1.3 * steady for t in times)}, excess {(sum(times) - 30 * steady) / steady:.1f} steady calls", flush=True)
