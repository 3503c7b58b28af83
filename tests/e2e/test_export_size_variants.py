"""blade.export with declared dims a single capture does not serve (blade/size_variants.py):
transformers' attention guards seq >= 2 (``is_causal = q_length > 1 and ...``), so seq 1 gets a
capture of its own and the archive's forward dispatches by size, in a fresh process without a
compiler; sizes outside the declared ranges and ranges that cannot be covered are refused by name."""
from __future__ import annotations

import importlib

import pytest
import torch

import blade
from blade.export import ExportError, compile_model
from blade.size_variants import DeclaredDim, UncoverableRange, excluded_values
from aot_testing import serve_in_fresh_process

SERVED = [(b, s) for b in (1, 3) for s in (1, 2, 17)]


@pytest.fixture
def capture_reports(monkeypatch):
    """The CompileReport of each capture's compile (the archive's report sums them, so a capture
    whose graph all stayed in TorchScript would hide behind the others' engines)."""
    module = importlib.import_module("blade.export")  # (blade.export is also the function)
    reports, compile_fx = [], module.compile_fx

    def recording(*args, **kwargs):
        compiled = compile_fx(*args, **kwargs)
        reports.append(compiled.report)
        return compiled
    monkeypatch.setattr(module, "compile_fx", recording)
    return reports


def assert_engines_ran(reports: list, captures: int) -> None:
    assert len(reports) == captures, [r.size_symbols for r in reports]
    for report in reports:
        assert report.aten_in_engines > 0 and report.engine_calls > 0, (report.size_symbols, report.left_out)


def _tiny_transformer(kind: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "bert":
        config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, vocab_size=100, max_position_embeddings=64)
        return transformers.BertModel(config).eval()
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Model(config).eval()


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_transformer_archive_serves_seq_and_batch_1_in_a_fresh_process(kind, tmp_path, capture_reports):
    model = _tiny_transformer(kind)
    ids, mask = torch.randint(0, 100, (2, 12)), torch.ones(2, 12, dtype=torch.long)
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=1, max=64)
    path = str(tmp_path / f"{kind}.blade.pt")
    compiled = blade.export(model, (ids,), path, kwargs={"attention_mask": mask},
                            dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}})
    assert "seq=1:" in compiled.report.size_symbols, compiled.report.size_symbols  # a second capture
    assert_engines_ran(capture_reports, compiled.report.size_symbols.count(":"))
    points = []
    for b, s in SERVED:
        ids, mask = torch.randint(0, 100, (b, s)), torch.ones(b, s, dtype=torch.long)
        mask[-1, s // 2:] = 0  # padding in the last row (none left at seq 1: the row keeps one token)
        mask[-1, 0] = 1
        with torch.no_grad():
            points.append({"ids": ids, "mask": mask, "expected": tuple(model(ids, attention_mask=mask).values())})
    out = serve_in_fresh_process(tmp_path, path, points, """
        for p in points:
            got = tuple(m(p["ids"], attention_mask=p["mask"]).values())
            assert len(got) == len(p["expected"])
            for g, want in zip(got, p["expected"]):
                assert g.shape == want.shape, (g.shape, want.shape)
                assert (g - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item()), tuple(p["ids"].shape)
            print("served", tuple(p["ids"].shape))
        for b, s in ((2, 65), (9, 4)):
            try:
                m(torch.zeros(b, s, dtype=torch.long), attention_mask=torch.ones(b, s, dtype=torch.long))
            except RuntimeError as err:
                print("refused:", str(err).splitlines()[-1])
    """)
    assert out.count("served") == len(SERVED), out
    assert "Dim 'seq') is 65, outside its declared range [1, 64]" in out, out
    assert "Dim 'batch') is 9, outside its declared range [1, 8]" in out, out


class _SizeBranches(torch.nn.Module):
    """Another computation at batch 1 and at seq 1 (dynamo guards both: four captures), so a
    capture run for the wrong sizes gives visibly wrong values."""

    def forward(self, x):
        y = x * 2 if x.shape[0] > 1 else x + 100
        return y.sin() if x.shape[1] > 1 else y.cos() - 7


def test_each_size_combination_runs_its_own_capture(capture_reports):
    model = _SizeBranches()
    batch, seq = torch.export.Dim("batch", min=1, max=6), torch.export.Dim("seq", min=1, max=6)
    compiled = compile_model(model, (torch.randn(3, 4, 8),), dynamic_shapes={"x": {0: batch, 1: seq}})
    assert compiled.report.size_symbols.count(":") == 4, compiled.report.size_symbols
    assert_engines_ran(capture_reports, 4)
    for b in (1, 2, 6):
        for s in (1, 3, 6):
            x = torch.randn(b, s, 8)
            with torch.no_grad():
                torch.testing.assert_close(compiled.signature.outputs(compiled(x)), model(x), rtol=1e-4, atol=1e-4)


class _ShortInputs(torch.nn.Module):
    def forward(self, x):
        return x * 2 if x.shape[1] > 5 else x - 1


def test_a_range_more_than_a_few_captures_would_cover_is_refused_by_name(tmp_path):
    """dynamo's constraint solver refuses such a capture itself (with the range to declare);
    blade's own check refuses what reaches it, naming the dim and the values left out."""
    seq = torch.export.Dim("seq", min=1, max=16)
    with pytest.raises(ExportError, match=r"seq.*min=6, max=16"):
        blade.export(_ShortInputs(), (torch.randn(2, 8),), str(tmp_path / "short.blade.pt"),
                     dynamic_shapes={"x": {1: seq}})
    assert not (tmp_path / "short.blade.pt").exists()
    dims = {"seq": DeclaredDim("seq", 1, 16), "batch": DeclaredDim("batch", 1, None)}
    assert excluded_values(dims, {"seq": (2, 16), "batch": (2, 4096)}, {}) == {"seq": [1], "batch": [1]}
    assert excluded_values(dims, {"seq": (1, 14), "batch": (1, 8)}, {}) == {"seq": [15, 16]}
    assert excluded_values(dims, {"seq": (6, 16), "batch": (1, 8)}, {"seq": 3}) == {}
    with pytest.raises(UncoverableRange, match=r"dim 'seq' is declared \[1, 16\], but the model's graph serves it "
                                               r"only in \[6, 16\] \(dynamo guards on it with batch=1\); values 1, "
                                               r"2, 3, 4, 5 would each need a capture"):
        excluded_values(dims, {"seq": (6, 16), "batch": (1, 1)}, {"batch": 1})
