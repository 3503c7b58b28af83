"""Test wide: blade's tt_infer on transformers model families nobody here tuned for.

    .venv/bin/python bench/families.py [--models substr,substr] [--out bench/FAMILIES.md]

Per family: a small model built from its transformers config with random weights (torch.manual_seed(0),
eval(), no downloads), its eager output under torch.no_grad(), then torch._dynamo.reset() and
torch.compile(model, backend=tt_infer) called twice. Every floating tensor of the output structure
(tuples, dicts, ModelOutput) is compared with eager: max|diff| / max(max|eager|, 1e-6) > 1e-4 is
WRONG; an exception is CRASH (type, first line, blade's warning lines). The backend is blade's own
tt_infer function wrapped only to keep each graph's CompileReport (as bench/backends.py does), so
coverage (aten ops in engines / total) and every op left in TorchScript with its reason come from
the very compile that is checked and timed. Timing: one thread, eager and tt_infer calls
interleaved, median of N calls after warm-up.

Each model runs in its own subprocess (a segfault or an abort is a CRASH of that model only), one at
a time, with COMPILE_PARALLELISM=1 and one torch thread.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REL_TOL = 1e-4
TIMED_CALLS = 20
WARMUP_CALLS = 3
MODEL_TIMEOUT_S = 3600

BATCH = 2
SEQ = 16
VOCAB = 1000


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

def _ids(vocab=VOCAB, batch=BATCH, seq=SEQ, low=5):
    import torch
    return torch.randint(low, vocab, (batch, seq))


def _mask(batch=BATCH, seq=SEQ, pad=4):
    """All ones but the last `pad` positions of the last row (right padding)."""
    import torch
    m = torch.ones(batch, seq, dtype=torch.int64)
    m[-1, seq - pad:] = 0
    return m


def _padded_text(vocab=VOCAB, pad_id=0, **kw):
    ids = _ids(vocab, **{k: v for k, v in kw.items() if k in ("batch", "seq")})
    mask = _mask(**{k: v for k, v in kw.items() if k in ("batch", "seq", "pad")})
    ids = ids.masked_fill(mask == 0, pad_id)
    return ids, mask


def _reinit(model):
    """PyTorch's default init for convolutions and linears, random batch-norm affine and running
    statistics: several transformers vision configs initialise conv / batch-norm weights with
    std 0.02, so with random weights their outputs vanish (EfficientNet's and MobileViT's are all
    zeros, MobileNetV1's ~1e-32) and a comparison against eager checks nothing."""
    import torch
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Linear)):
                m.reset_parameters()
            elif isinstance(m, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d)):
                n = m.num_features
                m.weight.copy_(torch.rand(n, generator=g) + 0.5)
                m.bias.copy_(torch.randn(n, generator=g) * 0.1)
                m.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
    return model


def _image(size=32, channels=3, batch=BATCH):
    import torch
    return torch.randn(batch, channels, size, size)


# ---------------------------------------------------------------------------------------------
# Models: name -> () -> (model, args, kwargs, config summary)
# ---------------------------------------------------------------------------------------------

def _text_encoder(cls_name, cfg_name, summary_extra="", pad_id=0, **cfg_kw):
    def build():
        import transformers as t
        base = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=128, max_position_embeddings=64)
        base.update(cfg_kw)
        cfg = getattr(t, cfg_name)(**base)
        model = getattr(t, cls_name)(cfg).eval()
        ids, mask = _padded_text(pad_id=getattr(cfg, "pad_token_id", None) or pad_id)
        return model, (), {"input_ids": ids, "attention_mask": mask}, \
            f"2L h64 4 heads, seq {SEQ} b{BATCH}, padded mask{summary_extra}"
    return build


def _decoder(cls_name, cfg_name, summary_extra="", **cfg_kw):
    def build():
        import transformers as t
        base = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=128, max_position_embeddings=64, use_cache=False)
        base.update(cfg_kw)
        cfg = getattr(t, cfg_name)(**base)
        model = getattr(t, cls_name)(cfg).eval()
        ids, mask = _padded_text(pad_id=0)
        return model, (), {"input_ids": ids, "attention_mask": mask}, \
            f"2L h64, seq {SEQ} b{BATCH}, padded mask{summary_extra}"
    return build


class PrefillDecode:
    """Built lazily (torch imported in the child only): prefill with use_cache=True, then one
    decode step on the DynamicCache it returned, in one forward (the cache's cat, the step's
    position from the cache length, a one-query causal mask over the padded prefix)."""

    @staticmethod
    def make(model):
        import torch

        class _PrefillDecode(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, input_ids, next_ids, attention_mask=None):
                seq = input_ids.shape[1]
                first = self.inner(input_ids=input_ids, use_cache=True,
                                   attention_mask=None if attention_mask is None else attention_mask[:, :seq])
                cache = first.past_key_values
                step = self.inner(input_ids=next_ids, attention_mask=attention_mask, past_key_values=cache,
                                  use_cache=True)
                kv = tuple(t for layer in cache.layers for t in (layer.keys, layer.values))
                return first.last_hidden_state, step.last_hidden_state, kv

        return _PrefillDecode(model).eval()


def _decode(cls_name, cfg_name, summary_extra="", masked=True, **cfg_kw):
    def build():
        import torch
        import transformers as t
        base = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=128, max_position_embeddings=64)
        base.update(cfg_kw)
        cfg = getattr(t, cfg_name)(**base)
        model = PrefillDecode.make(getattr(t, cls_name)(cfg).eval())
        ids, mask = _padded_text(pad_id=0)
        # the padded row's prefix is padded at its end: the decode step's mask is [.., 0 0 0 0, 1]
        full = torch.cat([mask, torch.ones(BATCH, 1, dtype=mask.dtype)], dim=1)
        if not masked:  # one unpadded prompt, no mask (generate() on a single prompt)
            return model, (ids[:1], _ids(seq=1)[:1]), {}, \
                f"prefill seq {SEQ} + 1 decode step (DynamicCache), 2L h64, b1, no mask{summary_extra}"
        return model, (ids, _ids(seq=1), full), {}, \
            f"prefill seq {SEQ} + 1 decode step (DynamicCache), 2L h64, b{BATCH}, padded mask{summary_extra}"
    return build


def _left_padded(builder):
    """The builder's inputs with the padding at the start of the padded row (batched generation)."""
    def build():
        model, args, kwargs, summary = builder()
        mask = kwargs["attention_mask"]
        pad = int((mask[-1] == 0).sum())
        kwargs = dict(kwargs, attention_mask=mask.flip(1), input_ids=kwargs["input_ids"].flip(1))
        return model, args, kwargs, summary.replace("padded mask", f"LEFT-padded mask ({pad} pads)")
    return build


def _no_mask(builder, batch=1):
    """The builder's model on unpadded token ids and no attention_mask (a single prompt)."""
    def build():
        model, args, kwargs, summary = builder()
        ids = kwargs["input_ids"][:batch]
        return model, args, {"input_ids": ids}, summary.replace(f"b{BATCH}, padded mask", f"b{batch}, no mask")
    return build


def _bf16(builder):
    def build():
        import torch
        model, args, kwargs, summary = builder()
        return model.to(torch.bfloat16), args, kwargs, summary + ", bfloat16 weights"
    return build


def opt():
    import transformers as t
    cfg = t.OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                      num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64,
                      use_cache=False)
    ids, mask = _padded_text(pad_id=1)
    return t.OPTModel(cfg).eval(), (), {"input_ids": ids, "attention_mask": mask}, \
        f"2L h64 ffn128, seq {SEQ} b{BATCH}, padded mask"


def gpt_neo():
    import transformers as t
    cfg = t.GPTNeoConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, attention_types=[[["global", "local"], 1]],
                         num_heads=4, intermediate_size=128, max_position_embeddings=64, window_size=8,
                         use_cache=False)
    ids, mask = _padded_text()
    return t.GPTNeoModel(cfg).eval(), (), {"input_ids": ids, "attention_mask": mask}, \
        f"2L h64 global+local(window 8), seq {SEQ} b{BATCH}, padded mask"


def bloom():
    import transformers as t
    cfg = t.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, use_cache=False)
    ids, mask = _padded_text()
    return t.BloomModel(cfg).eval(), (), {"input_ids": ids, "attention_mask": mask}, \
        f"2L h64 ALiBi, seq {SEQ} b{BATCH}, padded mask"


def falcon():
    import transformers as t
    cfg = t.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         use_cache=False, new_decoder_architecture=False, multi_query=True,
                         parallel_attn=True, alibi=False)
    ids, mask = _padded_text()
    return t.FalconModel(cfg).eval(), (), {"input_ids": ids, "attention_mask": mask}, \
        f"2L h64 MQA parallel-attn rotary, seq {SEQ} b{BATCH}, padded mask"


def gpt_neox():
    import transformers as t
    cfg = t.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=128, max_position_embeddings=64, rotary_pct=0.25,
                          use_cache=False)
    ids, mask = _padded_text()
    return t.GPTNeoXModel(cfg).eval(), (), {"input_ids": ids, "attention_mask": mask}, \
        f"2L h64 partial rotary 0.25, seq {SEQ} b{BATCH}, padded mask"


def gpt_bigcode():
    import transformers as t
    cfg = t.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                             multi_query=True, use_cache=False)
    ids, mask = _padded_text()
    return t.GPTBigCodeModel(cfg).eval(), (), {"input_ids": ids, "attention_mask": mask}, \
        f"2L h64 MQA, seq {SEQ} b{BATCH}, padded mask"


def bart(attn=None):
    import transformers as t
    cfg = t.BartConfig(**({"attn_implementation": attn} if attn else {}),vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                       decoder_ffn_dim=128, max_position_embeddings=64, use_cache=False)
    ids, mask = _padded_text(pad_id=cfg.pad_token_id)
    dec = _ids(seq=8)
    return t.BartModel(cfg).eval(), (), {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}, \
        f"2+2L d64, enc seq {SEQ} (padded mask), dec seq 8, b{BATCH}" + (f", {attn} attention" if attn else "")


def whisper_encoder():
    import transformers as t
    cfg = t.WhisperConfig(vocab_size=VOCAB, num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                          decoder_ffn_dim=128, max_source_positions=32, max_target_positions=32, use_cache=False,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=3)
    import torch
    enc = t.WhisperModel(cfg).get_encoder().eval()
    return enc, (torch.randn(BATCH, 80, 64),), {}, f"encoder 2L d64, 80 mels x 64 frames, b{BATCH}"


def whisper():
    import transformers as t
    import torch
    cfg = t.WhisperConfig(vocab_size=VOCAB, num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                          decoder_ffn_dim=128, max_source_positions=32, max_target_positions=32, use_cache=False,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=3)
    return t.WhisperModel(cfg).eval(), (), {"input_features": torch.randn(BATCH, 80, 64),
                                           "decoder_input_ids": _ids(seq=8)}, \
        f"2+2L d64, 80 mels x 64 frames, dec seq 8, b{BATCH}"


def wav2vec2():
    import transformers as t
    import torch
    cfg = t.Wav2Vec2Config(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, conv_dim=(32, 32, 32), conv_stride=(5, 2, 2),
                           conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
    return t.Wav2Vec2Model(cfg).eval(), (torch.randn(BATCH, 1600),), {}, \
        f"2L h64, conv 32x3 (group norm), raw audio 1600, b{BATCH}"


def hubert():
    import transformers as t
    import torch
    cfg = t.HubertConfig(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128, conv_dim=(32, 32, 32), conv_stride=(5, 2, 2),
                         conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                         feat_extract_norm="layer", do_stable_layer_norm=True)
    return t.HubertModel(cfg).eval(), (torch.randn(BATCH, 1600),), {}, \
        f"2L h64, conv 32x3 (layer norm, stable LN), raw audio 1600, b{BATCH}"


def _vit_like(cls_name, cfg_name, summary_extra="", image=32, **cfg_kw):
    def build():
        import transformers as t
        base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                    image_size=image, patch_size=8)
        base.update(cfg_kw)
        cfg = getattr(t, cfg_name)(**base)
        return getattr(t, cls_name)(cfg).eval(), (_image(image),), {}, \
            f"2L h64 patch 8, {image}x{image} b{BATCH}{summary_extra}"
    return build


def _vision(cls_name, cfg_name, image, summary, reinit=True, **cfg_kw):
    """A vision model from its config, fed one batch of image x image pictures; conv models get
    PyTorch's default init (_reinit)."""
    def build():
        import transformers as t
        model = getattr(t, cls_name)(getattr(t, cfg_name)(**cfg_kw))
        return (_reinit(model) if reinit else model).eval(), (_image(image),), {}, f"{summary}, {image}x{image} b{BATCH}"
    return build


def clip_vision():
    import transformers as t
    cfg = t.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             image_size=32, patch_size=8, projection_dim=32)
    return t.CLIPVisionModel(cfg).eval(), (_image(32),), {}, f"2L h64 patch 8, quick_gelu, 32x32 b{BATCH}"


def clip_text():
    import transformers as t
    cfg = t.CLIPTextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=64, projection_dim=32)
    ids, mask = _padded_text()
    return t.CLIPTextModel(cfg).eval(), (), {"input_ids": ids, "attention_mask": mask}, \
        f"2L h64 causal, seq {SEQ} b{BATCH}, padded mask"


def squeezebert():
    import transformers as t
    cfg = t.SqueezeBertConfig(vocab_size=VOCAB, hidden_size=64, embedding_size=64, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=128, max_position_embeddings=64,
                              q_groups=2, k_groups=2, v_groups=2, post_attention_groups=2,
                              intermediate_groups=2, output_groups=2)
    ids, mask = _padded_text()
    return t.SqueezeBertModel(cfg).eval(), (), {"input_ids": ids, "attention_mask": mask}, \
        f"2L h64 grouped conv1d, seq {SEQ} b{BATCH}, padded mask"


def funnel():
    import transformers as t
    cfg = t.FunnelConfig(vocab_size=VOCAB, block_sizes=[1, 1], d_model=64, n_head=4, d_head=16, d_inner=128,
                         num_decoder_layers=1)
    ids, mask = _padded_text()
    return t.FunnelModel(cfg).eval(), (), {"input_ids": ids, "attention_mask": mask}, \
        f"blocks 1-1 + 1 dec, d64, seq {SEQ} b{BATCH}, padded mask"


def ast_audio():
    import transformers as t
    import torch
    cfg = t.ASTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                      patch_size=16, frequency_stride=10, time_stride=10, max_length=64, num_mel_bins=32)
    return t.ASTModel(cfg).eval(), (torch.randn(BATCH, 64, 32),), {}, f"2L h64, 64 frames x 32 mels b{BATCH}"


def wav2vec2_base_conv():
    import transformers as t
    import torch
    cfg = t.Wav2Vec2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                           num_conv_pos_embeddings=32, num_conv_pos_embedding_groups=8)
    return t.Wav2Vec2Model(cfg).eval(), (torch.randn(BATCH, 8000),), {}, \
        f"base feature encoder (7 convs x 512), 2L h128, 0.5 s audio b{BATCH}"


def bert_like_medium(cls_name, cfg_name, **kw):
    def build():
        import transformers as t
        cfg = getattr(t, cfg_name)(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=1024, max_position_embeddings=256, **kw)
        model = getattr(t, cls_name)(cfg).eval()
        ids, mask = _padded_text(seq=128, pad=32, pad_id=getattr(cfg, "pad_token_id", None) or 0)
        return model, (), {"input_ids": ids, "attention_mask": mask}, f"2L h256, seq 128 b{BATCH}, 32 pads"
    return build


MODELS = {
    "RoBERTa": _text_encoder("RobertaModel", "RobertaConfig", pad_id=1),
    "XLM-RoBERTa": _text_encoder("XLMRobertaModel", "XLMRobertaConfig", pad_id=1),
    "ALBERT": _text_encoder("AlbertModel", "AlbertConfig", embedding_size=32, summary_extra=", emb 32 shared layers"),
    "ELECTRA": _text_encoder("ElectraModel", "ElectraConfig", embedding_size=32, summary_extra=", emb 32"),
    "DeBERTa-v2": _text_encoder("DebertaV2Model", "DebertaV2Config", relative_attention=True,
                                position_buckets=32, max_relative_positions=64, pos_att_type=["p2c", "c2p"],
                                summary_extra=", rel-pos c2p+p2c"),
    "MPNet": _text_encoder("MPNetModel", "MPNetConfig", pad_id=1, summary_extra=", rel-pos buckets"),
    "RoFormer": _text_encoder("RoFormerModel", "RoFormerConfig", embedding_size=64, summary_extra=", rotary"),
    "SqueezeBERT": squeezebert,
    "Funnel": funnel,
    "BART": bart,
    "Whisper encoder": whisper_encoder,
    "Whisper enc-dec": whisper,
    "Wav2Vec2": wav2vec2,
    "HuBERT": hubert,
    "AST": ast_audio,
    "Swin": _vision("SwinModel", "SwinConfig", 32, "depths 2-2, dim 32, window 4", reinit=False, image_size=32,
                    patch_size=2, embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=4),
    "Swinv2": _vision("Swinv2Model", "Swinv2Config", 32, "depths 2-2, dim 32, window 4", reinit=False, image_size=32,
                      patch_size=2, embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=4),
    "DeiT": _vit_like("DeiTModel", "DeiTConfig"),
    "BEiT": _vit_like("BeitModel", "BeitConfig", use_relative_position_bias=True, use_mean_pooling=True,
                      summary_extra=", rel-pos bias, layer scale"),
    "DINOv2": _vit_like("Dinov2Model", "Dinov2Config", mlp_ratio=2, summary_extra=", layer scale, pos interp"),
    "CLIP vision": clip_vision,
    "CLIP text": clip_text,
    "SegFormer": _vision("SegformerModel", "SegformerConfig", 64, "2 blocks 16-32, sr 4-2", num_encoder_blocks=2,
                         depths=[1, 1], sr_ratios=[4, 2], hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
                         num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=32),
    "RegNet": _vision("RegNetModel", "RegNetConfig", 32, "Y, 16-32-48, group width 8, SE", embedding_size=16,
                      hidden_sizes=[16, 32, 48], depths=[1, 1, 1], groups_width=8, layer_type="y"),
    "EfficientNet": _vision("EfficientNetModel", "EfficientNetConfig", 64, "width 0.25 depth 0.3, SE+swish", image_size=64,
                            width_coefficient=0.25, depth_coefficient=0.3, hidden_dim=320),
    "MobileViT": _vision("MobileViTModel", "MobileViTConfig", 64, "xx-small-ish", image_size=64, hidden_sizes=[32, 40, 48],
                         neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64], expand_ratio=2.0),
    "LeViT": _vision("LevitModel", "LevitConfig", 64, "32-48-64, depths 1-1-1", image_size=64, hidden_sizes=[32, 48, 64],
                     num_attention_heads=[2, 3, 4], depths=[1, 1, 1], key_dim=[16, 16, 16]),
    "ConvNeXt-V2": _vision("ConvNextV2Model", "ConvNextV2Config", 32, "GRN, depths 1-1, 16-32", reinit=False,
                           depths=[1, 1], hidden_sizes=[16, 32], num_stages=2, image_size=32),
    "MobileNetV1": _vision("MobileNetV1Model", "MobileNetV1Config", 32, "depth 0.25, TF padding", image_size=32,
                           depth_multiplier=0.25),
    "BiT": _vision("BitModel", "BitConfig", 32, "weight-std conv, SAME pad, group norm 4, 16-32", embedding_size=16,
                   hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck", global_padding="SAME", num_groups=4),
    "Mistral": _decoder("MistralModel", "MistralConfig", num_key_value_heads=2, sliding_window=8,
                        summary_extra=", GQA 4/2, sliding window 8"),
    "Qwen2": _decoder("Qwen2Model", "Qwen2Config", num_key_value_heads=2, summary_extra=", GQA 4/2, qkv bias"),
    "Qwen3": _decoder("Qwen3Model", "Qwen3Config", num_key_value_heads=2, head_dim=16,
                      summary_extra=", GQA 4/2, q/k RMSNorm"),
    "Gemma2": _decoder("Gemma2Model", "Gemma2Config", num_key_value_heads=2, head_dim=16, sliding_window=8,
                       summary_extra=", softcap, sliding window 8"),
    "Phi": _decoder("PhiModel", "PhiConfig", partial_rotary_factor=0.5, summary_extra=", partial rotary, parallel"),
    "Phi3": _decoder("Phi3Model", "Phi3Config", num_key_value_heads=2, pad_token_id=0,
                     summary_extra=", fused qkv / gate_up"),
    "Falcon": falcon,
    "OPT": opt,
    "GPT-Neo": gpt_neo,
    "GPT-NeoX": gpt_neox,
    "GPTBigCode": gpt_bigcode,
    "Bloom": bloom,
    # variants of the families above: other attention code paths, padding side, KV cache, dtype
    "RoBERTa eager-attn": _text_encoder("RobertaModel", "RobertaConfig", pad_id=1, attn_implementation="eager",
                                        summary_extra=", eager attention"),
    "DeiT eager-attn": _vit_like("DeiTModel", "DeiTConfig", attn_implementation="eager",
                                 summary_extra=", eager attention"),
    "BART eager-attn": lambda: bart("eager"),
    "Mistral eager-attn": _decoder("MistralModel", "MistralConfig", num_key_value_heads=2, sliding_window=8,
                                   attn_implementation="eager", summary_extra=", GQA 4/2, sliding window 8, eager attention"),
    "Qwen2 left-pad": _left_padded(_decoder("Qwen2Model", "Qwen2Config", num_key_value_heads=2,
                                            summary_extra=", GQA 4/2")),
    "Mistral left-pad eager-attn": _left_padded(_decoder("MistralModel", "MistralConfig", num_key_value_heads=2,
                                                         sliding_window=8, attn_implementation="eager",
                                                         summary_extra=", sliding window 8, eager attention")),
    "Bloom left-pad": _left_padded(bloom),
    "GPT-Neo left-pad": _left_padded(gpt_neo),
    "Qwen2 KV-cache decode": _decode("Qwen2Model", "Qwen2Config", num_key_value_heads=2),
    "Mistral KV-cache decode": _decode("MistralModel", "MistralConfig", num_key_value_heads=2, sliding_window=8,
                                       summary_extra=", sliding window 8"),
    "Gemma2 KV-cache decode": _decode("Gemma2Model", "Gemma2Config", num_key_value_heads=2, head_dim=16,
                                      sliding_window=8, summary_extra=", softcap, sliding window 8"),
    "Qwen2 no-mask b1": _no_mask(_decoder("Qwen2Model", "Qwen2Config", num_key_value_heads=2,
                                          summary_extra=", GQA 4/2")),
    "Mistral no-mask b1": _no_mask(_decoder("MistralModel", "MistralConfig", num_key_value_heads=2, sliding_window=8,
                                            summary_extra=", GQA 4/2, sliding window 8")),
    "Qwen2 KV-cache decode no-mask b1": _decode("Qwen2Model", "Qwen2Config", num_key_value_heads=2, masked=False,
                                                summary_extra=", GQA 4/2"),
    # medium sizes: the runtime's other kernels (Winograd >= 64 channels, depthwise 5x5, wide convolutions, longer GEMMs)
    "RegNet medium": _vision("RegNetModel", "RegNetConfig", 96, "RegNetY-400MF widths", embedding_size=32,
                             hidden_sizes=[48, 104, 208, 440], depths=[1, 3, 6, 6], groups_width=8, layer_type="y"),
    "EfficientNet-B0 medium": _vision("EfficientNetModel", "EfficientNetConfig", 96, "B0 widths/depths", image_size=96,
                                      width_coefficient=1.0, depth_coefficient=1.0, hidden_dim=1280),
    "MobileViT-S medium": _vision("MobileViTModel", "MobileViTConfig", 128, "MobileViT-S defaults", image_size=128),
    "Wav2Vec2 medium": wav2vec2_base_conv,
    "Swin-T medium": _vision("SwinModel", "SwinConfig", 112, "Swin-T widths, depths 2-2-2, window 7", reinit=False,
                             image_size=112, patch_size=4, embed_dim=96, depths=[2, 2, 2], num_heads=[3, 6, 12], window_size=7),
    "DeBERTa-v2 medium": bert_like_medium("DebertaV2Model", "DebertaV2Config", relative_attention=True,
                                          position_buckets=64, max_relative_positions=128, pos_att_type=["p2c", "c2p"]),
    "Mistral medium": bert_like_medium("MistralModel", "MistralConfig", num_key_value_heads=2, sliding_window=64,
                                       use_cache=False),
    "Qwen2 bf16": _bf16(_decoder("Qwen2Model", "Qwen2Config", num_key_value_heads=2, summary_extra=", GQA 4/2")),
}


def other_shape(args, kwargs):
    """The inputs at another shape (batch + 1; token sequences + 8; raw audio + 400 samples; images,
    mel spectrograms: batch only, since their models fix the size): called after the first shape,
    dynamo recompiles with symbolic sizes, which is blade's run-time-size path."""
    import torch

    def change(key, x):
        if not isinstance(x, torch.Tensor):
            return x
        b = x.shape[0] + 1
        if x.dim() == 2 and not x.is_floating_point():  # token ids / masks (a decode step's one token stays one)
            seq = x.shape[1] + 8 if x.shape[1] > 1 else 1
            if key == "attention_mask" or (not key and bool(((x == 0) | (x == 1)).all())):
                return _mask(batch=b, seq=seq)
            low, high = 5, int(x.max()) + 1
            return torch.randint(low, max(high, low + 1), (b, seq))
        if x.dim() == 2:  # raw audio
            return torch.randn(b, x.shape[1] + 400)
        return torch.randn(b, *x.shape[1:], dtype=x.dtype)

    new_kwargs = {k: change(k, v) for k, v in kwargs.items()}
    if "attention_mask" in new_kwargs and "input_ids" in new_kwargs:  # padding positions hold the pad id
        pad = kwargs["input_ids"][kwargs["attention_mask"] == 0]
        if pad.numel():
            new_kwargs["input_ids"] = new_kwargs["input_ids"].masked_fill(new_kwargs["attention_mask"] == 0, int(pad[0]))
    return tuple(change("", a) for a in args), new_kwargs


def _shape_summary(args, kwargs):
    import torch
    items = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
    items += [f"{k} {tuple(v.shape)}" for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    return ", ".join(map(str, items))


# ---------------------------------------------------------------------------------------------
# One model (in a child process)
# ---------------------------------------------------------------------------------------------

def _leaves(out, path="out"):
    """(path, value) of every tensor leaf of tuples / lists / dicts / ModelOutput."""
    import torch
    if isinstance(out, torch.Tensor):
        yield path, out
    elif isinstance(out, dict):  # ModelOutput is an OrderedDict
        for k, v in out.items():
            yield from _leaves(v, f"{path}.{k}")
    elif isinstance(out, (list, tuple)):
        for i, v in enumerate(out):
            yield from _leaves(v, f"{path}[{i}]")
    elif hasattr(out, "to_tuple"):
        yield from _leaves(out.to_tuple(), path)


def compare(got, expected) -> dict:
    """Max relative error over floating leaves; structural mismatches and integer differences."""
    import torch
    want, have = dict(_leaves(expected)), dict(_leaves(got))
    problems, worst, worst_at = [], 0.0, ""
    if list(want) != list(have):
        problems.append(f"output structure differs: eager {list(want)} vs compiled {list(have)}")
    for name, w in want.items():
        g = have.get(name)
        if g is None:
            continue
        if g.shape != w.shape or g.dtype != w.dtype:
            problems.append(f"{name}: eager {tuple(w.shape)} {w.dtype} vs compiled {tuple(g.shape)} {g.dtype}")
            continue
        if w.is_floating_point():
            wd, gd = w.double(), g.double()
            nan_w, nan_g = torch.isnan(wd), torch.isnan(gd)
            if not torch.equal(nan_w, nan_g):
                problems.append(f"{name}: NaN at {int(nan_w.sum())} places in eager, {int(nan_g.sum())} compiled")
                worst, worst_at = float("inf"), name
                continue
            fin = ~nan_w
            if not fin.any():
                continue
            scale = max(wd[fin].abs().max().item(), 1e-6)
            err = (gd[fin] - wd[fin]).abs().max().item() / scale
            if err != err:  # inf - inf
                err = float("inf")
            if err > worst:
                worst, worst_at = err, name
            if err > _tolerance(w):
                problems.append(f"{name}: rel err {err:.2e} > {_tolerance(w):g}")
        elif not torch.equal(g, w):
            problems.append(f"{name}: {w.dtype} values differ ({int((g != w).sum())} elements)")
    return {"rel_err": worst, "rel_err_at": worst_at, "problems": problems}


def _reason(text: str) -> str:
    """A left-out reason with TorchScript value names and cluster numbers blanked, so that equal
    reasons group."""
    import re
    return re.sub(r"cluster_\d+", "cluster_k", re.sub(r"%[\w.]+", "%v", text))


def _tolerance(t) -> float:
    """float32 / float64: REL_TOL; half precision: 1e-2 (bfloat16's epsilon is 7.8e-3, and a value
    computed in float32 by an engine then rounded may land one bf16 step from eager's)."""
    import torch
    return 1e-2 if t.dtype in (torch.bfloat16, torch.float16) else REL_TOL


def _short(err: BaseException) -> str:
    text = str(err).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(err).__name__}: {first[:300]}"


def run_one(name: str) -> dict:
    import logging
    import statistics
    import warnings

    import torch
    torch.set_num_threads(1)
    import blade  # noqa: F401  (registers tt_infer)
    from blade.dynamo import tt_infer

    row = {"name": name, "status": "?", "warnings": [], "problems": []}

    class Collect(logging.Handler):
        def emit(self, record):
            row["warnings"].append(f"[log {record.levelname}] {record.getMessage()[:400]}")
    handler = Collect(level=logging.WARNING)
    logging.getLogger("blade").addHandler(handler)

    torch.manual_seed(0)
    model, args, kwargs, summary = MODELS[name]()
    row["config"] = summary
    row["params"] = sum(p.numel() for p in model.parameters())

    compiled_graphs = []  # what tt_infer returned per graph: an engine module, a per-shape compile, or eager

    def recording_backend(gm, example_inputs):
        compiled = tt_infer(gm, example_inputs)
        compiled_graphs.append(compiled)
        return compiled

    def graph_reports(start=0):
        """(reports, graphs run eagerly, per-shape reasons) of the graphs compiled since `start`.
        A graph compiled per input shape (blade/specialize.py ShapeSpecialized) reports each shape
        compiled so far."""
        found, eager, per_shape = [], 0, []
        for c in compiled_graphs[start:]:
            if getattr(c, "report", None) is not None:
                found.append(c.report)
            elif hasattr(c, "variants"):
                per_shape.append(c.reason)
                for v in c.variants.values():
                    if getattr(v, "report", None) is not None:
                        found.append(v.report)
                    else:
                        eager += 1
            else:
                eager += 1
        return found, eager, per_shape

    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            expected = model(*args, **kwargs)
        except Exception as err:  # the model itself (config) is broken: not blade's fault
            row["status"] = "SKIP"
            row["error"] = "eager: " + _short(err)
            return row
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=recording_backend)
        try:
            t0 = time.perf_counter()
            first = compiled(*args, **kwargs)
            row["compile_s"] = time.perf_counter() - t0
            second = compiled(*args, **kwargs)
        except Exception as err:
            row["status"] = "CRASH"
            row["error"] = _short(err)
            import traceback
            row["traceback"] = traceback.format_exc()[-3000:]
        row["warnings"] += [f"{w.category.__name__}: {str(w.message)[:600]}" for w in caught
                            if "blade" in str(w.message).lower() or "blade" in w.filename]
    logging.getLogger("blade").removeHandler(handler)

    real, row["graphs_eager"], row["per_shape"] = graph_reports()
    row["graphs"] = len(compiled_graphs)
    row["aten_total"] = sum(r.aten_total for r in real)
    row["aten_in_engines"] = sum(r.aten_in_engines for r in real)
    row["engines"] = sum(r.engine_calls for r in real)
    row["clusters_failed"] = [f"{c.name} {c.status}: {(c.error or '').splitlines()[0][:300] if c.error else ''}"
                              f" ops {','.join(k.replace('aten::', '') for k in c.op_kinds)}"
                              for r in real for c in r.clusters if c.status != "compiled"]
    left = Counter()
    where = {}
    for r in real:
        for n in r.left_out_nodes:
            key = (n.kind, _reason(n.reason))
            left[key] += 1
            where.setdefault(key, n.source)
    row["left_out"] = [[k, reason, count, where[(k, reason)]] for (k, reason), count in left.most_common()]
    row["symbolic"] = [r.size_symbols for r in real if r.size_symbols]
    if row["status"] == "CRASH":
        return row
    row["eager_max"] = max((v.abs().max().item() for _, v in _leaves(expected) if v.is_floating_point()
                            and v.numel()), default=0.0)
    if row["eager_max"] < 1e-3:
        row["problems"].append(f"degenerate eager output: max |eager| {row['eager_max']:.1e} (the check is weak)")

    c1, c2 = compare(first, expected), compare(second, expected)
    row["rel_err"] = max(c1["rel_err"], c2["rel_err"])
    row["rel_err_at"] = c1["rel_err_at"] if c1["rel_err"] >= c2["rel_err"] else c2["rel_err_at"]
    row["problems"] += c1["problems"] + [p + " (2nd call)" for p in c2["problems"] if p not in c1["problems"]]
    real_problems = [p for p in row["problems"] if not p.startswith("degenerate")]
    row["status"] = "WRONG" if real_problems or row["rel_err"] != row["rel_err"] else "ok"

    # timing: eager and compiled calls interleaved, one thread
    eager_t, comp_t = [], []
    with torch.no_grad():
        for _ in range(WARMUP_CALLS):
            model(*args, **kwargs)
            compiled(*args, **kwargs)
        for _ in range(TIMED_CALLS):
            t0 = time.perf_counter()
            model(*args, **kwargs)
            t1 = time.perf_counter()
            compiled(*args, **kwargs)
            t2 = time.perf_counter()
            eager_t.append(t1 - t0)
            comp_t.append(t2 - t1)
    row["eager_ms"] = 1e3 * statistics.median(eager_t)
    row["tt_ms"] = 1e3 * statistics.median(comp_t)
    row["ratio"] = row["eager_ms"] / row["tt_ms"]   # > 1: tt_infer faster

    # another shape: dynamo recompiles with symbolic sizes (blade/dynamic.py), then the first shape again
    n_graphs = len(compiled_graphs)
    torch.manual_seed(1)
    args2, kwargs2 = other_shape(args, kwargs)
    row["dyn_inputs"] = _shape_summary(args2, kwargs2)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            expected2 = model(*args2, **kwargs2)
        except Exception as err:  # noqa: BLE001
            expected2 = None
            row["dyn_status"] = "SKIP"
            row["dyn_error"] = "eager: " + _short(err)
        if expected2 is not None:
            try:
                got2 = compiled(*args2, **kwargs2)
                got1 = compiled(*args, **kwargs)
                d2, d1 = compare(got2, expected2), compare(got1, expected)
                row["dyn_rel_err"] = max(d2["rel_err"], d1["rel_err"])
                row["dyn_problems"] = d2["problems"] + [p + " (first shape again)" for p in d1["problems"]]
                row["dyn_status"] = "WRONG" if row["dyn_problems"] or row["dyn_rel_err"] != row["dyn_rel_err"] else "ok"
            except Exception as err:  # noqa: BLE001
                import traceback
                row["dyn_status"] = "CRASH"
                row["dyn_error"] = _short(err)
                row["dyn_traceback"] = traceback.format_exc()[-3000:]
        row["dyn_warnings"] = [f"{w.category.__name__}: {str(w.message)[:600]}" for w in caught
                               if "blade" in str(w.message).lower() or "blade" in w.filename]
    dyn_real, row["dyn_graphs_eager"], row["dyn_per_shape"] = graph_reports(n_graphs)
    row["dyn_graphs"] = len(compiled_graphs) - n_graphs
    row["dyn_aten_total"] = sum(r.aten_total for r in dyn_real)
    row["dyn_aten_in_engines"] = sum(r.aten_in_engines for r in dyn_real)
    row["dyn_symbols"] = [r.size_symbols for r in dyn_real if r.size_symbols and "per shape" not in r.size_symbols]
    row["dyn_refusals"] = [x for r in dyn_real for x in r.symbolic_refusals]
    dleft = Counter()
    for r in dyn_real:
        for n in r.left_out_nodes:
            dleft[(n.kind, _reason(n.reason))] += 1
    row["dyn_left_out"] = [[k, reason, count] for (k, reason), count in dleft.most_common()]

    # dynamo's graph breaks (its own capture, no blade)
    try:
        torch._dynamo.reset()
        with torch.no_grad():
            view = torch._dynamo.explain(model)(*args, **kwargs)
        row["breaks"] = [str(b.reason)[:300] for b in view.break_reasons]
    except Exception as err:  # noqa: BLE001
        row["breaks"] = [f"(dynamo explain failed: {_short(err)})"]
    return row


def child_main(name: str, out_path: str) -> None:
    row = run_one(name)
    Path(out_path).write_text(json.dumps(row, default=str))


# ---------------------------------------------------------------------------------------------
# The sweep (parent)
# ---------------------------------------------------------------------------------------------

def run_isolated(name: str) -> dict:
    env = dict(os.environ, COMPILE_PARALLELISM="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               BLADE_PROGRESS="0")
    with tempfile.TemporaryDirectory(prefix="blade-families-") as tmp:
        out = Path(tmp) / "row.json"
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", name, str(out)], env=env, cwd=ROOT,
                                  capture_output=True, text=True, timeout=MODEL_TIMEOUT_S)
        except subprocess.TimeoutExpired as err:
            return {"name": name, "status": "CRASH", "error": f"timeout after {MODEL_TIMEOUT_S} s",
                    "stderr_tail": (err.stderr or "")[-2000:] if isinstance(err.stderr, str) else ""}
        wall = time.perf_counter() - start
        if out.exists():
            row = json.loads(out.read_text())
        else:
            rc = proc.returncode
            how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
            row = {"name": name, "status": "CRASH", "error": f"process {how}"}
        row["wall_s"] = wall
        row["stderr_tail"] = "\n".join(line for line in proc.stderr.splitlines()
                                       if "blade" in line.lower() or "error" in line.lower())[-3000:]
        return row


def _fmt_err(x):
    if x is None:
        return "-"
    return "inf" if x == float("inf") else f"{x:.1e}"


def _kind(k):
    return k.replace("aten::", "").replace("prim::", "prim.")


def blade_version() -> str:
    """Where blade is imported from, and its git commit when that is a checkout (dirty: uncommitted
    changes under blade/ or cpp/); BLADE_SNAPSHOT_COMMIT names the commit of an exported copy."""
    import importlib.util
    spec = importlib.util.find_spec("blade")
    where = Path(spec.origin).parent.parent if spec and spec.origin else None
    if os.environ.get("BLADE_SNAPSHOT_COMMIT"):
        return f"blade {os.environ['BLADE_SNAPSHOT_COMMIT']} (exported copy at {where})"
    try:
        commit = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--", "blade", "cpp"],
                               capture_output=True, text=True).stdout.strip()
        return f"blade {commit}{' + uncommitted changes' if dirty else ''} ({where})"
    except Exception:  # noqa: BLE001
        return f"blade from {where}"


def render(rows: list) -> str:
    import torch
    import transformers
    lines = ["# tt_infer on untuned transformers families", "",
             f"`bench/families.py`: {blade_version()}; torch {torch.__version__}, transformers {transformers.__version__}; "
             f"random weights (seed 0), eval, torch.no_grad; one torch thread, COMPILE_PARALLELISM=1, one model "
             f"at a time, each in its own process. Status: ok / WRONG (max |diff| / max |eager| over every "
             f"floating output > {REL_TOL:g}, 1e-2 for bfloat16 outputs, or a structure/integer difference) / CRASH (exception or dead "
             f"process). Coverage: aten ops inside engines / aten ops of all graphs tt_infer compiled. "
             f"Timing: median of {TIMED_CALLS} calls after {WARMUP_CALLS} warm-up, eager and tt_infer interleaved; "
             f"ratio = eager / tt_infer (< 1: tt_infer slower, **bold**). Rough: the machine is shared. "
             f"Other shape: then the compiled model is called at another input shape (batch + 1, token sequences + 8, "
             f"raw audio + 400 samples; images and spectrograms batch only), where dynamo recompiles with symbolic "
             f"sizes (blade's run-time-size path), and at the first shape again; both compared with eager "
             f"(status, max rel err, coverage of the new graph).", "",
             "| model | config | status | max rel err | coverage | graphs (breaks) | aten ops left in TorchScript (kind x count) | eager ms | tt_infer ms | ratio | other shape |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cov = (f"{100 * r['aten_in_engines'] / r['aten_total']:.0f}% ({r['aten_in_engines']}/{r['aten_total']})"
               if r.get("aten_total") else "-")
        kinds = Counter()
        for k, reason, count, _ in r.get("left_out", []):
            if not k.startswith("prim::"):  # output tuples and other glue: listed per model below
                kinds[_kind(k)] += count
        left = ", ".join(f"{k} x{c}" for k, c in kinds.most_common(8)) + (" ..." if len(kinds) > 8 else "")
        graphs = f"{r.get('graphs', '-')}" + (f" ({len(r['breaks'])})" if r.get("breaks") else "")
        if r.get("graphs_eager"):
            graphs += f", {r['graphs_eager']} eager"
        ratio = r.get("ratio")
        ratio_s = "-" if ratio is None else (f"**{ratio:.2f}**" if ratio < 1 else f"{ratio:.2f}")
        status = r["status"]
        if status != "ok":
            status = f"**{status}**"
        dyn = "-"
        if r.get("dyn_status"):
            dyn_cov = (f"{100 * r['dyn_aten_in_engines'] / r['dyn_aten_total']:.0f}%" if r.get("dyn_aten_total")
                       else "no new graph" if not r.get("dyn_graphs") else "-")
            dyn_s = r["dyn_status"] if r["dyn_status"] == "ok" else f"**{r['dyn_status']}**"
            dyn = f"{dyn_s} {_fmt_err(r.get('dyn_rel_err'))}, {dyn_cov}"
            if r.get("dyn_per_shape"):
                dyn += ", **per-shape compile**"
            if r.get("dyn_graphs_eager"):
                dyn += f", {r['dyn_graphs_eager']} graph(s) eager"
        timing = (f"{r['eager_ms']:.2f} | {r['tt_ms']:.2f} | {ratio_s}" if "eager_ms" in r else "- | - | -")
        lines.append(f"| {r['name']} | {r.get('config', '-')} | {status} | {_fmt_err(r.get('rel_err'))} | {cov} | "
                     f"{graphs} | {left or '-'} | {timing} | {dyn} |")
    # op kinds left out in several models
    across = {}
    for r in rows:
        for k, reason, count, _ in r.get("left_out", []):
            if not k.startswith("prim::"):
                across.setdefault(_kind(k), set()).add(r["name"])
    common = sorted(((k, m) for k, m in across.items() if len(m) >= 2), key=lambda kv: -len(kv[1]))
    if common:
        lines += ["", "## Op kinds left in TorchScript in several models", "",
                  "| kind | models |", "|---|---|"]
        lines += [f"| {k} | {len(m)}: {', '.join(sorted(m))} |" for k, m in common]
    dyn_across = {}
    for r in rows:
        for k, reason, count in r.get("dyn_left_out", []):
            if not k.startswith("prim::"):
                dyn_across.setdefault(_kind(k), set()).add(r["name"])
    dyn_common = sorted(((k, m) for k, m in dyn_across.items() if len(m) >= 2), key=lambda kv: -len(kv[1]))
    if dyn_common:
        lines += ["", "## ... and in the graphs compiled for the other shape (run-time sizes or per shape)", "",
                  "| kind | models |", "|---|---|"]
        lines += [f"| {k} | {len(m)}: {', '.join(sorted(m))} |" for k, m in dyn_common]
    per_shape = [(r["name"], x) for r in rows for x in r.get("dyn_per_shape", [])]
    if per_shape:
        lines += ["", "## Graphs compiled once per input shape after the shape change (no run-time-size compile)", "",
                  "| model | why |", "|---|---|"]
        lines += [f"| {name} | {why.splitlines()[0][:200].replace('|', '/')} |" for name, why in per_shape]
    lines += ["", "## Per model", ""]
    for r in rows:
        lines.append(f"### {r['name']}: {r['status']}")
        lines.append("")
        for key, label in (("config", "config"), ("params", "parameters"), ("error", "error"),
                           ("rel_err_at", "worst output"), ("compile_s", "first call (compile) s"),
                           ("wall_s", "process wall s"), ("engines", "engine calls")):
            if r.get(key) not in (None, "", []):
                value = r[key]
                if isinstance(value, float):
                    value = f"{value:.3g}"
                lines.append(f"- {label}: {value}")
        for p in r.get("problems", []):
            lines.append(f"- problem: {p}")
        for b in r.get("breaks", []):
            lines.append(f"- graph break: {b}")
        for s in r.get("symbolic", []):
            lines.append(f"- size symbols: {s}")
        for c in r.get("clusters_failed", []):
            lines.append(f"- cluster not compiled: {c}")
        for w in dict.fromkeys(r.get("warnings", [])):
            lines.append(f"- warning: {w.splitlines()[0] if w else ''}")
        if r.get("left_out"):
            lines.append("- left in TorchScript:")
            for k, reason, count, source in r["left_out"]:
                at = f" (at {source})" if source else ""
                lines.append(f"    - {count} x {k}: {reason}{at}")
        if r.get("dyn_status"):
            lines.append(f"- other shape ({r.get('dyn_inputs', '')}): {r['dyn_status']}, rel err "
                         f"{_fmt_err(r.get('dyn_rel_err'))}, {r.get('dyn_graphs', 0)} new graph(s), coverage "
                         f"{r.get('dyn_aten_in_engines', 0)}/{r.get('dyn_aten_total', 0)} (of the graphs "
                         f"compiled for the new shapes)")
            for key in ("dyn_error",):
                if r.get(key):
                    lines.append(f"    - error: {r[key]}")
            for x in r.get("dyn_problems", []):
                lines.append(f"    - problem: {x}")
            for x in r.get("dyn_per_shape", []):
                lines.append(f"    - compiled per input shape (no run-time-size compile): {x}")
            for x in r.get("dyn_symbols", []):
                lines.append(f"    - size symbols: {x}")
            for x in r.get("dyn_refusals", []):
                lines.append(f"    - run-time sizes refused: {x}")
            for w in dict.fromkeys(r.get("dyn_warnings", [])):
                lines.append(f"    - warning: {w.splitlines()[0] if w else ''}")
            for k, reason, count in r.get("dyn_left_out", []):
                if not k.startswith("prim::"):
                    lines.append(f"    - left in TorchScript: {count} x {k}: {reason}")
        if r.get("traceback"):
            lines += ["", "```", r["traceback"].strip()[-1500:], "```"]
        if r.get("dyn_traceback"):
            lines += ["", "```", r["dyn_traceback"].strip()[-1500:], "```"]
        if r["status"] == "CRASH" and r.get("stderr_tail"):
            lines += ["", "```", r["stderr_tail"].strip()[-1500:], "```"]
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] == "--child":
        child_main(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="comma-separated substrings of model names (case-insensitive)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "FAMILIES.md"))
    parser.add_argument("--json", default="", help="also write the raw rows here")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--render", default="", help="only write --out from rows saved earlier with --json")
    opts = parser.parse_args()
    wanted = [s.strip().lower() for s in opts.models.split(",") if s.strip()]
    names = [n for n in MODELS if not wanted or any(w in n.lower() for w in wanted)]
    if opts.list:
        print("\n".join(names))
        return
    if opts.render:
        Path(opts.out).write_text(render(json.loads(Path(opts.render).read_text())))
        print(f"wrote {opts.out}")
        return
    rows = []
    for name in names:
        row = run_isolated(name)
        rows.append(row)
        cov = f"{100 * row['aten_in_engines'] / row['aten_total']:.0f}%" if row.get("aten_total") else "-"
        print(f"{name:16s} {row['status']:6s} err {_fmt_err(row.get('rel_err'))} cov {cov} "
              f"ratio {row.get('ratio', float('nan')):.2f} | other shape {row.get('dyn_status', '-')} "
              f"err {_fmt_err(row.get('dyn_rel_err'))} | wall {row.get('wall_s', 0):.0f}s "
              f"{row.get('error', '')} {row.get('dyn_error', '')}", flush=True)
        Path(opts.out).write_text(render(rows))
        if opts.json:
            Path(opts.json).write_text(json.dumps(rows, indent=1, default=str))
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
