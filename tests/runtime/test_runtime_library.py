"""The runtime is one shared library, blade/libblade_runtime.so (setup.py's RUNTIME_SOURCES), which
blade._C links and C++ programs link too (examples/cpp): one copy of it per process, free of Python."""
import shutil
import subprocess
from pathlib import Path

import pytest

import blade
import blade._C

READELF = shutil.which("readelf")
NM = shutil.which("nm")


def _mapped_files() -> set:
    files = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            files.add(Path(fields[5]).resolve())
    return files


def test_the_process_runs_the_library_runtime_library_names():
    library = Path(blade.runtime_library())
    assert library.is_file(), library
    assert library.parent == Path(blade._C.__file__).parent
    mapped = _mapped_files()
    assert library.resolve() in mapped
    assert not [f for f in mapped if f.name == library.name and f != library.resolve()], mapped


@pytest.mark.skipif(READELF is None, reason="readelf (binutils) is not installed")
def test_runtime_library_needs_no_python_and_c_extension_links_it():
    def needed(path):
        dynamic = subprocess.run([READELF, "-d", path], capture_output=True, text=True, check=True).stdout
        return [line.split("[", 1)[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line]

    runtime_needs = needed(blade.runtime_library())
    assert not [n for n in runtime_needs if "python" in n], runtime_needs  # no libpython, no libtorch_python
    assert "libtorch_cpu.so" in runtime_needs, runtime_needs
    assert "libblade_runtime.so" in needed(blade._C.__file__)


@pytest.mark.skipif(NM is None, reason="nm (binutils) is not installed")
def test_c_extension_defines_none_of_the_runtime():
    """blade._C has only its Python sources: the Engine class (its registration, the thread-local
    scratch, the GEMM choice state) is defined in the runtime library alone."""
    def defined(path):
        out = subprocess.run([NM, "-D", "--defined-only", "-C", path], capture_output=True, text=True,
                             check=True).stdout
        return {line.split(maxsplit=2)[2] for line in out.splitlines() if len(line.split(maxsplit=2)) == 3}

    runtime_symbols = {s for s in defined(blade.runtime_library()) if s.startswith("blade::")}
    assert any(s.startswith("blade::verify_archive(") for s in runtime_symbols), sorted(runtime_symbols)[:20]
    in_both = runtime_symbols & defined(blade._C.__file__)
    assert not in_both, sorted(in_both)[:20]
