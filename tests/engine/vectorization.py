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


INSTRUCTION = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)\s*([0-9a-f]*)(.*)$")
FUNCTION = re.compile(r"^[0-9a-f]+ <(.*)>:$")


def functions_and_loops(so: Path) -> list[tuple[str, list, list]]:
    """Per function of the .so's code: (its demangled name, its instructions as (address, mnemonic,
    operands), its loops as (index of the head, index of the jump back)): a conditional jump back
    to an address before it, within the function, closes a loop."""
    import subprocess
    text = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", str(so)],
                          capture_output=True, text=True, check=True).stdout
    functions, name, instructions = [], None, []
    for line in text.splitlines() + [""]:
        head, match = FUNCTION.match(line), INSTRUCTION.match(line)
        if match and name is not None:
            address, mnemonic, target, rest = match.groups()
            instructions.append((int(address, 16), mnemonic, (target + rest).strip()))
        elif (head or not line) and name is not None:
            at = {address: i for i, (address, _, _) in enumerate(instructions)}
            loops = [(at[int(ops.split()[0], 16)], i) for i, (address, mnemonic, ops) in enumerate(instructions)
                     if mnemonic.startswith("j") and mnemonic != "jmp" and ops
                     and re.fullmatch(r"[0-9a-f]+", ops.split()[0]) and int(ops.split()[0], 16) in at
                     and int(ops.split()[0], 16) < address]
            functions.append((name, instructions, loops))
            name, instructions = None, []
        if head:
            name = head.group(1)
    return functions


def short_loops(engine_so: Path, longest: int = 64) -> list[tuple[int, int]]:
    """(first byte, byte after the last) of every loop of the .so's code at most `longest` bytes
    long, read from its object code."""
    loops = []
    for _, instructions, function_loops in functions_and_loops(engine_so):
        for head, jump in function_loops:
            end = instructions[jump + 1][0] if jump + 1 < len(instructions) else instructions[jump][0] + 2
            if end - instructions[head][0] <= longest:
                loops.append((instructions[head][0], end))
    return loops
