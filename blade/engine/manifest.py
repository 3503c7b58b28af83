"""The engine manifest: what a compiled cluster .so expects and produces (torch-free).

Written by the engine compiler next to each ``engine_<k>.so`` as JSON, read by the torch side to
build an Engine. Tensors are described by dtype name (numpy spelling) and static shape.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

MANIFEST_FORMAT = 1
ENTRY_SYMBOL = "blade_engine_run"

# dtype name -> (C++ element type, bytes per element). The engine supports exactly these.
DTYPES = {
    "float32": ("float", 4),
    "float64": ("double", 8),
    "int64": ("int64_t", 8),
    "int32": ("int32_t", 4),
    "bool": ("bool", 1),
}


@dataclass
class TensorSpec:
    name: str
    dtype: str
    shape: list[int]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Manifest:
    abi_version: int
    isa: str                      # the -march level the code needs, e.g. "x86-64-v3"
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    constants: list[TensorSpec]   # ONNX initializers passed at run time, in this order
    scratch_bytes: int
    entry: str = ENTRY_SYMBOL
    format: int = MANIFEST_FORMAT
    compile_command: list[str] = field(default_factory=list)
    compiler_version: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        raw = json.loads(text)
        if raw.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"manifest format {raw.get('format')} is not {MANIFEST_FORMAT}")
        for key in ("inputs", "outputs", "constants"):
            raw[key] = [TensorSpec(**t) for t in raw[key]]
        return cls(**raw)
