"""The engine manifest: what a compiled cluster .so expects and produces (torch-free).

Written by the engine compiler next to each ``engine_<k>.so`` as JSON, read by the torch side to
build an Engine. Tensors are described by dtype name (numpy spelling) and shape; a dim of a shape
is a size or the name of one of the manifest's size symbols (a dim whose value the host binds from
the inputs at run time, within the symbol's [min, max], and passes to the engine).
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
    shape: list          # ints, and names of size symbols

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            if isinstance(d, str):
                raise ValueError(f"{self.name} has a run-time dim {d!r}: no static element count")
            n *= d
        return n


@dataclass
class SizeSymbol:
    name: str
    min: int
    max: int


@dataclass
class Manifest:
    abi_version: int
    isa: str                      # the -march level the code needs, e.g. "x86-64-v3"
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    constants: list[TensorSpec]   # ONNX initializers passed at run time, in this order
    scratch_bytes: int            # at the size symbols' maxima
    symbols: list[SizeSymbol] = field(default_factory=list)
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
        raw["symbols"] = [SizeSymbol(**s) for s in raw.get("symbols", [])]
        return cls(**raw)

    def shape_codes(self, spec: TensorSpec) -> list[int]:
        """spec's shape as the Engine constructor takes it: a size symbol k is -1 - k."""
        index = {s.name: k for k, s in enumerate(self.symbols)}
        return [-1 - index[d] if isinstance(d, str) else d for d in spec.shape]
