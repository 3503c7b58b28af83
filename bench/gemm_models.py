"""The benchmark models with each GEMM backend, in one process: eager, tt_infer with BLADE_GEMM=mkl,
tt_infer with the default (auto: each shape's kernel timed), ONNX Runtime. One compile; the backend
switches between rounds (_testing.set_gemm_backend, the choices re-timed on the warm-up calls), so
the ratios compare the same engines under the same load.

    python bench/gemm_models.py --models "BERT,GPT-2"      # substrings of bench/models.py's names
    python bench/gemm_models.py --rounds 7

Rounds rotate the order of the variants; per round the median of enough calls for ~0.1 s of eager,
after 3 warm-up calls and followed by a 0.2 s pause (ONNX Runtime's threads spin after a run); per
variant the best round. The 1-minute load average is printed: on the shared 2-core machine, read
ratios from rows where it stayed low.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from blade._C import _testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backends import BACKENDS, median_call_s  # noqa: E402
from models import MODELS  # noqa: E402

PAUSE_S = 0.2


def variants(model, inputs) -> list:
    """(label, fn, GEMM backend or None) per variant; ONNX Runtime left out if it cannot export."""
    tt_infer = BACKENDS["tt_infer"](model, inputs)
    out = [("eager", BACKENDS["eager"](model, inputs), None), ("tt_infer mkl", tt_infer, "mkl"),
           ("tt_infer auto", tt_infer, "auto")]
    try:
        out.append(("ONNX Runtime", BACKENDS["ONNX Runtime"](model, inputs), None))
    except Exception as err:  # noqa: BLE001  reported, the rest still runs
        print(f"  ONNX Runtime: {type(err).__name__}: {str(err)[:100]}", file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="BERT,GPT-2,T5,Llama,ViT,MLP")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    wanted = [w.strip().lower() for w in args.models.split(",") if w.strip()]
    print("| model | load | eager ms | tt_infer mkl x | tt_infer auto x | ONNX Runtime x | auto / mkl | ONNX Runtime ms / auto ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name in (n for n in MODELS if any(w in n.lower() for w in wanted)):
        model, inputs = MODELS[name]()
        with torch.no_grad():
            runs = variants(model, inputs)
            start = time.perf_counter()
            model(*inputs)
            calls = max(5, min(200, int(0.1 / max(time.perf_counter() - start, 1e-5))))
            best, loads = {label: float("inf") for label, _, _ in runs}, []
            for r in range(args.rounds):
                for label, fn, gemm in runs[r % len(runs):] + runs[:r % len(runs)]:
                    if gemm is not None:
                        _testing.set_gemm_backend(gemm)
                    for _ in range(3):
                        fn(*inputs)
                    best[label] = min(best[label], median_call_s(fn, inputs, calls))
                    time.sleep(PAUSE_S)
                loads.append(os.getloadavg()[0])
            _testing.set_gemm_backend("")
        torch._dynamo.reset()
        eager = best["eager"]
        ratio = lambda label: f"{eager / best[label]:.2f}" if label in best else "-"  # noqa: E731
        ort = f"{best['ONNX Runtime'] / best['tt_infer auto']:.2f}" if "ONNX Runtime" in best else "-"
        print(f"| {name} | {min(loads):.1f}-{max(loads):.1f} | {eager * 1e3:.2f} | {ratio('tt_infer mkl')} | "
              f"{ratio('tt_infer auto')} | {ratio('ONNX Runtime')} | "
              f"{best['tt_infer mkl'] / best['tt_infer auto']:.2f} | {ort} |", flush=True)


if __name__ == "__main__":
    main()
