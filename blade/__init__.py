"""blade: a TorchScript clustering compiler for CPU inference.

``import blade`` registers the dynamo backend ``tt_infer`` and the TorchScript class
``torch.classes.blade.Engine`` (so saved blade modules load with plain ``torch.jit.load``).
"""
import torch  # noqa: F401  (loads libtorch before our extension needs it)

from blade import _C  # noqa: F401  (registers torch.classes.blade.Engine)
from blade import dynamo as _dynamo  # noqa: F401  (registers the tt_infer backend)
from blade.aot import CorruptArtifact, IncompatibleArtifact, load_precompiled, precompile
from blade.config import Config
from blade.debug import BisectResult, bisect, set_fallback_mode
from blade.explain import Explanation, explain
from blade.export import compile_model, export, load
from blade.pipeline import CompiledModule, CompileReport
from blade.profile import Profile, profile


def runtime_library() -> str:
    """The path of blade's runtime library (libblade_runtime.so, next to blade._C, which links it):
    the Engine class and its runtime without Python, for C++ programs that load blade archives with
    libtorch alone (link it, or dlopen it before torch::jit::load; examples/cpp)."""
    from pathlib import Path

    return str(Path(_C.__file__).with_name("libblade_runtime.so"))

__all__ = ["Config", "CompiledModule", "CompileReport", "compile_model", "export", "load", "CorruptArtifact",
           "IncompatibleArtifact",
           "load_precompiled", "precompile", "explain", "Explanation", "bisect", "BisectResult",
           "set_fallback_mode", "profile", "Profile", "runtime_library"]
