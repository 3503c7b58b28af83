"""What each calling layer costs on a graph whose kernel costs ~nothing (tanh(2x+1)*x on [8], one
engine): CPU time of the calling thread (other processes on a shared machine do not count), one
thread, medians.

    PYTHONPATH=$PWD python bench/overhead_tiny.py   # ROUNDS=300 by default
"""
import os, sys, time, statistics, tempfile
import torch
import blade
from blade.config import Config
from blade.debug import CapturingBackend

class Tiny(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(x * 2.0 + 1.0) * x
class Trivial(Tiny):
    def forward(self, x):
        return super().forward(x)

torch.set_num_threads(1)
x = torch.randn(8)
model = Tiny().eval()
with torch.no_grad():
    ref = model(x)
    backend = CapturingBackend(Config(min_cluster_size=1))
    compiled = torch.compile(model, backend=backend, dynamic=False); compiled(x)
    cm = backend.compiled[0]
    assert cm.engines(), "an engine"
    rargs = [x]
    engine = list(cm.engines().values())[0]
    folder = tempfile.TemporaryDirectory()  # removed at exit
    path = os.path.join(folder.name, "t.pt")
    blade.export(model, (x,), path, Config(min_cluster_size=1))
    loaded = blade.load(path)
    out = (ref,)
    def trivial_fn(*args):
        return out
    trivial = torch.compile(Trivial().eval(), backend=lambda gm, ex: trivial_fn, dynamic=False); trivial(x)
    fwd = cm.module.forward
    layers = {"eager (3 aten ops)": lambda: model(x),
              "engine.execute from Python": lambda: engine.execute(rargs),
              "spliced ScriptModule, .forward": lambda: fwd(x),
              "spliced ScriptModule, __call__": lambda: cm.module(x),
              "CompiledModule": lambda: cm(x),
              "blade.load module": lambda: loaded(x),
              "torch.compile tt_infer": lambda: compiled(x),
              "torch.compile trivial callable": lambda: trivial(x)}
    for k in ("spliced ScriptModule, __call__", "CompiledModule", "blade.load module", "torch.compile tt_infer"):
        o = layers[k](); o = o[0] if isinstance(o, (tuple, list)) else o
        torch.testing.assert_close(o, ref)
    times = {k: [] for k in layers}
    for r in range(int(os.environ.get("ROUNDS", 300))):
        for name, fn in layers.items():
            t = time.thread_time_ns()
            for _ in range(50): fn()
            times[name].append((time.thread_time_ns() - t) / 50 / 1e3)
for name, v in times.items():
    print(f"{name:34s} {statistics.median(v):7.2f} us  p10 {statistics.quantiles(v, n=10)[0]:6.2f}")
