"""Lines of generated C++ before rendering, and the scopes of loop bodies that collect them.

A line is a str, or a tuple of parts of which some are only known once the whole program is
planned: a buffer ``Access`` (its address becomes relative to the row when its buffer is kept on
the stack) and a scratch buffer's ``ArenaOffset``. ``line_text`` renders one at the end.
"""
from __future__ import annotations

from dataclasses import dataclass

from .buffers import Buffer
from .optable import CType
from .symbolic import Expr, render

DECLS = "@DECLS@"              # the line of a kernel where its buffer pointers get declared


class Names:
    """Fresh C++ names (t1, acc2, r3, ...): one counter per engine."""

    def __init__(self):
        self.counter = 0

    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"


@dataclass(frozen=True)
class Access:
    """buf[address] (a load or a store)."""
    buf: Buffer
    address: Expr

    def text(self, stack_rows: dict) -> str:
        rows = stack_rows.get(self.buf)
        # a buffer kept on the stack is addressed within its row: every access was rebased
        address = self.address if rows is None else rows[self.address]
        return f"{self.buf.ident}[{address.render()}]"


@dataclass(frozen=True)
class ArenaOffset:
    """A scratch buffer's byte offset in the arena (planned after every kernel exists)."""
    buf: Buffer

    def text(self, stack_rows: dict) -> str:
        return str(self.buf.offset)


def line_text(line, stack_rows: dict) -> str:
    """The C++ of a line; stack_rows: buffer kept on the stack -> {address: address in its row}."""
    if isinstance(line, str):
        return line
    return "".join(part if isinstance(part, str) else part.text(stack_rows) for part in line)


def indent(lines, depth=1):
    pad = "  " * depth
    return [(pad + line if line else line) if isinstance(line, str) else (pad, *line) for line in lines]


def cpp(value) -> str:
    """C++ of an index value: an int or Expr, or a C++ name already."""
    return value if isinstance(value, str) else render(value)


def for_loop(var, begin, end, body_lines, pragma: str = ""):
    """A loop of var over [begin, end): each a Var/Expr/int, or C++ text."""
    head = [pragma] if pragma else []
    var = cpp(var)
    return head + [f"for (int64_t {var} = {cpp(begin)}; {var} < {cpp(end)}; ++{var}) {{",
                   *indent(body_lines), "}"]


def declare(body_lines, uses: dict):
    """body_lines with the pointers of the buffers in uses (Buffer -> written?) declared where a
    line is DECLS (inside the parallel lambda, so that __restrict__ reaches the loops)."""
    decls = [pointer_decl(buf, written) for buf, written in uses.items() if buf.kind != "inline"]
    lines = []
    for line in body_lines:
        if isinstance(line, str) and line.strip() == DECLS:
            lines += indent(decls, (len(line) - len(line.lstrip())) // 2)
        else:
            lines.append(line)
    return lines


def pointer_decl(buf: Buffer, written: bool):
    ctype = buf.element_ctype
    qual = "" if written else "const "
    source = {"input": f"inputs[{buf.index}]", "output": f"outputs[{buf.index}]",
              "const": f"constants[{buf.index}]"}.get(buf.kind)
    if source is None:
        return (f"{qual}{ctype}* __restrict__ {buf.ident} = reinterpret_cast<{qual}{ctype}*>(arena + ",
                ArenaOffset(buf), ");")
    return f"{qual}{ctype}* __restrict__ {buf.ident} = static_cast<{qual}{ctype}*>({source});"


class Scope:
    """The statements of one loop body of a kernel, with the memo of the values computed there
    (CSE) and the variables it binds: a value goes to the outermost scope that binds every
    variable its index uses (loop-invariant code motion)."""

    def __init__(self, kernel, names: Names, parent=None, binds=()):
        self.kernel, self.names, self.parent = kernel, names, parent
        self.binds = set(binds)       # Vars: loop variables (and index temps) defined here
        self.lines: list = []
        self.memo: dict = {}
        self.has_side_effects = False

    def child(self, binds) -> "Scope":
        return Scope(self.kernel, self.names, self, binds)

    def lookup(self, key):
        scope = self
        while scope is not None:
            if key in scope.memo:
                return scope.memo[key]
            scope = scope.parent
        return None

    def home_for(self, idx) -> "Scope":
        """The outermost enclosing scope in which every variable used by idx is defined."""
        used = set().union(*(i.free_vars() for i in idx))
        scope = self
        while scope.parent is not None and not (scope.binds & used):
            scope = scope.parent
        return scope

    def define(self, ctype: CType, text, key=None, prefix="t") -> str:
        """A const temp holding text (C++, or an Access) in this scope; returns its name."""
        name = self.names.fresh(prefix)
        self.lines.append(f"const {ctype} {name} = {text};" if isinstance(text, str)
                          else (f"const {ctype} {name} = ", text, ";"))
        if key is not None:
            self.memo[key] = name
        return name

    def mark_side_effects(self):
        scope = self
        while scope is not None:
            scope.has_side_effects = True
            scope = scope.parent
