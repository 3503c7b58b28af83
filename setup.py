"""Builds blade: the Python packages, the runtime library ``blade/libblade_runtime.so`` and the
Python extension ``blade._C`` on top of it (sources in cpp/).

    pip install --no-build-isolation -e .      # torch is already installed; never re-download it
"""
import os
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py
from torch.utils.cpp_extension import BuildExtension, CppExtension, include_paths, library_paths

ROOT = Path(__file__).resolve().parent

# The runtime proper: the Engine custom class, its state (and its SHA-256 content hashes, through
# OpenSSL's libcrypto: RUNTIME_LIBRARIES), the BladeRuntime table, the .so loader, ISA checks.
# Free of pybind/Python: built once into a plain shared library (RUNTIME_LIBRARY) that blade._C links
# and C++ programs link or dlopen to load saved blade modules with libtorch alone
# (examples/cpp). The single list of them (examples/cpp/CMakeLists.txt reads it from here).
RUNTIME_SOURCES = [
    "cpp/activation.cpp",
    "cpp/archive_check.cpp",
    "cpp/content_digest.cpp",
    "cpp/conv_gemm.cpp",
    "cpp/conv_patch.cpp",
    "cpp/conv_patch_x86_64.cpp",  # conv_patch's kernels, one unit per ISA (conv_patch_blocks.h)
    "cpp/conv_patch_x86_64_v3.cpp",
    "cpp/conv_patch_x86_64_v4.cpp",
    "cpp/depthwise.cpp",
    "cpp/expand_depthwise.cpp",
    "cpp/grouped_conv.cpp",
    "cpp/engine.cpp",
    "cpp/engine_fallback.cpp",
    "cpp/engine_registration.cpp",
    "cpp/engine_state.cpp",
    "cpp/gemm_choice.cpp",
    "cpp/gemm_panels.cpp",
    "cpp/gemm_mkl.cpp",
    "cpp/gemm_onednn.cpp",
    "cpp/isa.cpp",
    "cpp/oversubscription.cpp",
    "cpp/runtime.cpp",
    "cpp/output_pool.cpp",
    "cpp/scratch_pool.cpp",
    "cpp/winograd.cpp",
    "cpp/shared_library.cpp",
    "cpp/tensor_spec.cpp",
]
RUNTIME_LIBRARIES = ["crypto"]
# The runtime library's extension name: blade/libblade_runtime.so (no Python ABI tag: it is no
# Python module). One copy per process: blade._C has none of its sources, it links it (rpath
# $ORIGIN), so the Engine class, the thread-local scratch and the GEMM choice state exist once.
RUNTIME_LIBRARY = "blade.libblade_runtime"
# What the Python extension adds on top: the pybind module, its test hooks, the per-call
# frozen-weights check, the direct engine call of blade.load.
PYTHON_SOURCES = ["cpp/python_module.cpp", "cpp/python_testing.cpp", "cpp/frozen_tensors.cpp",
                  "cpp/python_engine_call.cpp"]
HEADERS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "cpp").glob("*.h"))

# torch 2.13's headers use a C++20 extension (bit-field initializers) that g++ accepts in C++17.
# -fopenmp: at::parallel_for is an inline `#pragma omp parallel` in torch's OpenMP builds; without
# it the runtime's parallel_for would run serially. The libgomp.so.1 this links resolves (by soname)
# to the one torch already loaded, so there is still a single OpenMP runtime in the process.
CXX_FLAGS = ["-O2", "-std=c++17", "-Wno-c++20-extensions", "-fopenmp"]
LINK_FLAGS = ["-fopenmp"]

# Generated engine code includes these headers (blade/engine/compiler.py ENGINE_HEADERS);
# installed copies find them at blade/include/.
ENGINE_HEADERS = ["cpp/blade_abi.h", "cpp/engine_prelude.h"]
INSTALLED_INCLUDE_DIR = "blade/include"


class BuildRuntimeThenExtension(BuildExtension):
    """BuildExtension that names the runtime library libblade_runtime.so and links blade._C to the
    copy it has just built (the extensions build in ext_modules' order: the runtime first)."""

    def get_ext_filename(self, ext_name):
        filename = super().get_ext_filename(ext_name)
        # asked with the full name or its last part (build_ext.get_ext_fullpath)
        runtime_name = RUNTIME_LIBRARY.split(".")[-1]
        if ext_name.split(".")[-1] == runtime_name:
            return os.path.join(os.path.dirname(filename), runtime_name + ".so")  # no Python ABI tag
        return filename

    def build_extension(self, ext):
        if ext.name != RUNTIME_LIBRARY:
            runtime_dir = os.path.dirname(self.get_ext_fullpath(RUNTIME_LIBRARY))
            ext.library_dirs = [runtime_dir] + [d for d in ext.library_dirs if d != runtime_dir]
        super().build_extension(ext)


class BuildPyWithEngineHeaders(build_py):
    """build_py that also ships the ENGINE_HEADERS under blade/include/ (editable checkouts read
    them from cpp/ directly)."""

    def _installed(self) -> list:
        return [os.path.join(self.build_lib, INSTALLED_INCLUDE_DIR, Path(h).name) for h in ENGINE_HEADERS]

    def run(self):
        super().run()
        for header, target in zip(ENGINE_HEADERS, self._installed()):
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / header, target)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + self._installed()


setup(
    name="blade",
    version="0.1.0",
    description="A TorchScript clustering compiler for PyTorch CPU inference",
    python_requires=">=3.10",
    packages=["blade", "blade.cluster", "blade.cluster.rules", "blade.engine"],
    install_requires=["torch==2.13.0", "onnx", "numpy"],
    ext_modules=[
        # libtorch alone (not torch_python, no pybind): --no-undefined makes a Python symbol, or a
        # source missing from RUNTIME_SOURCES, a link error here instead of in a C++ program.
        Extension(
            name=RUNTIME_LIBRARY,
            sources=RUNTIME_SOURCES,
            depends=HEADERS,
            include_dirs=[str(ROOT / "cpp")] + include_paths(),
            library_dirs=library_paths(),
            libraries=["c10", "torch", "torch_cpu"] + RUNTIME_LIBRARIES,
            extra_compile_args={"cxx": CXX_FLAGS},
            extra_link_args=LINK_FLAGS + ["-Wl,--no-undefined", "-Wl,-soname,libblade_runtime.so"],
            language="c++",
        ),
        CppExtension(
            name="blade._C",
            sources=PYTHON_SOURCES,
            depends=HEADERS,
            include_dirs=[str(ROOT / "cpp")],
            extra_compile_args={"cxx": CXX_FLAGS},
            extra_link_args=LINK_FLAGS + ["-Wl,-rpath,$ORIGIN"],
            libraries=["blade_runtime"],
        ),
    ],
    cmdclass={"build_ext": BuildRuntimeThenExtension, "build_py": BuildPyWithEngineHeaders},
    zip_safe=False,
)
