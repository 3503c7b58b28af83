"""Serving start-up costs for BERT (transformers BertModel, 4 layers, hidden 256, seq 128, random
weights), each measured in a fresh process:

  compile (cold cache) / compile (warm cache)   torch.compile(backend="tt_infer"): first call, and
                                                cluster cache hits
  start -> first inference                      via blade.load, via torch's precompile load, via a
                                                cold and a warm-cache torch.compile

    .venv/bin/python bench/serving_startup.py [work_dir]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
import torch, transformers
import blade
from blade.dynamo import tt_infer
mode, work = sys.argv[1], sys.argv[2]

def build():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                  intermediate_size=1024)
    model = transformers.BertModel(cfg).eval()
    inputs = (torch.randint(0, cfg.vocab_size, (1, 128)), torch.ones(1, 128, dtype=torch.int64))
    return model, inputs

result = {}
with torch.no_grad():
    if mode == "compile":
        model, inputs = build()
        reports = []
        def backend(gm, example_inputs):
            compiled = tt_infer(gm, example_inputs)
            reports.append(compiled.report)
            return compiled
        start = time.perf_counter()
        torch.compile(model, backend=backend)(*inputs)
        result["first_call_s"] = time.perf_counter() - start
        clusters = [c for r in reports for c in r.clusters if c.status == "compiled"]
        result["engines"], result["cache_hits"] = len(clusters), sum(c.cache_hit for c in clusters)
    elif mode == "export":
        model, inputs = build()
        blade.export(model, inputs, f"{work}/bert.blade.pt")
        # BERT's code gets identity guards dynamo cannot serialize: keep tensor/shape/grad guards
        blade.precompile(model, inputs, f"{work}/bert.aot",
                         guard_filter_fn=torch.compiler.keep_portable_guards_unsafe)
    elif mode == "load":
        inputs = torch.load(f"{work}/inputs.pt")
        blade.load(f"{work}/bert.blade.pt")(*inputs)
    elif mode == "load_precompiled":
        model, inputs = build()   # the model is external data of a precompiled function
        blade.load_precompiled(f"{work}/bert.aot", model)(*inputs)
result["first_inference_at"] = time.time()
print(json.dumps(result))
"""


def child(mode: str, work: str, cache: str) -> dict:
    env = dict(os.environ, BLADE_CACHE_DIR=cache)
    started = time.time()
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, work], env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{mode} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["start_to_first_inference_s"] = result.pop("first_inference_at") - started
    return result


def main() -> None:
    scratch = None if len(sys.argv) > 1 else tempfile.TemporaryDirectory(prefix="blade-serving-")  # removed at exit
    work = sys.argv[1] if scratch is None else scratch.name
    cache = os.path.join(work, "cache")
    import torch
    torch.manual_seed(0)
    torch.save((torch.randint(0, 30522, (1, 128)), torch.ones(1, 128, dtype=torch.int64)),
               os.path.join(work, "inputs.pt"))
    rows = {
        "torch.compile, cold cache": child("compile", work, cache),
        "torch.compile, warm cache": child("compile", work, cache),
    }
    child("export", work, cache)
    rows["blade.load"] = child("load", work, cache)
    rows["precompile load"] = child("load_precompiled", work, cache)
    for name, row in rows.items():
        extra = (f"  first call {row['first_call_s']:.2f} s, {row['cache_hits']}/{row['engines']} engines from cache"
                 if "first_call_s" in row else "")
        print(f"{name:28s} process start -> first inference {row['start_to_first_inference_s']:6.2f} s{extra}")


if __name__ == "__main__":
    main()
