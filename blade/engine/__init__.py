"""blade's engine compiler: ONNX cluster -> generated C++ -> g++ -> engine .so + manifest.

Contract (DESIGN.md #2): nothing under blade/engine imports torch. It reads an ONNX file and options
and writes a shared object and a JSON manifest; it can be tested alone against numpy.

Modules, one job each:
  ir.py           primitive IR and the ONNX -> IR rule table (decompositions included)
  views.py        index / stride semantics of views (permute, expand, slice, reshape)
  codegen.py      IR -> C++ (scheduling, fused loop nests, op tables, arena planning)
  compiler.py     compile_onnx (+ options, ISA, compiler discovery, load_constants)
  compile_main.py the per-job CLI the driver runs in a subprocess
  driver.py       compile_many: parallel subprocess compiles with timeouts
  cache.py        content-addressed engine cache
  npruntime.py    a torch-free ctypes runner (tests, debugging)
"""
from .compiler import CompilerNotFound, EngineCompileError, compile_onnx, load_constants
from .driver import CompileResult, compile_many
from .ir import UnsupportedOnnxOp
from .manifest import Manifest, TensorSpec

__all__ = ["compile_onnx", "load_constants", "compile_many", "CompileResult", "Manifest", "TensorSpec",
           "UnsupportedOnnxOp", "EngineCompileError", "CompilerNotFound"]
