"""Models outside the sweep, on the CPU: transformers architectures not in ``graphopt.tools.sweep.HF_MODELS``
(tiny configs, random weights, fp32). Per model:

- ``plan``: the passes a GPU plan applies (``sweep.strict_plan`` priced for the H200; a pass that breaks the
  graph raises) and the accuracy rule, as ``sweep.py --plan h200`` does; ``optimize``: ``graphopt.optimize``
  with its defaults, the same rule;
- ``train``: ``optimize(training=True)`` and with ``memory_budget``, one step's output and every parameter
  gradient against a float64 copy by the accuracy rule (eager fp32 the yardstick);
- ``gen``: ``optimize_generation`` greedy tokens against transformers' ``generate()`` (32 steps, batch 2)
  for the decoders.

    python benchmarks/diag/diag_outside_models.py [--only a,b] [--budget 0.6] --out DIR

Writes outside_models_<UTC date>_cpu.md under --out.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from graphopt.tools import sweep  # noqa: E402
from graphopt.tools.sweep import _DECODER, _TEXT, _TOKENS, _VISION, VOCAB, Spec  # noqa: E402

D = dict(_DECODER, head_dim=16, **_TOKENS)
# name -> (config class, base model class, config kwargs, input kind); decoders have a ...ForCausalLM
MODELS = {
    "phi3": ("Phi3Config", "Phi3Model", D, "text"),
    "gemma2": ("Gemma2Config", "Gemma2Model", D, "text"),
    "gemma3": ("Gemma3TextConfig", "Gemma3TextModel", dict(D, sliding_window=8), "text"),
    "qwen3": ("Qwen3Config", "Qwen3Model", D, "text"),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeModel",
                  dict(D, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), "text"),
    "mixtral": ("MixtralConfig", "MixtralModel", dict(D, num_local_experts=4, num_experts_per_tok=2), "text"),
    "falcon": ("FalconConfig", "FalconModel",
               dict(_TEXT, num_kv_heads=2, new_decoder_architecture=True, use_cache=False, **_TOKENS), "text"),
    "falcon-mq": ("FalconConfig", "FalconModel",  # multi-query: one K/V head broadcast over the query heads
                  dict(_TEXT, multi_query=True, new_decoder_architecture=False, use_cache=False, **_TOKENS), "text"),
    "stablelm": ("StableLmConfig", "StableLmModel", D, "text"),
    "starcoder2": ("Starcoder2Config", "Starcoder2Model", dict(D, sliding_window=None), "text"),
    "olmo2": ("Olmo2Config", "Olmo2Model", D, "text"),
    "cohere": ("CohereConfig", "CohereModel", D, "text"),
    "granite": ("GraniteConfig", "GraniteModel", D, "text"),
    "bloom": ("BloomConfig", "BloomModel", dict(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4,
                                                use_cache=False, **_TOKENS), "text"),
    "gptj": ("GPTJConfig", "GPTJModel", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                             n_positions=64, use_cache=False, **_TOKENS), "text"),
    "codegen": ("CodeGenConfig", "CodeGenModel", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                                      n_positions=64, n_ctx=64, use_cache=False, **_TOKENS), "text"),
    "smollm3": ("SmolLM3Config", "SmolLM3Model", D, "text"),
    "glm": ("GlmConfig", "GlmModel", D, "text"),
    "helium": ("HeliumConfig", "HeliumModel", D, "text"),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel", _TEXT, "text_mask"),
    "mpnet": ("MPNetConfig", "MPNetModel", _TEXT, "text_mask"),
    "convbert": ("ConvBertConfig", "ConvBertModel", dict(_TEXT, embedding_size=64), "text_mask"),
    "ernie": ("ErnieConfig", "ErnieModel", _TEXT, "text_mask"),
    "data2vec-text": ("Data2VecTextConfig", "Data2VecTextModel", _TEXT, "text_mask"),
    "beit": ("BeitConfig", "BeitModel", dict(_VISION, use_relative_position_bias=True), "image"),
    "dinov2": ("Dinov2Config", "Dinov2Model", _VISION, "image"),
    "segformer": ("SegformerConfig", "SegformerModel",
                  dict(num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                       num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2]), "image"),
    "mobilevit": ("MobileViTConfig", "MobileViTModel",
                  dict(image_size=32, hidden_sizes=[32, 48, 64], neck_hidden_sizes=[8, 16, 24, 32, 48, 64, 128]), "image"),
    "poolformer": ("PoolFormerConfig", "PoolFormerModel",
                   dict(num_channels=3, depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 48, 64]), "image"),
    "hf-resnet": ("ResNetConfig", "ResNetModel",
                  dict(embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1]), "image"),
    "clip-vision": ("CLIPVisionConfig", "CLIPVisionModel", _VISION, "image"),
    "siglip-vision": ("SiglipVisionConfig", "SiglipVisionModel", _VISION, "image"),
    # added 12-04 (evening)
    "opt": ("OPTConfig", "OPTModel", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                                          num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64,
                                          use_cache=False, **_TOKENS), "text"),
    "gpt-bigcode": ("GPTBigCodeConfig", "GPTBigCodeModel", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                                                n_positions=64, multi_query=True, use_cache=False,
                                                                **_TOKENS), "text"),
    "mpt": ("MptConfig", "MptModel", dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, max_seq_len=64,
                                          use_cache=False, **_TOKENS), "text"),
    "gpt-neo": ("GPTNeoConfig", "GPTNeoModel", dict(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                                                    attention_types=[[["global", "local"], 1]], window_size=8,
                                                    max_position_embeddings=64, use_cache=False, **_TOKENS), "text"),
    "xglm": ("XGLMConfig", "XGLMModel", dict(vocab_size=VOCAB, d_model=64, num_layers=2, attention_heads=4,
                                             ffn_dim=128, max_position_embeddings=64, use_cache=False, **_TOKENS), "text"),
    "biogpt": ("BioGptConfig", "BioGptModel", dict(_TEXT, use_cache=False, **_TOKENS), "text"),
    "persimmon": ("PersimmonConfig", "PersimmonModel", dict(_TEXT, use_cache=False, **_TOKENS), "text"),
    "nemotron": ("NemotronConfig", "NemotronModel", D, "text"),
    "olmo": ("OlmoConfig", "OlmoModel", D, "text"),
    "exaone4": ("Exaone4Config", "Exaone4Model", D, "text"),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5Model", D, "text"),
    "seed-oss": ("SeedOssConfig", "SeedOssModel", D, "text"),
    "apertus": ("ApertusConfig", "ApertusModel", D, "text"),
    "cohere2": ("Cohere2Config", "Cohere2Model", dict(D, sliding_window=8), "text"),
    "gpt-oss": ("GptOssConfig", "GptOssModel", dict(D, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
                "text"),
    "glm4-moe": ("Glm4MoeConfig", "Glm4MoeModel", dict(D, n_routed_experts=4, num_experts_per_tok=2,
                                                       moe_intermediate_size=32, first_k_dense_replace=1,
                                                       n_shared_experts=1, n_group=1, topk_group=1), "text"),
    "lfm2": ("Lfm2Config", "Lfm2Model", dict(D, full_attn_idxs=[1]), "text"),
    "mamba": ("MambaConfig", "MambaModel", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=8,
                                                use_cache=False, **_TOKENS), "text"),
    "roformer": ("RoFormerConfig", "RoFormerModel", _TEXT, "text_mask"),
    "funnel": ("FunnelConfig", "FunnelBaseModel", dict(vocab_size=VOCAB, d_model=64, n_head=4, d_head=16, d_inner=128,
                                                       block_sizes=[1, 1]), "text_mask"),
    "mobilebert": ("MobileBertConfig", "MobileBertModel", dict(_TEXT, embedding_size=32, intra_bottleneck_size=32,
                                                               true_hidden_size=32, num_feedforward_networks=2), "text_mask"),
    "squeezebert": ("SqueezeBertConfig", "SqueezeBertModel", dict(_TEXT, embedding_size=64), "text_mask"),
    "megatron-bert": ("MegatronBertConfig", "MegatronBertModel", _TEXT, "text_mask"),
    "modernbert": ("ModernBertConfig", "ModernBertModel", dict(_TEXT, local_attention=8, global_attn_every_n_layers=2,
                                                               **_TOKENS), "text_mask"),
    "convnextv2": ("ConvNextV2Config", "ConvNextV2Model", dict(num_channels=3, hidden_sizes=[16, 32, 48, 64],
                                                               depths=[1, 1, 1, 1]), "image"),
    "swinv2": ("Swinv2Config", "Swinv2Model", dict(image_size=32, patch_size=2, embed_dim=16, depths=[1, 1],
                                                   num_heads=[1, 2], window_size=4), "image"),
    "regnet": ("RegNetConfig", "RegNetModel", dict(embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1],
                                                   groups_width=8), "image"),
    "bit": ("BitConfig", "BitModel", dict(embedding_size=32, hidden_sizes=[32, 64, 96, 128], depths=[1, 1, 1, 1],
                                          num_groups=8), "image"),
    "focalnet": ("FocalNetConfig", "FocalNetModel", dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                                                         focal_levels=[2, 2], focal_windows=[3, 3]), "image"),
    "mobilenet-v2": ("MobileNetV2Config", "MobileNetV2Model", dict(image_size=32, depth_multiplier=0.35), "image"),
    # speech, sequence-to-sequence and masked vision (12-04 night)
    "whisper-encoder": ("WhisperConfig", "models.whisper.modeling_whisper.WhisperEncoder", dict(num_mel_bins=8, d_model=64, encoder_layers=2,
                                                               encoder_attention_heads=4, encoder_ffn_dim=128,
                                                               max_source_positions=16, **_TOKENS), "mel"),
    "wav2vec2": ("Wav2Vec2Config", "Wav2Vec2Model", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                         intermediate_size=128, conv_dim=(16, 16), conv_stride=(5, 2),
                                                         conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                                         num_conv_pos_embedding_groups=4, mask_time_prob=0.0), "audio"),
    "hubert": ("HubertConfig", "HubertModel", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                   intermediate_size=128, conv_dim=(16, 16), conv_stride=(5, 2),
                                                   conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                                   num_conv_pos_embedding_groups=4, mask_time_prob=0.0), "audio"),
    "ast": ("ASTConfig", "ASTModel", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=128, num_mel_bins=16, max_length=32, patch_size=8,
                                          frequency_stride=8, time_stride=8), "spectrogram"),
    "pegasus": ("PegasusConfig", "PegasusModel", dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                                                      encoder_attention_heads=4, decoder_attention_heads=4,
                                                      encoder_ffn_dim=128, decoder_ffn_dim=128,
                                                      max_position_embeddings=64, use_cache=False, **_TOKENS), "seq2seq"),
    "mbart": ("MBartConfig", "MBartModel", dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                                                encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                                decoder_ffn_dim=128, max_position_embeddings=64, use_cache=False,
                                                **_TOKENS), "seq2seq"),
    "longt5": ("LongT5Config", "LongT5Model", dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                   num_heads=4, local_radius=4, use_cache=False, decoder_start_token_id=0,
                                                   **_TOKENS), "seq2seq"),
    "switch-transformers": ("SwitchTransformersConfig", "SwitchTransformersModel",
                            dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                                 num_heads=4, num_experts=4, encoder_sparse_step=1, decoder_sparse_step=1,
                                 use_cache=False, decoder_start_token_id=0, **_TOKENS), "seq2seq"),
    "vit-mae": ("ViTMAEConfig", "ViTMAEModel", dict(_VISION, mask_ratio=0.5), "image"),
    "yolos": ("YolosConfig", "YolosModel", dict(_VISION, image_size=[32, 32], num_detection_tokens=4), "image"),
}


def _inputs(kind):
    """The example inputs of a ``kind`` (the sweep's, and speech: log-mel frames, raw audio, a spectrogram)."""
    gen = torch.Generator().manual_seed(0)
    if kind == "mel":  # [B, mel bins, 2 * max_source_positions]
        return {"input_features": torch.randn(1, 8, 32, generator=gen)}
    if kind == "audio":
        return {"input_values": torch.randn(1, 400, generator=gen)}
    if kind == "spectrogram":  # [B, time (max_length), mel bins]
        return {"input_values": torch.randn(1, 32, 16, generator=gen)}
    return sweep._hf_inputs(kind, gen)


def _config(name, causal=False):
    import transformers

    cfg_name, model_name, kw, kind = MODELS[name]
    kw = dict(kw)
    if causal:
        kw.pop("use_cache", None)
    cls = getattr(transformers, cfg_name)
    try:
        cfg = cls(**kw, attn_implementation="eager") if not causal else cls(**kw)
    except TypeError:
        cfg = cls(**kw)
    return cfg, model_name, kind


def build(name):
    import transformers

    cfg, model_name, kind = _config(name)
    torch.manual_seed(0)
    cls = transformers
    for part in model_name.split("."):  # a class transformers does not export: its module path
        cls = getattr(cls, part)
    return cls(cfg).eval(), _inputs(kind)


def _step(m, args, kwargs, g=None):
    for p in m.parameters():
        p.grad = None
    out = m(*args, **kwargs)
    if isinstance(out, dict) and not hasattr(out, "to_tuple"):  # a plain dict (torchvision segmentation): all of it
        t = torch.cat([v.reshape(-1) for v in out.values() if torch.is_tensor(v)])
    else:
        t = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    if g is None:
        g = torch.randn(t.shape, generator=torch.Generator().manual_seed(1))
    (t * g.to(t.dtype)).sum().backward()
    return [t.detach()] + [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                           for p in m.parameters()], g


class _PlainFloat64(torch.overrides.TorchFunctionMode):
    """grouped_mm as graphopt's float64 reference runs it (no float64 kernel), and float64 the default
    dtype of the tensors the forward makes and of its casts to the default dtype, as there."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from graphopt import accuracy

        kwargs = kwargs or {}
        made = accuracy.widened_factory(func, args, kwargs, torch.float64)
        if made is None:
            made = accuracy.widened_cast(func, args, kwargs, torch.float64)
        if made is not None:
            return made
        return (accuracy._FLOAT64_PLAIN.get(getattr(func, "__name__", "")) or func)(*args, **kwargs)


def train(name, budget, make=None):
    """The two training cells of ``name`` (``make()``: its (model, inputs); default :func:`build`)."""
    import graphopt
    from graphopt import accuracy
    from graphopt.capture import split_inputs

    out = []
    for opts in ({}, {"memory_budget": budget}):
        try:
            model, inputs = (make or (lambda: build(name)))()
            model.train()
            for mod in model.modules():  # no randomness: dropout and stochastic depth off
                if isinstance(mod, torch.nn.Dropout):
                    mod.p = 0.0
                if hasattr(mod, "drop_prob"):
                    mod.drop_prob = 0.0
                if type(mod).__name__ == "StochasticDepth":  # torchvision's
                    mod.p = 0.0
            args, kwargs = split_inputs(inputs)
            if "pixel_values" in kwargs:  # two images: BatchNorm in training needs more than one value per channel
                kwargs["pixel_values"] = torch.cat([kwargs["pixel_values"]] * 2)
                inputs = kwargs
            eager, g = _step(model, args, kwargs)
            dbl = lambda t: t.double() if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
            with _PlainFloat64():
                ref, _ = _step(copy.deepcopy(model).double(), [dbl(a) for a in args],
                               {k: dbl(v) for k, v in kwargs.items()}, g)
            opt = graphopt.optimize(model, inputs, training=True, **opts)
            ours, _ = _step(opt, args, kwargs, g)
            bad = [i for i, (o, r, e) in enumerate(zip(ours, ref, eager)) if not accuracy.check(o, r, e).passed]
            out.append("pass" if not bad else f"FAIL: {len(bad)} of {len(ours)} tensors (first {bad[0]})")
        except Exception as e:  # noqa: BLE001 - a row, not a crash
            out.append(f"{type(e).__name__}: {str(e).splitlines()[0][:140] if str(e) else ''}")
    return out


def gen(name):
    import transformers

    import graphopt

    if MODELS[name][3] != "text":
        return "—"
    try:
        cfg, model_name, _ = _config(name, causal=True)
        torch.manual_seed(0)
        lm = getattr(transformers, model_name.replace("TextModel", "ForCausalLM").replace("Model", "ForCausalLM"))
        model = lm(cfg).eval()
        ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
        g = graphopt.optimize_generation(model, max_batch_size=2, max_length=48, check_accuracy=False)
        out = g.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None)
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        return "same tokens" if torch.equal(out, ref) else "DIFFERENT tokens"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e).splitlines()[0][:140] if str(e) else ''}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--budget", type=float, default=0.6, help="memory_budget of the second training variant")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(MODELS)
    import transformers

    stamp = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"# Models outside the sweep, on the CPU ({stamp:%Y-%m-%d %H:%M} UTC)", "",
             f"torch {torch.__version__}, transformers {transformers.__version__}; tiny configs, random weights, fp32. "
             "plan: the H200 plan's passes in strict mode + the accuracy rule; optimize: defaults; train: "
             f"training=True, then memory_budget={args.budget}, output and every parameter gradient by the rule "
             "against float64; gen: greedy tokens of optimize_generation against transformers' generate().", "",
             "| model | plan (h200) | optimize | train | train + budget | gen |", "| --- | --- | --- | --- | --- | --- |"]
    for name in names:
        t0 = time.perf_counter()
        cells = plan_cells(name, "outside", lambda n=name: build(n)) + train(name, args.budget) + [gen(name)]
        add_row(lines, name, cells, t0)
    write_table(lines, Path(args.out) / f"outside_models_{stamp:%Y-%m-%d_%H%M%S}_cpu.md")


def plan_cells(name, source, make):
    """The plan (h200, strict) and optimize cells of one model (``make()``: its (model, inputs))."""
    rows = [sweep.run_one(Spec(name, source, make), plan=plan) for plan in ("h200", None)]
    return [r.status + (f": {r.message[:120]}" if r.message else "") for r in rows]


def add_row(lines, name, cells, t0):
    lines.append(f"| {name} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    print(f"{name}: {' · '.join(cells)} ({time.perf_counter() - t0:.1f} s)", flush=True)


def write_table(lines, out: Path):
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(out)


if __name__ == "__main__":
    main()
