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


INSTRUCTION = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)\s*([0-9a-f]*)")


def short_loops(engine_so: Path, longest: int = 64) -> list[tuple[int, int]]:
    """(first byte, byte after the last) of every loop of the .so's code at most `longest` bytes
    long, read from its object code: a conditional jump back to an address before it closes a loop."""
    import subprocess
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(engine_so)],
                          capture_output=True, text=True, check=True).stdout
    instructions = [m.groups() for m in map(INSTRUCTION.match, text.splitlines()) if m]
    loops = []
    for (address, mnemonic, target), following in zip(instructions, instructions[1:]):
        if mnemonic.startswith("j") and mnemonic != "jmp" and target:
            head, end = int(target, 16), int(following[0], 16)
            if head < int(address, 16) and end - head <= longest:
                loops.append((head, end))
    return loops
