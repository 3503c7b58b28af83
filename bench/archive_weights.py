"""What an archive's captures cost in bytes (issue 12): bench/dynamic.py's BERT exported with seq
declared from 1 (two captures: seq 1 has its own) and from 2 (one), or given archives.

    python bench/archive_weights.py                 # export both, then measure
    python bench/archive_weights.py a.pt b.pt       # measure these (any blade BERT archive of dynamic.py)

Per archive: its size, the bytes of tensor records that repeat another record's bytes, blade.load's
CPU time (median of 3 fresh processes) and current RSS in a fresh process after blade.load, after
3 calls at 16x512, and after calls at seq 1 (batches 1-16), where the archive serves seq 1.
Peak RSS over many shapes is dynamic.py's serving row; this script is for before/after a change to
how captures hold their weights.
"""
from __future__ import annotations

import collections
import hashlib
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SERVE = """
import sys, time, torch, blade
def rss(): return int([l for l in open('/proc/self/status') if l.startswith('VmRSS:')][0].split()[1]) / 1024
start = time.process_time()
m = blade.load(sys.argv[1])
out = [f"load {(time.process_time() - start) * 1e3:.0f} ms CPU", f"RSS after load {rss():.0f}"]
if sys.argv[2] == "full":
    def call(b, s): m(torch.randint(0, 30522, (b, s)), torch.ones(b, s, dtype=torch.int64))
    with torch.no_grad():
        for _ in range(3): call(16, 512)
        out.append(f"after 16x512 {rss():.0f}")
        try:
            for b in range(1, 17): call(b, 1)
            out.append(f"after seq 1 {rss():.0f} MiB")
        except Exception:  # declared from seq 2
            out.append("seq 1 not served")
print(", ".join(out))
"""


def export(min_seq: int, path: Path) -> None:
    import blade
    from bench import dynamic as d
    torch.manual_seed(0)
    model, vocab = d.bert()
    blade.export(d.Flat(model), d.grid_inputs(vocab, 4, 128), str(path),
                 dynamic_shapes=d.dynamic_shapes_spec(16, 512, min_seq=min_seq))


def records(path: Path) -> str:
    with zipfile.ZipFile(path) as archive:
        sizes = collections.defaultdict(list)
        for info in archive.infolist():
            if "/data/" in info.filename:
                sizes[hashlib.sha256(archive.read(info)).hexdigest()].append(info.file_size)
    repeated = sum(sum(s[1:]) for s in sizes.values())
    return (f"{path.stat().st_size / 2**20:.1f} MiB, {sum(map(len, sizes.values()))} tensor records, "
            f"{repeated / 2**20:.1f} MiB repeating another record")


def serve(path: Path) -> str:
    run = lambda mode: subprocess.run([sys.executable, "-c", SERVE, str(path), mode],
                                      capture_output=True, text=True, check=True).stdout.strip()
    loads = [float(run("load").split()[1]) for _ in range(3)]
    return f"{run('full')} (load median {statistics.median(loads):.0f} ms CPU)"


def main() -> None:
    archives = [Path(p) for p in sys.argv[1:]]
    if not archives:
        scratch = tempfile.TemporaryDirectory(prefix="blade-archive-weights-")  # removed at exit
        work = Path(scratch.name)
        archives = [work / f"bert_seq_from_{m}.blade.pt" for m in (1, 2)]
        for min_seq, path in zip((1, 2), archives):
            export(min_seq, path)
    for path in archives:
        print(f"{path.name}: {records(path)}; {serve(path)}")


if __name__ == "__main__":
    main()
