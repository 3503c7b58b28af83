"""The backends compared: name -> prepare(model, inputs) -> callable. Preparation (tracing,
compiling, exporting) and the first call are timed by the caller as the compile time."""
from __future__ import annotations

import io
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


def _onnx_bytes(model, inputs) -> bytes:
    """The TorchScript-based exporter, else the dynamo-based one (it covers ops such as
    aten::diff in transformers' mask code that the older exporter lacks)."""
    flat = FlatOutputs(model).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            buffer = io.BytesIO()
            torch.onnx.export(flat, inputs, buffer, dynamo=False, opset_version=17)
            return buffer.getvalue()
        except Exception:  # noqa: BLE001
            return torch.onnx.export(flat, inputs, dynamo=True, verbose=False).model_proto.SerializeToString()


def onnxruntime_cpu(model, inputs):
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    # idle ORT threads spin after each run and would slow whatever is timed next
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(_onnx_bytes(model, inputs), options, providers=["CPUExecutionProvider"])
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
