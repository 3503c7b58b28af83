"""The numpy runtime's ctypes mirror of cpp/blade_abi.h (blade/engine/npruntime.py) lays its structs
out as the C++ compiler does: a field at another offset would hand an engine garbage silently."""
from __future__ import annotations

import ctypes
import subprocess

from blade.engine import compiler, npruntime

STRUCTS = (npruntime.BladeRuntime, npruntime.BladeAttention, npruntime.BladeScoreStep, npruntime.BladeActivation,
           npruntime.BladeConv)


def test_ctypes_structs_match_the_header(tmp_path):
    lines = []
    for struct in STRUCTS:
        lines.append(f'  std::printf("{struct.__name__} size %zu\\n", sizeof({struct.__name__}));')
        for name, _ in struct._fields_:
            lines.append(f'  std::printf("{struct.__name__} {name} %zu\\n", offsetof({struct.__name__}, {name}));')
    source = tmp_path / "layout.cpp"
    source.write_text('#include <cstddef>\n#include <cstdio>\n#include "blade_abi.h"\nint main() {\n'
                      + "\n".join(lines) + "\n}\n")
    subprocess.run([compiler.resolve_options({})["cxx"], f"-I{compiler.include_dir()}", str(source), "-o",
                    str(tmp_path / "layout")], check=True)
    printed = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True, text=True).stdout
    mirrored = []
    for struct in STRUCTS:
        mirrored.append(f"{struct.__name__} size {ctypes.sizeof(struct)}")
        mirrored += [f"{struct.__name__} {name} {getattr(struct, name).offset}" for name, _ in struct._fields_]
    assert printed.splitlines() == mirrored
