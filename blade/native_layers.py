"""Whole layers that torch runs as one native op, spelled as the ops they compute.

nn.TransformerEncoderLayer in eval mode without grad takes torch's "fast path": the layer is one
call, ``torch._transformer_encoder_layer_fwd``, which dynamo records as it is. No engine can take
that call, so a model built from nn.TransformerEncoder stayed wholly in TorchScript. The frontend
(blade/frontend.py, through unfused) calls the functions below in its place: the same layer written
as linear / scaled_dot_product_attention / layer_norm / gelu or relu, which TorchScript scripts and
engines compile (torch's own slow path computes the same, eager's fast/slow choice aside).

Each function follows the native kernel (aten/src/ATen/native/transformers/transformer.cpp):
post-norm ``x = norm1(src + attention(src)); out = norm2(x + ffn(x))``, pre-norm
``x = src + attention(norm1(src)); out = x + ffn(norm2(x))``; the FFN's activation is GELU (exact)
or ReLU; an empty input comes back as a copy. Its mask is read the native way: any non-zero entry
(nn.TransformerEncoderLayer passes -inf/0 floats) masks its key out, a row with every key masked
comes out NaN (torch._masked_softmax's), and the mask types merge_masks makes are understood (1: a
[batch, length] key padding mask; 2: a mask broadcast over [batch, heads, length, length]); a call
with another mask type is left as it is (in TorchScript).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


def transformer_encoder_layer(src: torch.Tensor, embed_dim: int, num_heads: int, qkv_weight: torch.Tensor,
                              qkv_bias: torch.Tensor, proj_weight: torch.Tensor, proj_bias: torch.Tensor,
                              use_gelu: bool, norm_first: bool, eps: float, norm_weight_1: torch.Tensor,
                              norm_bias_1: torch.Tensor, norm_weight_2: torch.Tensor, norm_bias_2: torch.Tensor,
                              ffn_weight_1: torch.Tensor, ffn_bias_1: torch.Tensor, ffn_weight_2: torch.Tensor,
                              ffn_bias_2: torch.Tensor, mask: Optional[torch.Tensor] = None,
                              mask_type: Optional[int] = None) -> torch.Tensor:
    """torch._transformer_encoder_layer_fwd(src [batch, length, embed_dim], ...)."""
    if src.numel() == 0:
        return src.clone()
    x = src
    if norm_first:
        x = F.layer_norm(x, [embed_dim], norm_weight_1, norm_bias_1, eps)
    batch, length, head_dim = x.size(0), x.size(1), embed_dim // num_heads
    qkv = F.linear(x, qkv_weight, qkv_bias).view(batch, length, 3, num_heads, head_dim)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [batch, heads, length, head_dim]
    if mask is None:
        attended = F.scaled_dot_product_attention(q, k, v)
    else:
        masked = mask.to(torch.bool)
        if mask_type == 1:
            masked = masked.view(batch, 1, 1, length)
        scores = torch.matmul(q / math.sqrt(head_dim), k.transpose(-2, -1)).masked_fill(masked, -math.inf)
        attended = torch.matmul(torch.softmax(scores, -1), v)
    attended = attended.transpose(1, 2).reshape(batch, length, embed_dim)
    x = F.linear(attended, proj_weight, proj_bias) + src
    if not norm_first:
        x = F.layer_norm(x, [embed_dim], norm_weight_1, norm_bias_1, eps)
    hidden = F.layer_norm(x, [embed_dim], norm_weight_2, norm_bias_2, eps) if norm_first else x
    hidden = F.linear(hidden, ffn_weight_1, ffn_bias_1)
    hidden = F.gelu(hidden) if use_gelu else F.relu(hidden)
    x = F.linear(hidden, ffn_weight_2, ffn_bias_2) + x
    if not norm_first:
        x = F.layer_norm(x, [embed_dim], norm_weight_2, norm_bias_2, eps)
    return x


def _encoder_masks_understood(args: tuple, kwargs: dict) -> bool:
    mask = args[18] if len(args) > 18 else kwargs.get("mask")
    mask_type = args[19] if len(args) > 19 else kwargs.get("mask_type")
    return mask is None or mask_type in (1, 2)


# native op -> (its replacement, taking the same arguments; whether it replaces a call with these)
NATIVE_LAYERS = {
    torch._transformer_encoder_layer_fwd: (transformer_encoder_layer, _encoder_masks_understood),
}


def unfused(node) -> None:
    """An FX node calling a native layer -> a call of its spelled-out ops, where they match it."""
    if node.op != "call_function" or node.target not in NATIVE_LAYERS:
        return
    replacement, understood = NATIVE_LAYERS[node.target]
    if understood(node.args, node.kwargs):
        node.target = replacement
