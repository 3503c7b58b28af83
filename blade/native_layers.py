"""Whole layers that torch runs as one native op, spelled as the ops they compute.

nn.TransformerEncoderLayer in eval mode without grad takes torch's "fast path": the layer is one
call, ``torch._transformer_encoder_layer_fwd``, which dynamo records as it is. No engine can take
that call, so a model built from nn.TransformerEncoder stayed wholly in TorchScript. The frontend
(blade/frontend.py, NATIVE_LAYERS) calls the functions below in its place: the same layer written
as linear / scaled_dot_product_attention / layer_norm / gelu or relu, which TorchScript scripts and
engines compile (torch's own slow path computes the same, eager's fast/slow choice aside).

Each function follows the native kernel (aten/src/ATen/native/transformers/transformer.cpp):
post-norm ``x = norm1(src + attention(src)); out = norm2(x + ffn(x))``, pre-norm
``x = src + attention(norm1(src)); out = x + ffn(norm2(x))``; the FFN's activation is GELU (exact)
or ReLU; an empty input comes back as a copy. Only calls without a mask are replaced: the native
kernel reads a float mask as booleans (any non-zero masks out) and gives fully masked rows zeros,
which an additive mask into scaled_dot_product_attention would not match, so masked calls stay as
they are (in TorchScript).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def transformer_encoder_layer(src: torch.Tensor, embed_dim: int, num_heads: int, qkv_weight: torch.Tensor,
                              qkv_bias: torch.Tensor, proj_weight: torch.Tensor, proj_bias: torch.Tensor,
                              use_gelu: bool, norm_first: bool, eps: float, norm_weight_1: torch.Tensor,
                              norm_bias_1: torch.Tensor, norm_weight_2: torch.Tensor, norm_bias_2: torch.Tensor,
                              ffn_weight_1: torch.Tensor, ffn_bias_1: torch.Tensor, ffn_weight_2: torch.Tensor,
                              ffn_bias_2: torch.Tensor) -> torch.Tensor:
    """torch._transformer_encoder_layer_fwd(src [batch, length, embed_dim], ..., mask=None)."""
    if src.numel() == 0:
        return src.clone()
    x = src
    if norm_first:
        x = F.layer_norm(x, [embed_dim], norm_weight_1, norm_bias_1, eps)
    batch, length = x.size(0), x.size(1)
    qkv = F.linear(x, qkv_weight, qkv_bias).view(batch, length, 3, num_heads, embed_dim // num_heads)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [batch, heads, length, head_dim]
    attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, length, embed_dim)
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


# native op -> (its replacement, how many leading arguments the replacement takes; the rest are
# the mask arguments, which must be None)
NATIVE_LAYERS = {
    torch._transformer_encoder_layer_fwd: (transformer_encoder_layer, 18),
}


def unfused(node) -> None:
    """An FX node calling a native layer without a mask -> a call of its spelled-out ops."""
    if node.op != "call_function" or node.target not in NATIVE_LAYERS:
        return
    replacement, taken = NATIVE_LAYERS[node.target]
    masks = list(node.args[taken:]) + list(node.kwargs.values())
    if len(node.args) < taken or any(mask is not None for mask in masks):
        return
    node.target, node.args, node.kwargs = replacement, tuple(node.args[:taken]), {}
