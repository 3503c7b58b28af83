"""The benchmark models: name -> () -> (model, example inputs). Random weights, no downloads.

The first five are the ones blade was tuned on; the rest (transformers configs, batch 1 and 8)
are the broader set it was not. Sizes are picked so a batch-1 call takes 1-50 ms on 2 cores.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F


class MLPBlock(torch.nn.Module):
    """Pre-norm transformer MLP with residual: [8, 256] -> [8, 256], ~8.4 MFLOP."""

    def __init__(self, dim=256, hidden=1024):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, hidden)
        self.fc2 = torch.nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class PointwiseChain(torch.nn.Module):
    """Elementwise chain + softmax + layer norm over [64, 4096]: memory/transcendental bound."""

    def __init__(self, dim=4096):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x):
        y = F.gelu(x * 1.5 + 0.25) * torch.sigmoid(x)
        return self.norm(torch.softmax(y, dim=-1) * 10.0 + x)


def mlp():
    return MLPBlock().eval(), (torch.randn(8, 256),)


def bert():
    import transformers
    cfg = transformers.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                  intermediate_size=1024)
    return transformers.BertModel(cfg).eval(), (torch.randint(0, cfg.vocab_size, (1, 128)),)


def gpt2():
    import transformers
    cfg = transformers.GPT2Config(n_embd=256, n_layer=4, n_head=4, use_cache=False)
    return transformers.GPT2Model(cfg).eval(), (torch.randint(0, cfg.vocab_size, (1, 128)),)


def resnet18():
    import transformers
    cfg = transformers.ResNetConfig(depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512],
                                    embedding_size=64, layer_type="basic")
    return transformers.ResNetModel(cfg).eval(), (torch.randn(1, 3, 224, 224),)


def pointwise():
    return PointwiseChain().eval(), (torch.randn(64, 4096),)


# ---------------------------------------------------------------------------------------------
# The broader set: models nobody here tuned for. Each builder takes the batch size.
# ---------------------------------------------------------------------------------------------

SEQ = 128


def _tokens(cfg, batch, seq=SEQ):
    return torch.randint(0, cfg.vocab_size, (batch, seq))


def distilbert(batch):
    import transformers
    cfg = transformers.DistilBertConfig(dim=256, n_layers=4, n_heads=4, hidden_dim=1024)
    return transformers.DistilBertModel(cfg).eval(), (_tokens(cfg, batch),)


def bert_padded(batch):
    """BERT with an attention mask whose last quarter is padding (the masked-softmax path)."""
    import transformers
    cfg = transformers.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                  intermediate_size=1024)
    mask = torch.ones(batch, SEQ, dtype=torch.int64)
    mask[:, SEQ * 3 // 4:] = 0
    return transformers.BertModel(cfg).eval(), (_tokens(cfg, batch), mask)


def vit(batch):
    import transformers
    cfg = transformers.ViTConfig(hidden_size=192, num_hidden_layers=4, num_attention_heads=3,
                                 intermediate_size=768, image_size=224, patch_size=16)
    return transformers.ViTModel(cfg, add_pooling_layer=False).eval(), (torch.randn(batch, 3, 224, 224),)


def mobilenet_v2(batch):
    import transformers
    cfg = transformers.MobileNetV2Config(image_size=160, depth_multiplier=1.0)
    return transformers.MobileNetV2Model(cfg).eval(), (torch.randn(batch, 3, 160, 160),)


def convnext(batch):
    import transformers
    cfg = transformers.ConvNextConfig(depths=[1, 1, 3, 1], hidden_sizes=[48, 96, 192, 384], image_size=160)
    return transformers.ConvNextModel(cfg).eval(), (torch.randn(batch, 3, 160, 160),)


def t5_encoder(batch):
    import transformers
    cfg = transformers.T5Config(d_model=256, d_ff=1024, d_kv=64, num_layers=4, num_heads=4,
                                use_cache=False)
    return transformers.T5EncoderModel(cfg).eval(), (_tokens(cfg, batch),)


def llama(batch):
    """Two decoder layers: RMSNorm, SiLU-gated MLP, rotary embeddings, causal mask, GQA."""
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=32000,
                                   max_position_embeddings=512, use_cache=False)
    return transformers.LlamaModel(cfg).eval(), (_tokens(cfg, batch),)


BROADER = {
    "DistilBERT (4L, 256, seq 128)": distilbert,
    "BERT padded mask (4L, 256, seq 128)": bert_padded,
    "ViT (4L, 192, 224x224)": vit,
    "MobileNetV2 (160x160)": mobilenet_v2,
    "ConvNeXt (1-1-3-1, 48-384, 160x160)": convnext,
    "T5 encoder (4L, 256, seq 128)": t5_encoder,
    "Llama (2L, 256, GQA 4/2, seq 128)": llama,
}

MODELS = {
    "MLP block [8,256]": mlp,
    "BERT (4L, 256, seq 128)": bert,
    "GPT-2 (4L, 256, seq 128)": gpt2,
    "ResNet-18 (224x224)": resnet18,
    "pointwise+softmax+norm [64,4096]": pointwise,
    **{f"{name} b{batch}": partial(build, batch) for batch in (1, 8) for name, build in BROADER.items()},
}
