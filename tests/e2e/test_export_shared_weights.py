"""An archive with several captures (blade/size_variants.py: BERT's seq-1 capture) holds each
weight once: one record, restored as one storage that the captures' engines share
(blade/shared_constants.py), and the integrity checks still catch damage to that shared record."""
from __future__ import annotations

import collections
import zipfile

import pytest
import torch

import blade
from blade.aot import CorruptArtifact
from test_export_size_variants import _tiny_transformer

LARGE = 4096  # bytes: constants this large are random weights, whose bytes no other constant repeats


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(model, archive path) of a tiny BERT exported with seq from 1: two captures."""
    model = _tiny_transformer("bert")
    ids, mask = torch.randint(0, 100, (2, 12)), torch.ones(2, 12, dtype=torch.long)
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=1, max=64)
    path = tmp_path_factory.mktemp("shared") / "bert.blade.pt"
    compiled = blade.export(model, (ids,), str(path), kwargs={"attention_mask": mask},
                            dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}})
    assert "seq=1:" in compiled.report.size_symbols, compiled.report.size_symbols  # a second capture
    return model, path


def _engine_constants(script) -> dict:
    """capture name -> the constants of its engines, in order."""
    out = {}
    for capture in (name for name in dir(script) if name.startswith("capture_")):
        module = getattr(script, capture)
        # TorchScript lists no custom-class attributes: probe the names the pipeline gives engines
        engines = [module._c.getattr(f"cluster_{k}") for k in range(100) if module._c.hasattr(f"cluster_{k}")]
        out[capture] = [c for e in engines for c in e._get_method("__getstate__")()[11]]
    return out


def _content(t: torch.Tensor) -> tuple:
    return str(t.dtype), tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_each_weight_is_one_record_and_one_storage_shared_by_the_captures(exported):
    _, path = exported
    constants = _engine_constants(blade.load(str(path)).script)
    assert len(constants) == 2 and all(constants.values()), {k: len(v) for k, v in constants.items()}
    storages = collections.defaultdict(set)  # content -> data pointers holding it
    for capture in constants.values():
        for c in capture:
            storages[_content(c)].add(c.data_ptr())
    assert all(len(ptrs) == 1 for ptrs in storages.values())
    first, second = ({_content(c) for c in capture} for capture in constants.values())
    both = [content for content in first & second if len(content[2]) >= LARGE]
    assert len(both) >= 8, len(both)  # the embeddings and every layer's matrices
    with zipfile.ZipFile(path) as archive:
        records = collections.Counter(archive.read(info) for info in archive.infolist() if "/data/" in info.filename)
    assert all(records[content[2]] == 1 for content in storages if len(content[2]) >= LARGE)


def test_both_captures_match_eager(exported):
    model, path = exported
    served = blade.load(str(path))
    with torch.no_grad():
        for b, s in ((3, 1), (2, 7)):
            ids, mask = torch.randint(0, 100, (b, s)), torch.ones(b, s, dtype=torch.long)
            want = model(ids, attention_mask=mask).last_hidden_state
            got = served(ids, attention_mask=mask).last_hidden_state
            assert (got - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item()), (b, s)


def test_damage_to_the_shared_record_is_caught(exported, tmp_path):
    """By blade.load's record hashes, and by each engine's own constant hashes under torch.jit.load."""
    _, path = exported
    largest = max(_content(c)[2] for capture in _engine_constants(blade.load(str(path)).script).values()
                  for c in capture)
    raw = bytearray(path.read_bytes())
    at = raw.find(largest) + len(largest) // 2
    assert raw.find(largest, at) == -1  # one copy in the file
    raw[at] ^= 0x40
    damaged = tmp_path / "damaged.blade.pt"
    damaged.write_bytes(raw)
    with pytest.raises(CorruptArtifact, match="blade archive"):
        blade.load(str(damaged))
    with pytest.raises(RuntimeError, match=r"blade engine 'cluster_0'.*of constant \d+ .*differs"):
        torch.jit.load(str(damaged))
