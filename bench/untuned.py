"""Models at realistic sizes that bench/run.py does not have and nobody here tuned for: blade's AOT
archive against ONNX Runtime at its defaults and eager, in one process per model.

    PYTHONPATH=$PWD .venv/bin/python bench/untuned.py [--models roberta,regnet] [--rounds 9] [--out bench/UNTUNED.md]

Per model (a transformers config or torch.nn layers, random weights, seed 0, convolutions, linears and batch norms
re-initialised as bench/families.py does so that outputs do not vanish, eval, torch.no_grad, 2
threads): the
archive (`blade.export` then `blade.load`, bench/backends.py) and ONNX Runtime (default session
options, the faster of the two exporters) built once, then `--rounds` rounds alternating the
three (the order reversed every other round, 2 warm-up calls and a median of 5-50 calls each, a
0.15 s pause between them). "archive vs ORT" is the median over rounds of ORT's time / the
archive's in the same round (above 1: the archive is faster). Rel err = max |archive - eager| /
max |eager| on the first output. "aten ops in engines": the archive's share of the model's aten ops
that engines compute (a cluster that fails to compile stays in TorchScript, with a warning). A
shorter, rougher look than bench/run.py (no Inductor, no frozen TorchScript, no load gating): it
asks whether the archive's lead holds off the benchmark's own models.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.getcwd())
from bench import backends  # noqa: E402
from bench.families import _reinit  # noqa: E402

SEQ = 128


def _tokens(cfg, batch=1, seq=SEQ):
    return torch.randint(5, cfg.vocab_size, (batch, seq))


def _image(size=224, batch=1):
    return torch.randn(batch, 3, size, size)


def roberta():
    import transformers
    cfg = transformers.RobertaConfig(hidden_size=384, num_hidden_layers=4, num_attention_heads=6,
                                     intermediate_size=1536)
    return "RoBERTa (4L, 384, seq 128)", transformers.RobertaModel(cfg), (_tokens(cfg),)


def qwen2():
    import transformers
    cfg = transformers.Qwen2Config(hidden_size=384, intermediate_size=1024, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, vocab_size=8000, use_cache=False)
    return "Qwen2 (2L, 384, GQA 6/2, seq 128)", transformers.Qwen2Model(cfg), (_tokens(cfg),)


def gpt_neox():
    import transformers
    cfg = transformers.GPTNeoXConfig(hidden_size=384, num_hidden_layers=3, num_attention_heads=6,
                                     intermediate_size=1536, vocab_size=8000, use_cache=False)
    return "GPT-NeoX (3L, 384, seq 128)", transformers.GPTNeoXModel(cfg), (_tokens(cfg),)


def bart():
    import transformers
    cfg = transformers.BartConfig(d_model=256, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                  decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024,
                                  vocab_size=8000, use_cache=False)
    return ("BART (2+2L, 256, enc 128, dec 32)", transformers.BartModel(cfg),
            (_tokens(cfg), torch.ones(1, SEQ, dtype=torch.int64), _tokens(cfg, 1, 32)))


def whisper_encoder():
    import transformers
    cfg = transformers.WhisperConfig(d_model=384, encoder_layers=2, decoder_layers=1, encoder_attention_heads=6,
                                     encoder_ffn_dim=1536, max_source_positions=500, num_mel_bins=80)
    return "Whisper encoder (2L, 384, 80x1000)", transformers.WhisperModel(cfg).get_encoder(), (torch.randn(1, 80, 1000),)


def deit():
    import transformers
    cfg = transformers.DeiTConfig(hidden_size=384, num_hidden_layers=4, num_attention_heads=6, intermediate_size=1536)
    return "DeiT (4L, 384, 224x224)", transformers.DeiTModel(cfg, add_pooling_layer=False), (_image(),)


def swin():
    import transformers
    cfg = transformers.SwinConfig(image_size=224, embed_dim=64, depths=[2, 2, 2], num_heads=[2, 4, 8], window_size=7)
    return "Swin (2-2-2, 64, 224x224)", transformers.SwinModel(cfg), (_image(),)


def segformer():
    import transformers
    return "SegFormer (b0, 256x256)", transformers.SegformerModel(transformers.SegformerConfig(image_size=256)), (_image(256),)


def resnet50():
    import transformers
    cfg = transformers.ResNetConfig(layer_type="bottleneck", depths=[1, 2, 2, 1], hidden_sizes=[256, 512, 1024, 2048],
                                    embedding_size=64)
    return "ResNet bottleneck (1-2-2-1, 256-2048, 224x224)", transformers.ResNetModel(cfg), (_image(),)


def regnet():
    import transformers
    cfg = transformers.RegNetConfig(depths=[1, 2, 4, 1], hidden_sizes=[48, 104, 208, 440], groups_width=8)
    return "RegNet-Y (1-2-4-1, 48-440, groups of 8, 224x224)", transformers.RegNetModel(cfg), (_image(),)


def efficientnet():
    import transformers
    cfg = transformers.EfficientNetConfig(width_coefficient=1.0, depth_coefficient=1.0, image_size=224, hidden_dim=1280)
    return "EfficientNet-B0 (224x224)", transformers.EfficientNetModel(cfg), (_image(),)


def mobilevit():
    import transformers
    cfg = transformers.MobileViTConfig(image_size=256)   # MobileViT-S: SiLU after its convolutions
    return "MobileViT-S (256x256)", transformers.MobileViTModel(cfg), (_image(256),)


def deberta():
    import transformers   # disentangled attention: relative-position gathers beside the scores
    cfg = transformers.DebertaV2Config(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                       intermediate_size=1024, vocab_size=8000)
    return "DeBERTa-v2 (4L, 256, seq 128)", transformers.DebertaV2Model(cfg), (_tokens(cfg),)


def bloom():
    import transformers   # ALiBi: a per-head linear bias on the scores instead of positions
    cfg = transformers.BloomConfig(hidden_size=256, n_layer=4, n_head=4, vocab_size=8000, use_cache=False)
    return "BLOOM (4L, 256, ALiBi, seq 128)", transformers.BloomModel(cfg), (_tokens(cfg),)


def mistral():
    import transformers   # sliding-window causal attention (64 of 128 tokens), GQA 4/2
    cfg = transformers.MistralConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=8000, use_cache=False, sliding_window=64)
    return "Mistral (4L, 256, window 64, seq 128)", transformers.MistralModel(cfg), (_tokens(cfg),)


def beit():
    import transformers   # a learned relative-position bias on every layer's scores
    cfg = transformers.BeitConfig(hidden_size=192, num_hidden_layers=4, num_attention_heads=3, intermediate_size=768,
                                  use_relative_position_bias=True)
    return "BEiT (4L, 192, relative bias, 224x224)", transformers.BeitModel(cfg), (_image(),)


def levit():
    import transformers   # hardswish after convolutions and linears, attention biases
    return "LeViT-128S (224x224)", transformers.LevitModel(transformers.LevitConfig()), (_image(),)


def poolformer():
    import transformers   # group norm (one group), average pooling as the token mixer, GELU after 1x1s
    return "PoolFormer-S12 (224x224)", transformers.PoolFormerModel(transformers.PoolFormerConfig()), (_image(),)


def convnextv2():
    import transformers   # global response norm: an L2 norm over H, W per channel
    cfg = transformers.ConvNextV2Config(depths=[2, 2, 6, 2], hidden_sizes=[64, 128, 256, 512])
    return "ConvNeXtV2 (2-2-6-2, 64-512, 224x224)", transformers.ConvNextV2Model(cfg), (_image(),)


def mobilenet_v1():
    import transformers   # ReLU6, TF "same" padding, depthwise + 1x1 pairs
    return "MobileNetV1 (224x224)", transformers.MobileNetV1Model(transformers.MobileNetV1Config()), (_image(),)


def _audio(seconds=1.0, batch=1):
    return torch.randn(batch, int(16000 * seconds))


def wav2vec2():
    import transformers   # strided Conv1d feature extractor (a per-channel group norm first), grouped positional conv
    cfg = transformers.Wav2Vec2Config(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024)
    return "Wav2Vec2 (2L, 256, 1 s of 16 kHz audio)", transformers.Wav2Vec2Model(cfg), (_audio(),)


def hubert():
    import transformers   # the feature extractor with a layer norm over the channels between transposes
    cfg = transformers.HubertConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024,
                                    feat_extract_norm="layer", do_stable_layer_norm=True)
    return "HuBERT (2L, 256, layer-norm extractor, 1 s)", transformers.HubertModel(cfg), (_audio(),)


def speech2text():
    import transformers   # two strided Conv1d (GLU) subsampling 80 mel features
    cfg = transformers.Speech2TextConfig(d_model=256, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4,
                                         encoder_ffn_dim=1024)
    return "Speech2Text encoder (2L, 256, 584x80)", transformers.Speech2TextModel(cfg).get_encoder(), (torch.randn(1, 584, 80),)


def squeezebert():
    import transformers   # grouped 1x1 Conv1d for its projections, layer norms over the channels
    cfg = transformers.SqueezeBertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                                         embedding_size=256, vocab_size=8000)
    return "SqueezeBERT (4L, 256, 4-group convs)", transformers.SqueezeBertModel(cfg), (_tokens(cfg),)


def pvt_v2():
    import transformers   # spatial-reduction attention: a strided conv and a layer norm on the keys' tokens
    return "PVTv2-b0 (224x224)", transformers.PvtV2Model(transformers.PvtV2Config()), (_image(),)


def focalnet():
    import transformers   # focal modulation: depthwise convs, gating, global average context
    cfg = transformers.FocalNetConfig(embed_dim=64, depths=[2, 2, 2, 2])
    return "FocalNet (2-2-2-2, 64, 224x224)", transformers.FocalNetModel(cfg), (_image(),)


def bit():
    import transformers   # group norms of 32 groups after every convolution, weight-standardized convolutions
    cfg = transformers.BitConfig(layer_type="bottleneck", depths=[1, 1, 1, 1], hidden_sizes=[256, 512, 1024, 2048])
    return "BiT (bottleneck 1-1-1-1, 32-group norms, 224x224)", transformers.BitModel(cfg), (_image(),)


def univnet():
    import transformers   # a vocoder: transposed Conv1d upsampling, location-variable convolutions (Tensor.unfold)
    cfg = transformers.UnivNetConfig(model_in_channels=64, model_hidden_channels=32, num_mel_bins=100)
    return "UnivNet vocoder (50 frames, 32 channels)", transformers.UnivNetModel(cfg), (torch.randn(1, 50, 100),
                                                                                         torch.randn(1, 50, 64))


class _PaddedEncoder(torch.nn.Module):
    """torch.nn's own encoder as users build it: eval without grad takes the native fast path."""

    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)

    def forward(self, x, padding):
        return self.encoder(x, src_key_padding_mask=padding)


def torch_encoder():
    padding = torch.zeros(2, SEQ, dtype=torch.bool)
    padding[0, 100:] = True
    return ("nn.TransformerEncoder (4L, 256, padding mask, batch 2, seq 128)", _PaddedEncoder(),
            (torch.randn(2, SEQ, 256), padding))


class _CausalDecoder(torch.nn.Module):
    """torch.nn's own decoder: nn.MultiheadAttention's scripted F.multi_head_attention_forward."""

    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerDecoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
        self.decoder = torch.nn.TransformerDecoder(layer, 3)

    def forward(self, x, memory):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.decoder(x, memory, tgt_mask=mask, tgt_is_causal=True)


def torch_decoder():
    return ("nn.TransformerDecoder (3L, 256, causal, 64 over 128)", _CausalDecoder(),
            (torch.randn(1, 64, 256), torch.randn(1, SEQ, 256)))


# At the published models' own sizes (each config's defaults): GEMM-bound 768-wide layers and
# 9 MiB weights the small rows above do not have (GPT-2 small ran behind eager here while its GEMM
# choice was still sampling, the small rows never showed it).
def bert_base():
    import transformers
    cfg = transformers.BertConfig()
    return "BERT-base (12L, 768, seq 128)", transformers.BertModel(cfg, add_pooling_layer=False), (_tokens(cfg),)


def gpt2_small():
    import transformers
    cfg = transformers.GPT2Config(use_cache=False)
    return "GPT-2 small (12L, 768, seq 128)", transformers.GPT2Model(cfg), (_tokens(cfg),)


def vit_base():
    import transformers
    cfg = transformers.ViTConfig()
    return "ViT-B/16 (224x224)", transformers.ViTModel(cfg, add_pooling_layer=False), (_image(),)


def resnet50_full():
    import transformers
    return "ResNet-50 (224x224)", transformers.ResNetModel(transformers.ResNetConfig()), (_image(),)


MODELS = {f.__name__: f for f in (roberta, qwen2, gpt_neox, bart, whisper_encoder, deit, swin, segformer, resnet50,
                                   regnet, efficientnet, mobilevit, deberta, bloom, mistral, beit, levit, poolformer,
                                   convnextv2, mobilenet_v1, wav2vec2, hubert, speech2text, squeezebert, pvt_v2,
                                   focalnet, bit, univnet, torch_encoder, torch_decoder, bert_base, gpt2_small,
                                   vit_base, resnet50_full)}


def _first(out):
    if isinstance(out, (tuple, list)):
        return _first(out[0])
    for field in ("last_hidden_state", "waveforms"):
        if hasattr(out, field):
            return getattr(out, field)
    return out


def measure(key: str, rounds: int) -> dict:
    torch.manual_seed(0)
    name, model, inputs = MODELS[key]()
    _reinit(model).eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runs = {"eager": model, "ORT": backends.onnxruntime_cpu(model, inputs),
                "archive": backends.tt_infer_aot(model, inputs)}
        exporter = backends.ORT_CHOSEN.get("last")
        report = backends.AOT_REPORTS["last"]   # an engine that failed to compile leaves its ops in TorchScript
        coverage = report.aten_in_engines / report.aten_total if report.aten_total else 0.0
        expected, actual = _first(model(*inputs)), _first(runs["archive"](*inputs))
        err = ((actual - expected).abs().max() / expected.abs().max()).item()
        calls = max(5, min(50, int(0.08 / backends.median_call_s(model, inputs, 3))))
        times = {k: [] for k in runs}
        for r in range(rounds):
            for k in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                for _ in range(2):
                    runs[k](*inputs)
                samples = []
                for _ in range(calls):
                    start = time.perf_counter()
                    runs[k](*inputs)
                    samples.append(time.perf_counter() - start)
                times[k].append(statistics.median(samples))
                time.sleep(0.15)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return {"model": name, **ms, "exporter": exporter, "err": err, "coverage": coverage,
            "vs_ort": statistics.median(o / a for a, o in zip(times["archive"], times["ORT"]))}


def render(rows: list, command: str) -> str:
    lines = ["# blade's archive on models bench/run.py does not have", "",
             f"`{command}`; {backends.machine()}, {torch.get_num_threads()} threads. " + __doc__.split("\n\n")[2]
             .replace("\n", " ").strip(), "",
             "| model | eager ms | ONNX Runtime ms | archive ms | archive x eager | archive vs ORT | ORT exporter | rel err "
             "| aten ops in engines |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | failed: {r['error']} | | | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['eager']:.2f} | {r['ORT']:.2f} | {r['archive']:.2f} | "
                     f"{r['eager'] / r['archive']:.2f} | {r['vs_ort']:.2f} | {r['exporter']} | {r['err']:.1e} | "
                     f"{100 * r['coverage']:.0f}% |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default=None, help="write the markdown table there (default: print it)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = []
    for key in args.models.split(","):
        try:
            rows.append(measure(key, args.rounds))
        except Exception as e:  # a model that fails to build, export or run is a row, not the end
            rows.append({"model": key, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
        print(rows[-1], flush=True)
    text = render(rows, "python bench/untuned.py " + " ".join(sys.argv[1:]))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
