"""Attention blocks in the shapes transformers write them, engine vs eager.

The fused attention reads Q, K and V in place, also where they are one head's slice of a projection
(whose GEMM adds the projection's bias itself), and computes a masked softmax's row max once. These cases cover each operand layout
(fused QKV with and without bias, separate projections, heads from a transposed or sliced input),
masks (none, causal, bool with a fully masked row, additive float), odd head counts and sizes,
grouped-query heads (repeat_kv) and batches."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from blade_testing import Capture, compile_and_check


class FusedQKV(torch.nn.Module):
    """GPT-2 / T5 style: one projection for q, k and v, split into heads by views."""

    def __init__(self, dim, heads, bias=True, mask="none", explicit=False):
        super().__init__()
        self.heads, self.mask, self.explicit = heads, mask, explicit
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=bias)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.explicit:   # matmul / softmax / matmul as BERT and T5 write it
            scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
            if self.mask == "causal":
                keep = torch.ones(t, t, dtype=torch.bool).tril()
                scores = torch.where(keep, scores, torch.finfo(scores.dtype).min)
            elif mask is not None:
                scores = scores + mask
            y = torch.softmax(scores, dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.mask == "causal")
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class SeparateQKV(torch.nn.Module):
    """BERT style: three biased projections, heads by view and permute, an additive mask."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (torch.nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, d // self.heads).permute(0, 2, 1, 3) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5 + mask
        y = torch.softmax(scores, dim=-1) @ v
        return self.out(y.permute(0, 2, 1, 3).reshape(b, t, d))


class GroupedQuery(torch.nn.Module):
    """Llama style: separate q/k/v projections, fewer k/v heads repeated for the query heads."""

    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim, bias=False)
        self.k = torch.nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v = torch.nn.Linear(dim, kv_heads * self.head_dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = (p(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2) for p in (self.k, self.v))
        groups = self.heads // self.kv_heads
        k, v = (z[:, :, None].expand(b, self.kv_heads, groups, t, self.head_dim)
                .reshape(b, self.heads, t, self.head_dim) for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, t, -1)


class HeadsOfInput(torch.nn.Module):
    """q, k and v are views of the (non-contiguous) input itself: nothing computed to fuse into."""

    def forward(self, x):
        x = x.transpose(0, 1)                    # [t, b, 3 * h * d] -> [b, t, 3 * h * d], strided
        b, t, _ = x.shape
        q, k, v = (z.reshape(b, t, 3, 8).transpose(1, 2) for z in x.split(24, dim=-1))
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


def padding_mask(batch, length, additive):
    keep = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    keep[-1, ..., length // 2:] = False
    return torch.zeros(keep.shape).masked_fill(~keep, float("-inf")) if additive else keep


CASES = {
    "gpt2 bias causal sdpa": (FusedQKV(64, 4, mask="causal"), (2, 16)),
    "gpt2 bias causal explicit": (FusedQKV(64, 4, mask="causal", explicit=True), (1, 16)),
    "t5 no bias no mask": (FusedQKV(64, 4, bias=False, explicit=True), (2, 16)),
    "odd heads and sizes": (FusedQKV(15, 3, explicit=True), (3, 7)),
    "one head": (FusedQKV(16, 1), (1, 5)),
}


@pytest.mark.parametrize("name", CASES)
def test_attention_matches_eager(name):
    torch.manual_seed(0)
    model, (batch, length) = CASES[name]
    x = torch.randn(batch, length, model.qkv.in_features)
    compile_and_check(model.eval(), (x,), min_cluster_size=1)


@pytest.mark.parametrize("additive", [False, True], ids=["bool mask", "additive mask"])
@pytest.mark.parametrize("explicit", [False, True], ids=["sdpa", "explicit"])
def test_masked_attention_with_a_fully_masked_row(additive, explicit):
    """The last batch row masks half the keys; with a bool mask sdpa also sees a query row that
    keeps no key at all (its output is 0), whose row max the softmax and the check share."""
    torch.manual_seed(0)
    model = FusedQKV(32, 2, explicit=explicit).eval()
    mask = padding_mask(2, 12, additive)
    if not additive and not explicit:
        mask = mask.expand(2, 1, 12, 12).clone()
        mask[0, 0, 3] = False
    if additive and explicit:
        mask = mask.clamp(min=torch.finfo(torch.float32).min)   # eager's explicit softmax needs finite
    compile_and_check(model, (torch.randn(2, 12, 32), mask), min_cluster_size=1)


@pytest.mark.parametrize("batch", [1, 3])
def test_grouped_query_attention(batch):
    torch.manual_seed(0)
    compile_and_check(GroupedQuery(48, 6, 2).eval(), (torch.randn(batch, 10, 48),), min_cluster_size=1)


def test_heads_viewed_from_a_non_contiguous_input():
    torch.manual_seed(0)
    compile_and_check(HeadsOfInput().eval(), (torch.randn(9, 2, 72),), min_cluster_size=1)


def _engine_sources(dump_dir) -> str:
    return "\n".join(p.read_text() for p in sorted(dump_dir.rglob("engine.cpp")))


# Sequence lengths past one block of query rows per head (the runtime takes 16384 / seq rows at a
# time, in register blocks of 6 with AVX2, 8 with AVX-512): 700 keys give blocks of 18 rows, the
# last one 16 (6 + 6 + 4), and a last 16-key panel 12 wide (AVX-512: blocks of 16, the last 12 = 8 + 4,
# a last 32-key panel 28 wide); head dim 12 is no multiple of the 8- or 16-float transpose.
@pytest.mark.parametrize("mask", ["padded", "causal", "none"])
@pytest.mark.parametrize("length", [9, 700])
def test_attention_is_one_fused_call(tmp_path, mask, length):
    """Q.K^T, the scale, the mask, the softmax and P.V become one rt->attention call (no score
    matrix through memory) whose result matches eager: a padded bool mask (with a query row that
    keeps no key: its output is 0), a causal mask and none."""
    torch.manual_seed(0)
    model = FusedQKV(36, 3, mask="causal" if mask == "causal" else "none").eval()
    inputs = (torch.randn(2, length, 36),)
    if mask == "padded":
        keep = padding_mask(2, length, additive=False).expand(2, 1, length, length).clone()
        keep[0, 0, 3] = False
        inputs += (keep,)
    compile_and_check(model, inputs, min_cluster_size=1, dump_dir=str(tmp_path))
    source = _engine_sources(tmp_path)
    assert source.count("rt->attention(") == 1, "one fused attention call"
    assert source.count("rt->sgemm(") == 2, "only the two projections stay GEMMs"


def test_fused_attention_at_run_time_sequence_lengths(tmp_path):
    """One dynamic compile: the fused call takes the sequence length (rows and keys) at run time."""
    torch.manual_seed(0)
    model = FusedQKV(32, 2, explicit=True).eval()
    capture = Capture(dump_dir=str(tmp_path))
    compiled = torch.compile(model, backend=capture, dynamic=True)
    with torch.no_grad():
        for batch, length in [(2, 8), (1, 40), (3, 131)]:
            x = torch.randn(batch, length, 32)
            mask = padding_mask(batch, length, additive=True).clamp(min=torch.finfo(torch.float32).min)
            torch.testing.assert_close(compiled(x, mask), model(x, mask), rtol=1e-4, atol=1e-5)
    assert len(capture.compiled) <= 2, "one dynamic graph serves the lengths (after the first static one)"
    assert "rt->attention(" in _engine_sources(tmp_path)


@pytest.mark.parametrize("style", ["gpt2", "bert"])
def test_biased_projections_are_read_in_place_by_the_fused_attention(tmp_path, style):
    """GPT-2's one biased q/k/v projection and BERT's three: the projection's GEMM adds its bias
    itself (C filled with the bias row, sgemm's beta 1), so the fused attention reads every head where its
    projection wrote it. No kernel copies a head (the copy used to add the bias), and the result
    matches eager."""
    torch.manual_seed(0)
    x = torch.randn(2, 20, 48)
    if style == "gpt2":
        model, inputs = FusedQKV(48, 4, mask="causal").eval(), (x,)
    else:
        mask = padding_mask(2, 20, additive=True).clamp(min=torch.finfo(torch.float32).min)
        model, inputs = SeparateQKV(48, 4).eval(), (x, mask)
    compile_and_check(model, inputs, min_cluster_size=1, dump_dir=str(tmp_path))
    source = _engine_sources(tmp_path)
    assert source.count("rt->attention(") == 1, "one fused attention call"
    assert "contiguous copy" not in source
    betas = [call.split(", ")[13] for call in re.findall(r"rt->sgemm\((.*)\);", source)]
    # the q/k/v projection (BERT's three are one GEMM: frontend._concat_shared_input_linears) adds
    # its bias; the output projection's bias (a graph output: no attention reads it) stays an add
    assert betas == ["1.0f", "0.0f"], betas
