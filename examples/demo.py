"""The main job: compile a real model with tt_infer, check it against eager, time it, export it,
and run the exported artifact in a fresh process that cannot reach a C++ compiler.

    python examples/demo.py [--model bert|gpt2] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import torch
import transformers

import blade


def build(name: str):
    torch.manual_seed(0)
    if name == "bert":
        cfg = transformers.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                      intermediate_size=1024)
        model = transformers.BertModel(cfg).eval()
        inputs = (torch.randint(0, cfg.vocab_size, (1, 128)), torch.ones(1, 128, dtype=torch.int64))
    else:
        cfg = transformers.GPT2Config(n_embd=256, n_layer=4, n_head=4)
        model = transformers.GPT2Model(cfg).eval()
        inputs = (torch.randint(0, cfg.vocab_size, (1, 128)),)
    return model, inputs


def median_ms(fn, inputs, rounds=30):
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn(*inputs)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def export_and_serve(model, inputs, expected, name: str, out_dir: str) -> int:
    """Steps 3 and 4: blade.export into out_dir, then blade.load in a fresh process."""
    artifact = os.path.join(out_dir, f"{name}.blade.pt")
    exported = blade.export(model, inputs, artifact)
    report = exported.report
    print(f"\n[3] blade.export -> {artifact} ({os.path.getsize(artifact) / 2**20:.1f} MiB)")
    print(f"    {report.aten_in_engines}/{report.aten_total} aten ops in {len(report.clusters)} engine(s) "
          f"({100 * report.coverage:.1f}%)")
    torch.save({"inputs": inputs, "expected": expected}, os.path.join(out_dir, "io.pt"))

    serve = textwrap.dedent(f"""
        import time; started = time.perf_counter()
        import torch, blade
        io = torch.load({os.path.join(out_dir, 'io.pt')!r})
        m = blade.load({artifact!r})
        with torch.no_grad():
            out = m(*io["inputs"])[0]
        first = time.perf_counter() - started
        err = (out - io["expected"]).abs().max().item()
        assert 'prim::CallMethod[name="execute"]' in str(m.graph)
        print(f"    fresh process: first inference {{first:.2f}}s after start, max abs error vs eager {{err:.2e}}")
        assert err <= 1e-4 * io["expected"].abs().max().item()
    """)
    env = dict(os.environ, PATH="/nonexistent")  # no g++ reachable: serving must not compile
    result = subprocess.run([sys.executable, "-c", serve], env=env, capture_output=True, text=True)
    print("\n[4] run the artifact in a fresh process (no C++ compiler on PATH)")
    print(result.stdout.rstrip())
    if result.returncode != 0:
        print(result.stderr, file=sys.stderr)
        return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["bert", "gpt2"], default="bert")
    parser.add_argument("--out", default=None, help="where to keep the artifact (default: a temp dir, removed at exit)")
    args = parser.parse_args()
    model, inputs = build(args.model)
    print(f"model: transformers {type(model).__name__}, random weights, inputs {[list(x.shape) for x in inputs]}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    with torch.no_grad():
        expected = model(*inputs).last_hidden_state
        started = time.perf_counter()
        compiled = torch.compile(model, backend="tt_infer")
        actual = compiled(*inputs).last_hidden_state
        print(f"\n[1] torch.compile(backend='tt_infer'): first call (trace + compile) {time.perf_counter() - started:.1f}s")
        err = (actual - expected).abs().max().item()
        rel = err / expected.abs().max().item()
        print(f"    max abs error vs eager {err:.2e} (relative {rel:.2e})  -> {'OK' if rel <= 1e-4 else 'MISMATCH'}")

        eager_ms, blade_ms = [], []
        for _ in range(5):  # interleaved rounds: the machine is shared and noisy
            eager_ms.append(median_ms(model, inputs))
            blade_ms.append(median_ms(compiled, inputs))
        e, b = statistics.median(eager_ms), statistics.median(blade_ms)
        print(f"\n[2] median latency: eager {e:.2f} ms, tt_infer {b:.2f} ms -> speedup {e / b:.2f}x")

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        served = export_and_serve(model, inputs, expected, args.model, args.out)
    else:  # nothing left behind in /tmp (--out keeps the artifact)
        with tempfile.TemporaryDirectory(prefix="blade-demo-") as out_dir:
            served = export_and_serve(model, inputs, expected, args.model, out_dir)
    return served if served else (0 if rel <= 1e-4 else 1)


if __name__ == "__main__":
    sys.exit(main())
