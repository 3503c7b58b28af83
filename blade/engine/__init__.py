"""blade's engine compiler: ONNX cluster -> generated C++ -> g++ -> engine .so + manifest.

Contract (DESIGN.md #2): nothing under blade/engine imports torch. It reads an ONNX file and options
and writes a shared object and a JSON manifest; it can be tested alone against numpy.

Modules, one job each:
  ir.py           primitive IR and the ONNX -> IR rule table (decompositions included)
  plan.py         the plan stage: which nodes are stored, their layouts, conv epilogues (plan.txt)
  codegen.py      plan -> C++: runs the stages below over the plan's stored nodes
    symbolic.py     integer index expressions with bounds, simplified, rendered to C++ at the end
    views.py        index / stride semantics of views (permute, expand, slice, reshape, window)
    buffers.py      buffers of nodes, strided views, dim orders, the scratch arena plan
    optable.py      the C++ of each op on scalars (CODE_FOR_OP), reductions, op costs
    lines.py        C++ lines with parts rendered late, loop scopes (CSE, hoisting)
    expressions.py  the value of a node at an index: loads, inlined producers, reductions
    loops.py        loop kernels, row groups and their legality, stack rows
    calls.py        GEMM and convolution calls into the runtime
    render.py       row groups and the whole engine as C++ source
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
