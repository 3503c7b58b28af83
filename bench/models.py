"""The benchmark models: name -> () -> (model, example inputs). Random weights, no downloads."""
from __future__ import annotations

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


MODELS = {
    "MLP block [8,256]": mlp,
    "BERT (4L, 256, seq 128)": bert,
    "GPT-2 (4L, 256, seq 128)": gpt2,
    "ResNet-18 (224x224)": resnet18,
    "pointwise+softmax+norm [64,4096]": pointwise,
}
