"""Where the time of a torch.compile(tt_infer) call goes beyond the CompiledModule itself: CPU time
of the calling thread (one thread, so a shared machine does not count), split into the time inside
the compiled callable and the rest (dynamo's guards, argument gathering, output rebuild), for:

- direct: the CompiledModule called with dynamo's captured arguments;
- dynamo+cm: the same CompiledModule behind dynamo;
- dynamo+trivial: a callable returning fixed outputs (dynamo's own floor, warm caches);
- dynamo+thrash: a callable returning fixed outputs after writing 64 MB (dynamo's floor when the
  call before it evicted the caches, as a large model's run does).

When dynamo+cm's "outside" matches dynamo+thrash's rather than dynamo+trivial's, the extra is
dynamo's per-call state (guards over every parameter) read from cold caches, not blade's.

    PYTHONPATH=$PWD python bench/dynamo_split.py                  # MobileNetV2 batch 1
    MODEL=mlp INNER=100 PYTHONPATH=$PWD python bench/dynamo_split.py
    GUARDS=skip_guard_on_all_nn_modules_unsafe PYTHONPATH=$PWD python bench/dynamo_split.py

GUARDS names one of torch.compiler's guard filters (an opt-in that drops guards, see README.md):
every dynamo layer is compiled with options={"guard_filter_fn": it}.
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
import blade  # noqa: E402,F401 - registers tt_infer
from blade.config import Config  # noqa: E402
from blade.debug import CapturingBackend  # noqa: E402
from bench import models  # noqa: E402

NAME = os.environ.get("MODEL", "mobilenet_v2")
INNER, ROUNDS = int(os.environ.get("INNER", 10)), int(os.environ.get("ROUNDS", 30))
clock = time.thread_time_ns
GUARDS = os.environ.get("GUARDS")
OPTIONS = {"guard_filter_fn": getattr(torch.compiler, GUARDS)} if GUARDS else None
torch.set_num_threads(1)
model, inputs = getattr(models, NAME)(*([1] if NAME in ("mobilenet_v2", "vit", "distilbert", "convnext", "t5_encoder", "llama", "bert_padded") else []))
inside_ns = [0]


def timed(fn):
    """fn, adding its own CPU time to inside_ns."""
    def call(*args):
        start = clock()
        out = fn(*args)
        inside_ns[0] += clock() - start
        return out
    return call


def compiled(callable_):
    """torch.compile of the model (a fresh code object each, so dynamo caches stay apart)."""
    fn = torch.compile(lambda *x: model(*x), backend=lambda gm, ex, **_: callable_, dynamic=False,
                       options=dict(OPTIONS) if OPTIONS else None)
    fn(*inputs)
    return fn


with torch.no_grad():
    backend = CapturingBackend(Config())
    torch.compile(model, backend=backend, dynamic=False)(*inputs)
    cm = backend.compiled[0]
    captured = {}

    def capture(*args):
        captured["args"] = args
        return cm(*args)
    via_cm = compiled(timed(capture))
    outs = model(*inputs)
    flat = tuple(outs.values()) if isinstance(outs, dict) else (outs,)
    junk = torch.empty(64 << 20, dtype=torch.uint8)
    via_trivial = compiled(timed(lambda *a: flat))
    via_thrash = compiled(timed(lambda *a: (junk.add_(1), flat)[1]))
    args = captured["args"]
    direct = timed(cm)
    layers = {"direct": lambda: direct(*args), "dynamo+cm": lambda: via_cm(*inputs),
              "dynamo+trivial": lambda: via_trivial(*inputs), "dynamo+thrash": lambda: via_thrash(*inputs)}
    for fn in layers.values():
        for _ in range(20):
            fn()
    total, inside = {k: [] for k in layers}, {k: [] for k in layers}
    for _ in range(ROUNDS):
        for name, fn in layers.items():
            inside_ns[0] = 0
            start = clock()
            for _ in range(INNER):
                fn()
            total[name].append((clock() - start) / INNER / 1e3)
            inside[name].append(inside_ns[0] / INNER / 1e3)
print(f"{NAME}, 1 thread, CPU us per call (median of {ROUNDS} rounds of {INNER})"
      + (f", guard_filter_fn={GUARDS}" if GUARDS else ""))
for name in layers:
    outside = statistics.median([t - i for t, i in zip(total[name], inside[name])])
    print(f"{name:16s} total {statistics.median(total[name]):8.1f}  inside {statistics.median(inside[name]):8.1f}  "
          f"outside {outside:8.1f}")
