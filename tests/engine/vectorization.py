"""Which loops of a compiled engine g++ vectorized: its -fopt-info report mapped to the kernels."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from blade.engine.compiler import compile_onnx

VECTORIZED = re.compile(r"engine\.cpp:(\d+):\d+: optimized: loop vectorized")
LOOP = re.compile(r"\s*for \(int64_t \w+ = ")
KERNEL_COMMENT = re.compile(r"\s*// (?:kernel \d+: )?(\w+:v\d+\[[^\]]*\]\w+ = .*)")


@dataclass
class Loop:
    lines: tuple       # 1-based lines of engine.cpp g++ may report it at (the `for`, its pragma)
    kernel: str        # the comment of the kernel it belongs to (names the IR node it computes)
    vectorized: bool


def innermost_loops(source: str) -> list[tuple[tuple, str]]:
    """(lines, kernel comment) of every loop with no loop inside it; lines: the `for` and, for an
    `omp simd` loop, its pragma (where g++ reports it)."""
    lines, found, comment = source.splitlines(), [], ""
    for number, text in enumerate(lines):
        match = KERNEL_COMMENT.match(text)
        if match:
            comment = match.group(1)
        if not LOOP.match(text):
            continue
        depth, inner = 0, False
        for later in range(number, len(lines)):
            depth += lines[later].count("{") - lines[later].count("}")
            inner = inner or (later > number and LOOP.match(lines[later]) is not None)
            if later > number and depth == 0:
                break
        if not inner:
            pragma = number > 0 and lines[number - 1].strip().startswith("#pragma omp simd")
            found.append(((number + 1, number) if pragma else (number + 1,), comment))
    return found


def compile_with_report(model, out_dir: Path, isa: str = "native") -> list[Loop]:
    """Compiles model with the engine's own command plus -fopt-info-vec-optimized; its innermost loops."""
    compile_onnx(model, out_dir, {"isa": isa, "extra_flags": ["-fopt-info-vec-optimized"]})
    source = (out_dir / "engine.cpp").read_text()
    done = {int(n) for n in VECTORIZED.findall((out_dir / "compile.log").read_text())}
    return [Loop(lines, kernel, bool(done & set(lines))) for lines, kernel in innermost_loops(source)]
