"""Decoder-only language models for the generation tests and benchmark, built offline with
random weights: tiny configs of five families (CPU tests) and full-size shapes (GPU benchmark).

    from graphopt.examples import decoders
    model = decoders.build(decoders.tiny_config("llama"), seed=0)                 # fp32, CPU, eval
    model = decoders.build(decoders.llama3_8b_config(), dtype=torch.bfloat16, device="cuda")
"""

from __future__ import annotations

import torch

__all__ = ["FAMILIES", "tiny_config", "llama3_8b_config", "glm4_9b_config", "build"]

FAMILIES = ("glm4", "llama", "qwen2", "mistral", "gpt2")


def tiny_config(family: str, attn: str = "sdpa", vocab: int = 256, layers: int = 2):
    """A CPU-test sized config of ``family`` (hidden 64, 4 heads; GQA with 2 KV heads where the
    family has it), ``attn`` the attention implementation ("sdpa" or "eager")."""
    import transformers as tf

    common = dict(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if family == "glm4":
        from .zoo import glm4_tiny_config

        cfg = glm4_tiny_config()
        cfg.num_hidden_layers = layers
    elif family == "llama":
        cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=512, **common)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=512, **common)
    elif family == "mistral":
        cfg = tf.MistralConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=layers, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=512, sliding_window=512, **common)
    elif family == "gpt2":
        cfg = tf.GPT2Config(n_embd=64, n_layer=layers, n_head=4, n_positions=512, **common)
    else:
        raise ValueError(f"unknown decoder family {family!r}; one of {', '.join(FAMILIES)}")
    cfg._attn_implementation = attn
    return cfg


def llama3_8b_config(num_layers: int = 32):
    """``LlamaConfig`` with the Llama-3-8B shape: hidden 4096, 32 heads, 8 KV heads, head_dim 128,
    SwiGLU 14336, vocab 128256, RoPE theta 5e5, ``num_layers`` layers."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=num_layers,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                       bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False)


def glm4_9b_config(num_layers: int = 40):
    """The GLM-4-9B shape (examples.zoo.glm4_9b_config) with ``num_layers`` layers, SDPA attention."""
    from .zoo import glm4_9b_config as glm

    cfg = glm(num_layers)
    cfg._attn_implementation = "sdpa"
    return cfg


def build(config, *, dtype=torch.float32, device="cpu", seed: int = 0):
    """The causal LM for ``config`` with random weights (transformers' own init, seeded), built in
    ``dtype`` directly on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
