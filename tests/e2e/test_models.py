"""Whole models through tt_infer vs eager, with engines asserted and coverage printed."""
import math

import pytest
import torch
import torch.nn.functional as F

from blade_testing import compile_and_check


class AttentionBlock(torch.nn.Module):
    """A pre-norm transformer block written out by hand (no SDPA): masks, softmax, residuals."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.fc2 = torch.nn.Linear(4 * dim, dim)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
        attn = torch.softmax(scores, dim=-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


def test_mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, 10), torch.nn.LogSoftmax(-1)).eval()
    capture = compile_and_check(model, (torch.randn(8, 64),))
    assert capture.report.coverage == 1.0


def test_attention_block():
    torch.manual_seed(0)
    mask = torch.ones(2, 16, dtype=torch.int64)
    mask[1, 11:] = 0
    capture = compile_and_check(AttentionBlock().eval(), (torch.randn(2, 16, 64), mask))
    assert capture.report.coverage == 1.0


class PatchEmbedding(torch.nn.Module):
    """ViT's stem: a conv whose windows tile the image (one GEMM of the patches in the engine),
    flattened to tokens, a class token prepended."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Conv2d(3, 32, kernel_size=10, stride=10)
        self.cls = torch.nn.Parameter(torch.randn(1, 1, 32))

    def forward(self, x):
        tokens = self.proj(x).flatten(2).transpose(1, 2)
        return torch.cat([self.cls.expand(x.shape[0], -1, -1), tokens], dim=1)


@pytest.mark.parametrize("size", [40, 47], ids=["tiled", "ragged edge"])
def test_patch_embedding(size):
    torch.manual_seed(0)
    compile_and_check(PatchEmbedding().eval(), (torch.randn(2, 3, size, size),), min_cluster_size=1)


def _coverage_check(capture, name):
    report = capture.report
    print(f"\n{name}: {report.aten_in_engines}/{report.aten_total} aten nodes in engines "
          f"= {100 * report.coverage:.1f}% ({len(report.clusters)} cluster(s), {report.how})")
    assert report.coverage >= 0.9


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def test_bert(transformers):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                  intermediate_size=1024)
    model = transformers.BertModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 128))
    mask = torch.ones(1, 128, dtype=torch.int64)
    mask[0, 100:] = 0
    _coverage_check(compile_and_check(model, (ids, mask)), "BertModel")


def test_gpt2(transformers):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=256, n_layer=4, n_head=4)
    model = transformers.GPT2Model(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 128))
    _coverage_check(compile_and_check(model, (ids,)), "GPT2Model")
