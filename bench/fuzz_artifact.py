"""Damage an exported blade archive one byte at a time and see what loading and running it does.

    python bench/fuzz_artifact.py --flips 300                 # random positions over the whole file
    python bench/fuzz_artifact.py --flips 100 --regions so,tensor,pickle --chosen
    python bench/fuzz_artifact.py --loader torch.jit.load     # without blade.load's archive check

Exports a small model once (MLP + layer norm in an engine, a TorchScript constant outside it), then
makes one damaged copy per case (one byte xor a random nonzero mask; --bytes-per-case for more) and
loads and runs it in a worker subprocess. Each case ends as one of:

    error    loading or running raised an exception (the message is kept)
    correct  it ran, and the outputs equal the undamaged archive's bit for bit
    wrong    it ran, and the outputs differ: a silently wrong result
    crash    the worker died (a signal or an exit)
    hang     no answer within --timeout seconds

Regions are byte ranges of the zip: "so" (an engine's .so record), "tensor" (other data/ records:
engine constants), "ts_constant" (constants/ records: TorchScript's own), "pickle" (*.pkl),
"code" (code/*.py), "metadata" (extra/), "other_record" (version, byteorder, ...), "zip_header"
(local file headers with their padding), "central_directory" (central directory and end record).
--chosen adds fixed positions: the .so's ELF header, the first and last byte of every record, and
every byte of the end-of-central-directory record.

A worker loads many cases one after another and is restarted after a crash or hang (--fresh: a new
worker for every case, slower). Prints the counts per region and class; exit status 1 if any case
crashed, hung or was silently wrong.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import select
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERDICT_PREFIX = "FUZZ "
PINNED_GEMM = "mkl"  # BLADE_GEMM of the reference run and the workers
LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip local file header: signature, ..., name and extra lengths
BAD_CLASSES = ("crash", "hang", "wrong")
SENSITIVE_REGIONS = ("so", "tensor", "ts_constant", "pickle", "code", "zip_header", "central_directory")


@dataclasses.dataclass
class Case:
    region: str
    positions: list
    verdict: str = ""
    detail: str = ""


# ---------------------------------------------------------------------------------------------
# The artifact under test


def export_small_model(directory: Path) -> tuple[Path, Path]:
    """(archive, reference): the archive of a small model, and its inputs with the outputs the
    undamaged archive gives (torch.save'd)."""
    import torch

    import blade

    class Small(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)
            self.norm = torch.nn.LayerNorm(8)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

        def forward(self, x):
            y = self.norm(self.fc2(torch.nn.functional.gelu(self.fc1(x))))
            return torch.sigmoid(y * self.scale)  # mul excluded: `scale` stays a TorchScript constant

    torch.manual_seed(0)
    model, inputs = Small().eval(), (torch.randn(4, 16),)
    archive, reference = directory / "small.blade.pt", directory / "reference.pt"
    with blade.Config(excluded_ops=["aten::mul"]):
        compiled = blade.export(model, inputs, str(archive))
    if not any(c.status == "compiled" for c in compiled.report.clusters):
        raise RuntimeError("the fuzz model compiled no engine: nothing to fuzz")
    # Workers compare bit for bit: the GEMM kernel is pinned here and in them (Worker's PINNED_GEMM;
    # the runtime may otherwise time its kernels differently in each process).
    blade._C._testing.set_gemm_backend(PINNED_GEMM)
    try:
        with torch.no_grad():
            torch.save({"inputs": inputs, "outputs": _flat(blade.load(str(archive))(*inputs))}, reference)
    finally:
        blade._C._testing.set_gemm_backend("")
    return archive, reference


def _record_region(name: str, data: bytes) -> str:
    inner = name.split("/", 1)[1] if "/" in name else name
    if inner.startswith("data/"):
        return "so" if data[:4] == b"\x7fELF" else "tensor"
    prefixes = (("constants/", "ts_constant"), ("code/", "code"), ("extra/", "metadata"))
    for prefix, region in prefixes:
        if inner.startswith(prefix):
            return region
    return "pickle" if inner.endswith(".pkl") else "other_record"


def regions(archive: Path) -> dict[str, list[range]]:
    """Region name -> the byte ranges of the archive that belong to it."""
    raw = archive.read_bytes()
    found = collections.defaultdict(list)
    with zipfile.ZipFile(archive) as zf:
        infos = sorted(zf.infolist(), key=lambda i: i.header_offset)
        for info in infos:
            _, name_len, extra_len = LOCAL_HEADER.unpack_from(raw, info.header_offset)
            start = info.header_offset + LOCAL_HEADER.size + name_len + extra_len
            found["zip_header"].append(range(info.header_offset, start))
            if info.compress_size:
                found[_record_region(info.filename, raw[start:start + 4])].append(
                    range(start, start + info.compress_size))
    end_record = raw.rfind(b"PK\x05\x06")
    central_start = int.from_bytes(raw[end_record + 16:end_record + 20], "little")  # (no zip64 here)
    found["central_directory"].append(range(central_start, len(raw)))
    return dict(found)


def chosen_positions(archive: Path, found: dict[str, list[range]]) -> list[tuple[str, int]]:
    """Positions that damage structure rather than values: the ELF header, record edges, the
    end-of-central-directory record."""
    raw = archive.read_bytes()
    chosen = [("so", r.start + k) for r in found.get("so", []) for k in range(min(64, len(r)))]
    for region, ranges in found.items():
        if region in ("zip_header", "central_directory"):
            continue
        chosen += [(region, p) for r in ranges for p in (r.start, r.stop - 1)]
    end_record = raw.rfind(b"PK\x05\x06")
    chosen += [("central_directory", p) for p in range(end_record, len(raw))]
    return chosen


def make_cases(found: dict[str, list[range]], names, count: int, rng: random.Random,
               bytes_per_case: int = 1) -> list[Case]:
    """count cases over the regions `names` (a region is drawn by its size, then positions in it)."""
    pool = [(name, r) for name in names for r in found.get(name, []) if len(r)]
    weights = [len(r) for _, r in pool]
    cases = []
    for _ in range(count):
        region, span = rng.choices(pool, weights)[0]
        cases.append(Case(region, sorted(rng.sample(span, min(bytes_per_case, len(span))))))
    return cases


def damaged_copy(raw: bytes, positions, rng: random.Random, path: Path) -> Path:
    data = bytearray(raw)
    for p in positions:
        data[p] ^= rng.randrange(1, 256)
    path.write_bytes(data)
    return path


# ---------------------------------------------------------------------------------------------
# Loading in a worker process


def _load(loader: str, path: str):
    import torch

    import blade
    return blade.load(path) if loader == "blade.load" else torch.jit.load(path)


def _flat(outputs) -> list:
    """The output tensors in order, whether a loader returns the model's structure (blade.load) or
    a flat tuple (torch.jit.load)."""
    import torch.utils._pytree as pytree
    return pytree.tree_leaves(outputs)


def worker(reference: str, loader: str) -> None:
    """Reads archive paths from stdin; prints one verdict line per path."""
    import gc
    import warnings

    import torch

    import blade  # noqa: F401  (registers the Engine class for torch.jit.load)
    warnings.simplefilter("ignore")
    expected = torch.load(reference)
    for line in sys.stdin:
        verdict, detail = "correct", ""
        try:
            module = _load(loader, line.strip())
            with torch.no_grad():
                got = _flat(module(*expected["inputs"]))
            same = len(got) == len(expected["outputs"]) and all(
                g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
                for g, w in zip(got, expected["outputs"]))
            verdict = "correct" if same else "wrong"
            del module
        except Exception as err:  # noqa: BLE001 - an exception is the outcome we want to see
            verdict, detail = "error", f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}" \
                if str(err).strip() else type(err).__name__
        gc.collect()  # an engine destroyed later must not crash on the next case's account
        print(VERDICT_PREFIX + json.dumps({"verdict": verdict, "detail": detail}), flush=True)


class Worker:
    """A worker subprocess; run() gives one case's verdict, restarting the process as needed."""

    def __init__(self, reference: Path, loader: str, timeout_s: float):
        self.args = [sys.executable, __file__, "--worker", str(reference), "--loader", loader]
        self.timeout_s = timeout_s
        self.proc = None

    def _start(self):
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, bufsize=1,
                                     env={**os.environ, "BLADE_GEMM": PINNED_GEMM})

    def stop(self):
        if self.proc:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def run(self, path: Path) -> tuple[str, str]:
        if self.proc is None:
            self._start()
        try:
            self.proc.stdin.write(f"{path}\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
            if not ready:
                self.stop()
                return "hang", f"no answer in {self.timeout_s} s"
            line = self.proc.stdout.readline()
            if not line:  # the worker died
                code = self.proc.wait()
                self.proc = None
                return "crash", f"signal {-code}" if code < 0 else f"exit {code}"
            if line.startswith(VERDICT_PREFIX):
                result = json.loads(line[len(VERDICT_PREFIX):])
                return result["verdict"], result["detail"]


def run_cases(archive: Path, reference: Path, cases: list[Case], *, loader: str = "blade.load",
              timeout_s: float = 60.0, seed: int = 0, fresh: bool = False, work_dir: Path | None = None) -> list[Case]:
    """Fills in every case's verdict. The undamaged archive runs first and must come out correct."""
    raw = archive.read_bytes()
    rng = random.Random(seed)
    runner = Worker(reference, loader, timeout_s)
    with tempfile.TemporaryDirectory(prefix="blade-fuzz-", dir=work_dir) as tmp:
        try:
            control, detail = runner.run(archive)
            if control != "correct":
                raise RuntimeError(f"the undamaged archive does not reproduce its outputs: {control} {detail}")
            for k, case in enumerate(cases):
                path = damaged_copy(raw, case.positions, rng, Path(tmp) / f"case_{k}.pt")
                case.verdict, case.detail = runner.run(path)
                path.unlink()
                if fresh:
                    runner.stop()
        finally:
            runner.stop()
    return cases


# ---------------------------------------------------------------------------------------------
# Report


def summary(cases: list[Case]) -> str:
    classes = ("error", "correct", "wrong", "crash", "hang")
    counts = collections.Counter((c.region, c.verdict) for c in cases)
    lines = [f"{'region':<18}" + "".join(f"{k:>9}" for k in classes)]
    for region in sorted({c.region for c in cases}):
        lines.append(f"{region:<18}" + "".join(f"{counts[region, k]:>9}" for k in classes))
    total = collections.Counter(c.verdict for c in cases)
    lines.append(f"{'total':<18}" + "".join(f"{total[k]:>9}" for k in classes))
    bad = [c for c in cases if c.verdict in BAD_CLASSES]
    lines += [f"  {c.verdict}: {c.region} at {c.positions}: {c.detail}" for c in bad[:20]]
    examples = {}
    for c in cases:
        if c.verdict == "error":
            examples.setdefault(c.detail.split(":")[0], (c.region, c.detail))
    errors = collections.Counter(c.detail.split(":")[0] for c in cases if c.verdict == "error")
    lines.append("errors by type: " + ", ".join(f"{k} {n}" for k, n in errors.most_common()))
    lines += [f"  e.g. ({region}) {detail}" for region, detail in examples.values()]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flips", type=int, default=300, help="random cases")
    parser.add_argument("--regions", default="all", help=f"comma-separated, or all, or sensitive "
                                                         f"({','.join(SENSITIVE_REGIONS)})")
    parser.add_argument("--chosen", action="store_true", help="add the fixed structural positions")
    parser.add_argument("--bytes-per-case", type=int, default=1)
    parser.add_argument("--loader", choices=("blade.load", "torch.jit.load"), default="blade.load")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per case")
    parser.add_argument("--fresh", action="store_true", help="a new worker process for every case")
    parser.add_argument("--worker", metavar="REFERENCE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.loader)
        return 0
    with tempfile.TemporaryDirectory(prefix="blade-fuzz-model-") as tmp:
        archive, reference = export_small_model(Path(tmp))
        found = regions(archive)
        names = {"all": list(found), "sensitive": list(SENSITIVE_REGIONS)}.get(args.regions,
                                                                               args.regions.split(","))
        rng = random.Random(args.seed)
        cases = make_cases(found, names, args.flips, rng, args.bytes_per_case)
        if args.chosen:
            cases += [Case(region, [p]) for region, p in chosen_positions(archive, found)]
        size = archive.stat().st_size
        run_cases(archive, reference, cases, loader=args.loader, timeout_s=args.timeout, seed=args.seed,
                  fresh=args.fresh)
    print(f"{len(cases)} damaged copies of a {size}-byte archive, loaded with {args.loader}:")
    print(summary(cases))
    return 1 if any(c.verdict in BAD_CLASSES for c in cases) else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # blade from this checkout
    sys.exit(main())
