"""The backends compared: name -> prepare(model, inputs) -> callable. Preparation (tracing,
compiling, exporting) and the first call are timed by the caller as the compile time."""
from __future__ import annotations

import io
import warnings

import torch


def eager(model, inputs):
    return model


def torchscript_frozen(model, inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(model, inputs, strict=False, check_trace=False)
        return torch.jit.optimize_for_inference(torch.jit.freeze(traced))


def inductor(model, inputs):
    return torch.compile(model)


def onnxruntime_cpu(model, inputs):
    import onnxruntime as ort
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs, buffer, dynamo=False, opset_version=17)
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    # idle ORT threads spin after each run and would slow whatever is timed next
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(buffer.getvalue(), options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def run(*args):
        feeds = {name: arg.numpy() for name, arg in zip(names, args)}
        return [torch.from_numpy(out) for out in session.run(None, feeds)]
    return run


TT_INFER_REPORTS: list = []  # CompileReport of every graph tt_infer compiled (coverage column)


def tt_infer(model, inputs):
    from blade.dynamo import tt_infer as backend

    def recording_backend(gm, example_inputs):
        compiled = backend(gm, example_inputs)
        TT_INFER_REPORTS.append(getattr(compiled, "report", None))  # None: whole graph ran eagerly
        return compiled
    return torch.compile(model, backend=recording_backend)


BACKENDS = {
    "eager": eager,
    "TorchScript frozen": torchscript_frozen,
    "Inductor": inductor,
    "ONNX Runtime": onnxruntime_cpu,
    "tt_infer": tt_infer,
}
