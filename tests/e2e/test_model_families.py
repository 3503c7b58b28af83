"""transformers model families (CNN, ViT, ConvNeXt, encoder-decoder, DistilBERT) from tiny configs
with random weights: tt_infer vs eager (float32, 1e-4 relative), >= 95% of aten nodes in engines.
Each test prints what stayed in TorchScript and why."""
import collections

import pytest
import torch

from blade_testing import compile_and_check

transformers = pytest.importorskip("transformers")


def _check(model, inputs, name, min_coverage=0.95):
    torch.manual_seed(0)
    capture = compile_and_check(model.eval(), inputs, rtol=1e-4, atol=1e-5)
    report = capture.report
    left_out = collections.Counter(report.left_out)
    print(f"\n{name}: {report.aten_in_engines}/{report.aten_total} aten nodes in engines "
          f"= {100 * report.coverage:.1f}% ({len(report.clusters)} cluster(s), {report.how}); left out: "
          + (", ".join(f"{kind} x{n} ({reason})" for (kind, reason), n in left_out.items()) or "nothing"))
    assert report.coverage >= min_coverage


def test_resnet():
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1])
    _check(transformers.ResNetModel(cfg), (torch.randn(1, 3, 64, 64),), "ResNetModel")


def test_vit():
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=128, image_size=32, patch_size=8)
    _check(transformers.ViTModel(cfg), (torch.randn(1, 3, 32, 32),), "ViTModel")


def test_convnext():
    torch.manual_seed(0)
    cfg = transformers.ConvNextConfig(hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], image_size=64)
    _check(transformers.ConvNextModel(cfg), (torch.randn(1, 3, 64, 64),), "ConvNextModel")


def test_t5_encoder_decoder():
    torch.manual_seed(0)
    cfg = transformers.T5Config(d_model=64, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                                d_kv=16, vocab_size=200)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    inputs = (torch.randint(0, 200, (2, 12)), mask, torch.randint(0, 200, (2, 7)))
    _check(transformers.T5Model(cfg), inputs, "T5Model")


def test_distilbert():
    torch.manual_seed(0)
    cfg = transformers.DistilBertConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=200)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 8:] = 0
    _check(transformers.DistilBertModel(cfg), (torch.randint(0, 200, (2, 12)), mask), "DistilBertModel")
