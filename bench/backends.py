"""The backends compared: name -> prepare(model, inputs) -> callable. Preparation (tracing,
compiling, exporting) and the first call are timed by the caller as the compile time.

Peers run the way their users run them (DESIGN.md: "peers run at their defaults"): ONNX Runtime
with default SessionOptions (its worker threads spin between runs; the bench's pause between
backends absorbs that, not ORT's settings), Inductor as `torch.compile`'s default and with
`freezing=True`, TorchScript traced + frozen + optimize_for_inference.
"""
from __future__ import annotations

import copy
import io
import os
import platform
import statistics
import time
import warnings

import torch


class FlatOutputs(torch.nn.Module):
    """The model with a flat tuple of tensors as output (transformers return ModelOutput dicts,
    which tracing and ONNX export handle poorly); used for TorchScript and ONNX Runtime."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        out = self.model(*inputs)
        return tuple(out.to_tuple()) if hasattr(out, "to_tuple") else out


def eager(model, inputs):
    return model


def torchscript_frozen(model, inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(FlatOutputs(model).eval(), inputs, strict=False, check_trace=False)
        return torch.jit.optimize_for_inference(torch.jit.freeze(traced))


def inductor(model, inputs):
    return torch.compile(model)


def inductor_frozen(model, inputs):
    """Inductor with weights folded as constants (its inference setting). The config is read when
    dynamo compiles, i.e. at the first call, so that call happens inside the patch."""
    compiled = torch.compile(model)
    with torch._inductor.config.patch(freezing=True):
        compiled(*inputs)
    return compiled


# ---------------------------------------------------------------------------------------------
# ONNX Runtime: both exporters, the one that exports and runs faster wins (per model)
# ---------------------------------------------------------------------------------------------

def _export_torchscript(flat, inputs) -> bytes:
    buffer = io.BytesIO()
    torch.onnx.export(flat, inputs, buffer, dynamo=False, opset_version=17)
    return buffer.getvalue()


def _export_dynamo(flat, inputs) -> bytes:
    return torch.onnx.export(flat, inputs, dynamo=True, verbose=False).model_proto.SerializeToString()


EXPORTERS = {"dynamo": _export_dynamo, "TorchScript": _export_torchscript}
ORT_CHOSEN: dict = {}  # model key -> exporter picked (for the table)


def _ort_runner(onnx_bytes: bytes):
    import onnxruntime as ort
    options = ort.SessionOptions()  # defaults (spinning on), threads pinned like torch's
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(onnx_bytes, options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def run(*args):
        # an exporter may drop an input the graph does not read; feed by name, in order
        feeds = {name: arg.numpy() for name, arg in zip(names, args)}
        return [torch.from_numpy(out) for out in session.run(None, feeds)]
    return run


def machine() -> str:
    """The machine a table was measured on, with the vector ISA blade's engines compile for: whole
    tables change between an AVX-512 and an AVX2-only CPU (blade's own kernels and oneDNN's
    matmul differ there), so a reader must see which one."""
    from blade.engine.compiler import native_isa
    vectors = {"x86-64-v4": "AVX-512", "x86-64-v3": "AVX2, no AVX-512"}.get(native_isa(), "no AVX2")
    return f"{platform.processor() or platform.machine()} ({native_isa()}: {vectors}), {os.cpu_count()} cores"


def median_call_s(fn, inputs, calls: int) -> float:
    """The median wall time of one call of fn(*inputs) over calls calls (the bench's one timer)."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(*inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def onnxruntime_cpu(model, inputs):
    # A copy: an exporter may write to the model it exports (HF Swin stores its clamped window size
    # as a tensor while the TorchScript exporter traces), and the backends timed after it then
    # compiled a changed model (dynamo saw a tensor branch, and blade.export refused).
    flat = FlatOutputs(copy.deepcopy(model)).eval()
    candidates, errors = {}, {}
    for name, export in EXPORTERS.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                runner = _ort_runner(export(flat, inputs))
            runner(*inputs)  # warm-up
            candidates[name] = (median_call_s(runner, inputs, 7), runner)
        except Exception as err:  # noqa: BLE001  one exporter failing is normal; both failing is reported
            errors[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:100] if str(err) else ''}"
    if not candidates:
        raise RuntimeError("; ".join(f"{k} exporter: {v}" for k, v in errors.items()))
    best = min(candidates, key=lambda k: candidates[k][0])
    ORT_CHOSEN["last"] = best + (" (only one exported)" if len(candidates) == 1 else "")
    return candidates[best][1]


TT_INFER_REPORTS: list = []  # CompileReport of every graph tt_infer compiled (coverage column)
AOT_REPORTS: dict = {}       # "last": the CompileReport of the last archive tt_infer_aot exported


def tt_infer(model, inputs):
    from blade.dynamo import tt_infer as backend

    def recording_backend(gm, example_inputs):
        compiled = backend(gm, example_inputs)
        TT_INFER_REPORTS.append(getattr(compiled, "report", None))  # None: whole graph ran eagerly
        return compiled
    return torch.compile(model, backend=recording_backend)


def tt_infer_aot(model, inputs):
    """The serving path: blade.export's archive loaded with blade.load (no dynamo, no guards per
    call; the engines are the ones tt_infer compiled, from blade's cache)."""
    import tempfile
    import blade
    with tempfile.TemporaryDirectory(prefix="blade-bench-aot-") as folder:  # loaded whole: not kept
        path = folder + "/model.blade.pt"
        AOT_REPORTS["last"] = blade.export(model, inputs, path).report
        return blade.load(path)


BACKENDS = {
    "eager": eager,
    "TorchScript frozen": torchscript_frozen,
    "Inductor": inductor,
    "Inductor frozen": inductor_frozen,
    "ONNX Runtime": onnxruntime_cpu,
    "tt_infer": tt_infer,
    "tt_infer AOT": tt_infer_aot,
}
