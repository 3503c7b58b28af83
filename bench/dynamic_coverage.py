"""Dynamic shapes on models nobody tuned: coverage and correctness with dynamic batch x sequence.

    python bench/dynamic_coverage.py                    # every model, both paths, grid check
    python bench/dynamic_coverage.py --models llama --no-grid --paths export

Per model (ids + all-ones attention mask, last hidden state): the export path
(``blade.compile_model(..., dynamic_shapes=...)``, as bench/dynamic.py) and the torch.compile path
(``blade.explain(..., dynamic=True)``): aten ops in engines and what stays in TorchScript with its
reason. With the grid (default), the compiled module runs at batch {1,2,5,8} x seq {1,7,64,256}
against eager (max |diff| / max |eager|); --fresh also serves the archive in a fresh process
(FRESH_SEQS).
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dynamic as dyn  # noqa: E402
import models  # noqa: E402

GRID_BATCHES, GRID_SEQS = (1, 2, 5, 8), (1, 7, 64, 256)
# The archive in a fresh process: seq from 2. BERT's and GPT-2's graphs guard seq > 1 (dynamo
# narrows the declared min=1 to 2; seq 1 takes another branch of the model), so the archive names
# the dim and its range at seq 1 instead of serving it; in process, compile_model serves it.
FRESH_SEQS = (2, 7, 64, 256)


class SizePatterns(torch.nn.Module):
    """What model code computes from the run-time sequence length beyond the transformers above:
    positions after an offset (cache positions, ``arange(past, past + seq)``) and at a stride
    (``arange(0, 2 * seq, 2)``), and token shifts along the sequence (``roll``: RWKV-style token
    mixing, Swin's shifted windows)."""
    VOCAB = 100

    def __init__(self, dim=64, max_seq=max(GRID_SEQS)):
        super().__init__()
        self.words, self.positions = torch.nn.Embedding(self.VOCAB, dim), torch.nn.Embedding(max_seq + 2, dim)
        self.strided, self.norm = torch.nn.Embedding(2 * max_seq, dim), torch.nn.LayerNorm(dim)

    def forward(self, ids, mask):
        seq = ids.shape[1]
        h = self.words(ids) + self.positions(torch.arange(2, seq + 2)) + self.strided(torch.arange(0, 2 * seq, 2))
        h = (h + 0.5 * torch.roll(h, 1, 1) - 0.25 * torch.roll(h, -2, 1)) * mask.unsqueeze(-1)
        return self.norm(h)


def _transformer(inner):
    def build():
        model = inner()
        return dyn.Flat(model).eval(), model.config.vocab_size
    return build


BUILDS = {"bert": _transformer(lambda: dyn.bert()[0]), "gpt2": _transformer(lambda: dyn.gpt2()[0]),
          "llama": _transformer(lambda: models.llama(1)[0]), "t5": _transformer(lambda: models.t5_encoder(1)[0]),
          "distilbert": _transformer(lambda: models.distilbert(1)[0]),
          "sizes": lambda: (SizePatterns().eval(), SizePatterns.VOCAB)}


def left_out(report) -> list:
    groups = Counter((n.kind, n.reason) for n in report.left_out_nodes)
    return [f"{count} x {kind}: {reason}" for (kind, reason), count in groups.most_common()] + \
        [f"refused: {r}" for r in report.symbolic_refusals]


def grid_error(model, compiled, vocab) -> float:
    worst = 0.0
    for b in GRID_BATCHES:
        for s in GRID_SEQS:
            inputs = dyn.grid_inputs(vocab, b, s)
            expected, got = model(*inputs), dyn.first_tensor(compiled(*inputs))
            if expected.shape != got.shape:
                raise AssertionError(f"at {b}x{s}: shape {tuple(got.shape)}, eager {tuple(expected.shape)}")
            worst = max(worst, dyn.rel_err(got, expected))
    return worst


def export_path(name, model, example, vocab, args) -> None:
    import blade
    try:
        compiled = blade.compile_model(model, example, dynamic_shapes=dyn.dynamic_shapes_spec(8, 256))
    except Exception as err:  # noqa: BLE001 - a model the export path cannot take is reported
        print(f"== {name} export: failed: {type(err).__name__}: {str(err)[:300]}", flush=True)
        return
    r = compiled.report
    print(f"== {name} export: {r.aten_in_engines}/{r.aten_total} ({100 * r.coverage:.1f}%)", flush=True)
    for line in left_out(r):
        print("   ", line)
    if not args.no_grid:
        print(f"   grid {len(GRID_BATCHES) * len(GRID_SEQS)} points: max rel err "
              f"{grid_error(model, compiled, vocab):.1e}", flush=True)
    if args.fresh:
        print("   fresh process:", dyn.serve_exported(model, example, vocab, GRID_BATCHES, FRESH_SEQS), flush=True)


def compile_path(name, model, example, vocab, args) -> None:
    import blade
    torch._dynamo.reset()
    try:
        ex = blade.explain(model, *example, dynamic=True)
    except Exception as err:  # noqa: BLE001
        print(f"== {name} torch.compile dynamic: failed: {type(err).__name__}: {str(err)[:300]}", flush=True)
        return
    print(f"== {name} torch.compile dynamic: {ex.aten_in_engines}/{ex.aten_total} "
          f"({100 * ex.coverage:.1f}%), {len(ex.reports)} graph(s), {len(ex.graph_breaks)} break(s)", flush=True)
    for rep in ex.reports:
        for line in left_out(rep):
            print("   ", line)
    if not args.no_grid:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="tt_infer", dynamic=True)
        print(f"   grid {len(GRID_BATCHES) * len(GRID_SEQS)} points: max rel err "
              f"{grid_error(model, compiled, vocab):.1e}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(BUILDS))
    parser.add_argument("--no-grid", action="store_true")
    parser.add_argument("--paths", default="export,compile")
    parser.add_argument("--fresh", action="store_true")
    args = parser.parse_args()
    paths = {"export": export_path, "compile": compile_path}
    for name in args.models.split(","):
        torch.manual_seed(0)
        model, vocab = BUILDS[name]()
        example = dyn.grid_inputs(vocab, 2, 32)
        with torch.no_grad():
            for path in args.paths.split(","):
                paths[path](name, model, example, vocab, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
