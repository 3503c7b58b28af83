"""Per-GEMM benchmark: the runtime's GEMM kernels (MKL's sgemm, oneDNN's matmul, oneDNN's inner
product on a reordered weight, the own few-row kernel; cpp/gemm_*.cpp) against ONNX Runtime's MatMul, on the GEMMs the
benchmark models run (bench/models.py: hidden 256 transformers, ViT 192, Llama's MLP, the MLP
block) at batch 1 and 8, as blade's code generator passes them (a Linear's weight transposed and
constant; attention's heads strided inside the fused QKV output).

    python bench/gemm.py                 # prints a markdown table
    python bench/gemm.py --rounds 5

The runtime's kernels are timed by the runtime itself: with BLADE_GEMM=auto a shape's calls sample
the candidates in turn (each one's first call, which packs, is no sample) until the shape's choice
settles; blade._C.gemm_choices() then reports each candidate's best call (no Python in between) and
the kernel chosen. The calls of a round run in one packing scope (a weight packed once, as in an
engine). Each round resets the choices and times again; per kernel the best round counts. ONNX Runtime (default SessionOptions, torch's thread count, the
weight an initializer it prepacks) is timed through session.run: its column includes a few
microseconds of Python and session overhead per call, which only matters for the smallest GEMMs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

import blade._C
from blade._C import _testing

KERNELS = ("mkl", "onednn-matmul", "onednn-packed", "panels")
PAUSE_S = 0.2  # after ONNX Runtime: its spinning worker threads go idle before the runtime is timed
# calls that settle any shape's choice: per candidate (at most 4) a first call and up to 12 samples
# (cpp/gemm_choice.cpp kMaxSamples); calls after it settles run the chosen kernel untimed
SETTLING_CALLS = 4 * 13


@dataclass(frozen=True)
class Gemm:
    """One rt->sgemm call: C_b = op(A_b) op(B_b) for b < batch (blade_abi.h's contract)."""
    models: str
    batch: int
    m: int
    n: int
    k: int
    lda: int
    stride_a: int
    ldb: int
    stride_b: int
    trans_b: bool
    ldc: int
    stride_c: int
    weight: bool  # B is an engine constant (packable); its batch stride is 0

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k

    def label(self) -> str:
        shape = f"[{self.m}, {self.k}] @ [{self.k}, {self.n}]"
        return (f"{self.batch} x " if self.batch > 1 else "") + shape


def linear(models: str, rows: int, k: int, n: int, transposed: bool = True) -> Gemm:
    """x [rows, k] @ W: W stored [n, k] (nn.Linear) or [k, n] (GPT-2's Conv1D)."""
    return Gemm(models, 1, rows, n, k, k, 0, k if transposed else n, 0, transposed, n, 0, True)


def attention(models: str, heads: int, seq: int, dim: int = 64) -> list[Gemm]:
    """Q @ K^T then P @ V for one batch entry, heads as the GEMM batch, Q/K/V read in place from the
    fused QKV output [seq, 3 * hidden] (as BERT's engine does), the context written head-interleaved."""
    hidden = heads * dim
    return [Gemm(models, heads, seq, seq, dim, 3 * hidden, dim, 3 * hidden, dim, True, seq, seq * seq, False),
            Gemm(models, heads, seq, dim, seq, seq, seq * seq, 3 * hidden, dim, False, hidden, dim, False)]


def shapes() -> list[Gemm]:
    out = [linear("MLP block", 8, 256, 1024), linear("MLP block", 8, 1024, 256)]
    for batch in (1, 8):
        rows = 128 * batch
        tag = f"b{batch}"
        out += [linear(f"BERT/DistilBERT/T5 {tag} (QKV)", rows, 256, 768),
                linear(f"BERT/DistilBERT/T5 {tag} (out proj)", rows, 256, 256),
                linear(f"BERT/DistilBERT/T5 {tag} (FFN up)", rows, 256, 1024),
                linear(f"BERT/DistilBERT/T5 {tag} (FFN down)", rows, 1024, 256),
                linear(f"GPT-2 {tag} (Conv1D QKV)", rows, 256, 768, transposed=False),
                linear(f"Llama {tag} (gate/up)", rows, 256, 688),
                linear(f"Llama {tag} (down)", rows, 688, 256),
                linear(f"ViT {tag} (QKV)", 197 * batch, 192, 576),
                linear(f"ViT {tag} (FFN up)", 197 * batch, 192, 768),
                linear(f"ViT {tag} (FFN down)", 197 * batch, 768, 192)]
    out += attention("BERT/GPT-2/T5 attention (per batch entry)", 4, 128)
    out += attention("BERT attention at seq 512 (per batch entry)", 4, 512)
    out += attention("ViT attention (per batch entry)", 3, 197)
    return out


def operands(g: Gemm):
    """Flat float32 buffers laid out as g's call reads them (B: one shared matrix for a weight)."""
    rng = np.random.default_rng(0)
    a_size = (g.batch - 1) * g.stride_a + (g.m - 1) * g.lda + g.k
    b_rows, b_cols = (g.n, g.k) if g.trans_b else (g.k, g.n)
    b_size = (g.batch - 1) * g.stride_b + (b_rows - 1) * g.ldb + b_cols
    c_size = (g.batch - 1) * g.stride_c + (g.m - 1) * g.ldc + g.n
    return [torch.from_numpy(rng.standard_normal(size).astype(np.float32)) for size in (a_size, b_size)] + \
        [torch.zeros(c_size)]


def runtime_times(g: Gemm, a, b, c) -> tuple[dict, str]:
    """{kernel: best call us} as the runtime timed its candidates for g, and the kernel it chose."""
    _testing.set_gemm_backend("auto")
    _testing.sgemm(g.batch, g.m, g.n, g.k, 1.0, a, g.lda, g.stride_a, False, b, g.ldb, g.stride_b, g.trans_b,
                   0.0, c, g.ldc, g.stride_c, pack=g.weight, repeat=SETTLING_CALLS)
    choices = blade._C.gemm_choices()
    if not choices:
        return {}, "mkl (the only candidate)"
    (choice,) = choices
    return dict(choice["microseconds"]), choice["kernel"]


def ort_session(g: Gemm):
    """ONNX Runtime MatMul on dense operands: A [batch, m, k] @ B [k, n] (an initializer) or
    [batch, k, n] (an input)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    a_shape = [g.batch, g.m, g.k] if g.batch > 1 else [g.m, g.k]
    inputs = [helper.make_tensor_value_info("A", TensorProto.FLOAT, a_shape)]
    initializers, feeds = [], {"A": np.random.default_rng(1).standard_normal(a_shape).astype(np.float32)}
    if g.weight:
        initializers.append(numpy_helper.from_array(np.random.default_rng(2).standard_normal((g.k, g.n)).astype(np.float32), "B"))
    else:
        inputs.append(helper.make_tensor_value_info("B", TensorProto.FLOAT, [g.batch, g.k, g.n]))
        feeds["B"] = np.random.default_rng(2).standard_normal((g.batch, g.k, g.n)).astype(np.float32)
    c_shape = a_shape[:-1] + [g.n]
    graph = helper.make_graph([helper.make_node("MatMul", ["A", "B"], ["C"])], "gemm", inputs,
                              [helper.make_tensor_value_info("C", TensorProto.FLOAT, c_shape)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    options = ort.SessionOptions()  # defaults (spinning on), threads pinned like torch's
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return lambda: session.run(None, feeds)


def ort_time_us(run, target_s: float = 0.03) -> float:
    """The median call of ONNX Runtime over about target_s (after a warm-up), in microseconds."""
    for _ in range(3):
        run()
    start = time.perf_counter()
    run()
    calls = int(min(max(target_s / max(time.perf_counter() - start, 1e-7), 5), 400))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    rows = []
    for g in shapes():
        a, b, c = operands(g)
        ort_run = ort_session(g)
        best = {name: float("inf") for name in (*KERNELS, "ort")}
        chosen = []
        for _ in range(args.rounds):
            best["ort"] = min(best["ort"], ort_time_us(ort_run))
            time.sleep(PAUSE_S)
            timed, kernel = runtime_times(g, a, b, c)
            chosen.append(kernel)
            for name, us in timed.items():
                best[name] = min(best[name], us)
        _testing.set_gemm_backend("")
        rows.append((g, best, max(set(chosen), key=chosen.count)))
        print(f"done {g.models} {g.label()}", file=sys.stderr, flush=True)

    load = os.getloadavg()[0]
    print(f"threads {torch.get_num_threads()}, {args.rounds} rounds, 1-minute load at the end {load:.1f}; "
          "us per GEMM (GFLOP/s); '-' = not a candidate for that call\n")
    print("| models | GEMM | MKL | oneDNN matmul | oneDNN packed | panels | ONNX Runtime | auto picks | ORT time / best blade time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for g, best, chosen in rows:
        cells = []
        for name in (*KERNELS, "ort"):
            us = best[name]
            cells.append("-" if us == float("inf") else f"{us:.1f} ({g.flops / us / 1e3:.0f})")
        ours = min(best[name] for name in KERNELS)
        print(f"| {g.models} | {g.label()} | {' | '.join(cells)} | {chosen} | {best['ort'] / ours:.2f} |")


if __name__ == "__main__":
    main()
