"""Per-layer wall µs of the MLP block [8,256] through blade, interleaved rounds, median and p10:
the runtime's GEMM column split off ("before": MKL's own threading) and on ("after").

    PYTHONPATH=$PWD python bench/overhead_layers.py   # ROUNDS=200 by default
"""
import os, sys, time, statistics, tempfile
import torch
import blade
from blade import _C
from blade.config import Config
from blade.debug import CapturingBackend
from bench.models import mlp
from bench.backends import onnxruntime_cpu

T = _C._testing
torch.manual_seed(0)
model, (x,) = mlp()
with torch.no_grad():
    ref = model(x)
    backend = CapturingBackend(Config())
    torch.compile(model, backend=backend, dynamic=False)(x)
    cm = backend.compiled[0]
    captured = {}
    orig = type(cm).__call__
    def spy(self, *a):
        captured["args"] = a
        return orig(self, *a)
    type(cm).__call__ = spy
    torch.compile(model, backend=backend, dynamic=False)(x)  # same graph again: capture dynamo's args
    type(cm).__call__ = orig
    cargs = captured["args"]; rargs = [cargs[i] for i in cm.runtime_inputs]
    engine = list(cm.engines().values())[0]
    folder = tempfile.TemporaryDirectory()  # removed at exit
    path = os.path.join(folder.name, "mlp.pt")
    blade.export(model, (x,), path)
    loaded = blade.load(path)
    ort = onnxruntime_cpu(model, (x,))
    torch._dynamo.reset()
    tt = torch.compile(model, backend="tt_infer", dynamic=False); tt(x)
    nothing = torch.compile(model, backend=lambda gm, ex: gm.forward, dynamic=False); nothing(x)
    layers = {"engine.execute (Python->Engine)": lambda: engine.execute(rargs),
              "spliced ScriptModule": lambda: cm.module(*rargs),
              "CompiledModule": lambda: cm(*cargs),
              "blade.load module": lambda: loaded(x),
              "torch.compile tt_infer": lambda: tt(x),
              "torch.compile do-nothing backend": lambda: nothing(x),
              "eager": lambda: model(x),
              "ONNX Runtime": lambda: ort(x)}
    for name in ("spliced ScriptModule", "blade.load module", "torch.compile tt_infer"):
        for on in (True, False):
            T.set_gemm_column_split_rows(-1 if on else 0)
            o = layers[name]()
            o = o[0] if isinstance(o, (tuple, list)) else o
            torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-4)
    SPLIT_AGNOSTIC = {"torch.compile do-nothing backend", "eager", "ONNX Runtime"}
    variants = [(n, on) for n in layers for on in ((True,) if n in SPLIT_AGNOSTIC else (False, True))]
    times = {v: [] for v in variants}
    rounds = int(os.environ.get("ROUNDS", 200)); inner = 10
    for r in range(rounds):
        for name, on in variants:
            T.set_gemm_column_split_rows(-1 if on else 0)
            fn = layers[name]
            t = time.perf_counter()
            for _ in range(inner): fn()
            times[(name, on)].append((time.perf_counter() - t) / inner * 1e6)
print(f"{'layer':36s} {'before med':>10s} {'p10':>6s} {'after med':>10s} {'p10':>6s}")
for name in layers:
    row = f"{name:36s}"
    for on in (False, True):
        v = times.get((name, on)) or times.get((name, True))
        row += f" {statistics.median(v):10.1f} {statistics.quantiles(v, n=10)[0]:6.1f}"
    print(row)
