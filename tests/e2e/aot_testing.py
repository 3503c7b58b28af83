"""Helpers of the serving tests: a small model both sides can rebuild, fresh Python processes, and
an environment in which any attempt to run a C++ compiler leaves a mark."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from blade_testing import PINNED_GEMM_ENV, pinned_gemm

E2E_DIR = os.path.dirname(os.path.abspath(__file__))
COMPILERS = ("g++", "c++", "gcc", "cc", "clang++", "cxx")


class Block(torch.nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear, residual with a mask, and a softmax: two inputs, two
    outputs, a few clusters' worth of ops; small enough to compile in seconds."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x, mask):
        h = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return x + h * mask, torch.softmax(h, dim=-1)


def make_model_and_inputs(seed: int = 0):
    torch.manual_seed(seed)
    model = Block().eval()
    return model, (torch.randn(2, 8, 32), (torch.rand(2, 8, 1) > 0.3).float())


def save_reference(root: Path, run, model, inputs) -> None:
    """Runs the compiled ``run`` on inputs, checks it against eager and saves the inputs and its
    outputs as root/io.pt: the outputs a fresh process (run_python: the same GEMM kernels pinned)
    must reproduce bit for bit."""
    with torch.no_grad(), pinned_gemm():
        outputs, expected = run(*inputs), model(*inputs)
    assert len(outputs) == len(expected)
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.save({"inputs": inputs, "outputs": outputs}, root / "io.pt")


def run_python(script: str, *, env: dict | None = None, cwd=None, timeout: float = 600) -> str:
    """Runs script in a fresh interpreter (tests/e2e importable, BLADE_GEMM pinned as in
    save_reference); returns stdout, fails with stderr."""
    full_env = {**(os.environ if env is None else env), **PINNED_GEMM_ENV}  # as save_reference's
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [E2E_DIR, full_env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                            timeout=timeout, env=full_env, cwd=cwd)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def tripwire_compiler_env(tmp_path: Path) -> tuple[dict, Path]:
    """An environment whose PATH and CXX lead only to fake compilers that record being called and
    fail loudly; returns it and the file that exists once any of them ran."""
    bin_dir, mark = tmp_path / "tripwire-bin", tmp_path / "compiler-was-run"
    bin_dir.mkdir(exist_ok=True)
    for name in COMPILERS:
        fake = bin_dir / name
        fake.write_text(f"#!/bin/sh\necho \"$0 $*\" >> {mark}\necho 'no compiling at load time' >&2\nexit 97\n")
        fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=str(bin_dir), CXX=str(bin_dir / "g++"))
    return env, mark


def serve_in_fresh_process(tmp_path: Path, archive: str, points: list, body: str) -> str:
    """Runs body in a fresh process that cannot compile (tripwire_compiler_env), under no_grad, with
    ``m`` the loaded archive and ``points`` the given list (through torch.save); returns stdout and
    fails if a compiler ran."""
    torch.save(points, tmp_path / "points.pt")
    env, compiler_mark = tripwire_compiler_env(tmp_path)
    out = run_python(f"""
        import torch, blade
        m = blade.load({archive!r})
        points = torch.load({str(tmp_path / 'points.pt')!r})
        with torch.no_grad():
""" + textwrap.indent(textwrap.dedent(body), " " * 12), env=env)
    assert not compiler_mark.exists()
    return out
