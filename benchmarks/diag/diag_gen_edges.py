"""Does optimize_generation give transformers' generate() tokens on untuned decoders (tiny configs, CPU fp32) under left padding, odd batch sizes, 1-token prompts, max_length limits, mid-row EOS, seeded sampling and repeated calls?

    python benchmarks/diag/diag_gen_edges.py [--only mistral,gemma2] [--cases basic,pad]
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

V = 256
TOK = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
T = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
         max_position_embeddings=64, **TOK)
D = dict(T, num_key_value_heads=2)
MODELS = {
    "mistral": ("MistralConfig", dict(D, sliding_window=8)),
    "qwen2-moe": ("Qwen2MoeConfig", dict(D, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=32)),
    "mixtral": ("MixtralConfig", dict(D, num_local_experts=4, num_experts_per_tok=2)),
    "gemma2": ("Gemma2Config", dict(D, head_dim=16, sliding_window=8)),
    "gemma3": ("Gemma3TextConfig", dict(D, head_dim=16, sliding_window=8)),
    "phi3": ("Phi3Config", D),
    "starcoder2": ("Starcoder2Config", dict(D, sliding_window=None)),
    "olmo2": ("Olmo2Config", D),
    "stablelm": ("StableLmConfig", D),
    "granite": ("GraniteConfig", D),
    "cohere": ("CohereConfig", D),
    "gpt-neox": ("GPTNeoXConfig", T),
    "gptj": ("GPTJConfig", dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64, **TOK)),
    "bloom": ("BloomConfig", dict(vocab_size=V, hidden_size=64, n_layer=2, n_head=4, **TOK)),
    "opt": ("OPTConfig", dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                              max_position_embeddings=64, word_embed_proj_dim=64, **TOK)),
    "falcon": ("FalconConfig", dict(T, num_kv_heads=2, new_decoder_architecture=True)),
    "falcon-mq": ("FalconConfig", dict(T, multi_query=True, new_decoder_architecture=False)),
    "persimmon": ("PersimmonConfig", T),
    "qwen3": ("Qwen3Config", D),
    "gpt2": ("GPT2Config", dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64, **TOK)),
    "gpt-oss": ("GptOssConfig", dict(D, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
    "cohere2": ("Cohere2Config", dict(D, sliding_window=8)),
    "exaone4": ("Exaone4Config", dict(D, sliding_window=8)),
}
MAXB, MAXL = 3, 40


def build(name):
    import transformers as tf

    cfg_name, kw = MODELS[name]
    cfg = getattr(tf, cfg_name)(**kw)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg).eval()


def prompts(b, n, seed):
    return torch.randint(3, V, (b, n), generator=torch.Generator().manual_seed(seed))


def hf(model, ids, mask=None, **kw):
    kw.setdefault("pad_token_id", 0)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids), **kw)


def tie_note(model, out, ref, mask, plen):
    """Where tokens differ: the float64 logits at the first difference; a near tie is not a bug."""
    diff = (out[:, :ref.shape[1]] != ref[:, :out.shape[1]])
    if out.shape != ref.shape and not diff.any():
        return f"shape {tuple(out.shape)} vs {tuple(ref.shape)}"
    r, c = [int(x) for x in diff.nonzero()[0]]
    import copy
    m64 = copy.deepcopy(model).double()
    pre = out[r:r + 1, :c]
    am = torch.ones_like(pre)
    if mask is not None:
        am[:, :plen] = mask[r:r + 1]
    with torch.no_grad():
        lg = m64(pre, attention_mask=am).logits[0, -1]
    top = lg.topk(2)
    a, b = int(out[r, c]), int(ref[r, c])
    return (f"row {r} col {c}: ours {a} hf {b}; fp64 argmax {int(top.indices[0])} gap top2 "
            f"{float(top.values[0] - top.values[1]):.2e}, l64[ours]-l64[hf] {float(lg[a] - lg[b]):.2e}")


def check(model, out, ref, mask=None, plen=None):
    if torch.equal(out, ref):
        return "ok"
    return "DIFF " + tie_note(model, out, ref, mask, plen)


CASES = {}


def case(f):
    CASES[f.__name__] = f
    return f


@case
def basic(model, gen):
    ids = prompts(2, 7, 1)
    return check(model, gen.generate(ids, max_new_tokens=24, eos_token_id=None),
                 hf(model, ids, max_new_tokens=24, eos_token_id=None))


@case
def pad(model, gen):
    """left-padded batch of 3 with prompts of 3, 9, 6 tokens"""
    lens = [3, 9, 6]
    ids = torch.zeros(3, 9, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        ids[i, 9 - n:] = prompts(1, n, 10 + i)[0]
        mask[i, 9 - n:] = 1
    out = gen.generate(ids, mask, max_new_tokens=20, eos_token_id=None)
    res = check(model, out, hf(model, ids, mask, max_new_tokens=20, eos_token_id=None), mask, 9)
    if res != "ok":
        return res
    for i, n in enumerate(lens):  # each alone
        alone = gen.generate(ids[i:i + 1, 9 - n:], max_new_tokens=20, eos_token_id=None)
        if not torch.equal(alone[0, n:], out[i, 9:]):
            return f"row {i} alone differs from batched: " + check(model, alone[0:1, n:], out[i:i + 1, 9:])
    return "ok"


@case
def b1_len1(model, gen):
    ids = prompts(1, 1, 3)
    return check(model, gen.generate(ids, max_new_tokens=16, eos_token_id=None),
                 hf(model, ids, max_new_tokens=16, eos_token_id=None))


@case
def b3_len1(model, gen):
    ids = prompts(3, 1, 4)
    return check(model, gen.generate(ids, max_new_tokens=16, eos_token_id=None),
                 hf(model, ids, max_new_tokens=16, eos_token_id=None))


@case
def full_length(model, gen):
    """plen + new == max_length exactly; one more raises a one-line GraphoptError"""
    import graphopt

    ids = prompts(MAXB, 5, 5)
    out = gen.generate(ids, max_new_tokens=MAXL - 5, eos_token_id=None)
    res = check(model, out, hf(model, ids, max_new_tokens=MAXL - 5, eos_token_id=None))
    if res != "ok":
        return res
    try:
        gen.generate(ids, max_new_tokens=MAXL - 4, eos_token_id=None)
        return "NO ERROR past max_length"
    except graphopt.GraphoptError as e:
        if "\n" in str(e):
            return "multi-line error"
    try:
        gen.generate(prompts(1, MAXL, 5), max_new_tokens=1, eos_token_id=None)
        return "NO ERROR for prompt == max_length"
    except graphopt.GraphoptError as e:
        if "\n" in str(e):
            return "multi-line error"
    return "ok"


@case
def eos_mid(model, gen):
    ids = prompts(3, 6, 6)
    free = gen.generate(ids, max_new_tokens=30, eos_token_id=None)
    eos = [int(free[0, 6 + 2]), int(free[2, 6 + 11])]
    out = gen.generate(ids, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    ref = hf(model, ids, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    return check(model, out, ref)


@case
def eos_pad_left(model, gen):
    """left padding + EOS: the mask inferred from the pad token (no mask given)"""
    ids = prompts(2, 8, 7)
    ids[0, :3] = 0
    free = gen.generate(ids, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    eos = [int(free[1, 8 + 4])]
    out = gen.generate(ids, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    return check(model, out, ref, ids.ne(0).long(), 8)


@case
def sample(model, gen):
    ids = prompts(2, 5, 8)
    opts = dict(max_new_tokens=16, do_sample=True, temperature=0.7, top_k=30, top_p=0.9, eos_token_id=None)
    torch.manual_seed(3)
    a = gen.generate(ids, **opts)
    torch.manual_seed(3)
    b = hf(model, ids, **opts)
    g1 = gen.generate(ids, generator=torch.Generator().manual_seed(9), **opts)
    g2 = gen.generate(ids, generator=torch.Generator().manual_seed(9), **opts)
    if not torch.equal(g1, g2):
        return "seeded generator not deterministic"
    return check(model, a, b)


@case
def repeat(model, gen):
    """calls of other shapes between two identical calls change nothing"""
    ids = prompts(2, 7, 1)
    a = gen.generate(ids, max_new_tokens=12, eos_token_id=None)
    gen.generate(prompts(2, 20, 2), max_new_tokens=19, eos_token_id=None)
    gen.generate(prompts(3, 3, 2), max_new_tokens=5, eos_token_id=None)
    gen.generate(prompts(1, 2, 2), max_new_tokens=30, eos_token_id=None)
    b = gen.generate(ids, max_new_tokens=12, eos_token_id=None)
    if not torch.equal(a, b):
        return "DIFF after other calls " + check(model, b, a)
    # shorter second call after a longer one with padding
    m = torch.ones_like(ids)
    m[1, :4] = 0
    c = gen.generate(ids, m, max_new_tokens=12, eos_token_id=None)
    return check(model, c, hf(model, ids, m, max_new_tokens=12, eos_token_id=None), m, 7)


@case
def hf_gen(model, gen):
    """gen.hf_generate greedy, with left padding"""
    ids = prompts(2, 7, 12)
    m = torch.ones_like(ids)
    m[0, :2] = 0
    out = gen.hf_generate(ids, m, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    return check(model, out, hf(model, ids, m, max_new_tokens=12, eos_token_id=None), m, 7)


@case
def hf_beams(model, gen):
    """gen.hf_generate with beam search (3 beams, 1 prompt) and 3 sampled return sequences"""
    ids = prompts(1, 5, 13)
    opts = dict(max_new_tokens=10, eos_token_id=None, pad_token_id=0, num_beams=3)
    res = check(model, gen.hf_generate(ids, **opts), hf(model, ids, **opts))
    if res != "ok":
        return "beams " + res
    opts = dict(max_new_tokens=10, eos_token_id=None, pad_token_id=0, do_sample=True, num_return_sequences=3)
    torch.manual_seed(2)
    a = gen.hf_generate(ids, **opts)
    torch.manual_seed(2)
    return check(model, a, hf(model, ids, **opts))


@case
def hf_lookup(model, gen):
    """gen.hf_generate with prompt-lookup (assisted) decoding up to the cache's end (it crops the cache),
    and one token past it: a one-line GraphoptError"""
    import graphopt

    ids = torch.tensor([[5, 6, 7, 8] * 3 + [5, 6, 7]])
    opts = dict(eos_token_id=None, pad_token_id=0, prompt_lookup_num_tokens=3)
    res = check(model, gen.hf_generate(ids, max_new_tokens=MAXL - 16, **opts),
                hf(model, ids, max_new_tokens=MAXL - 16, **opts))
    if res != "ok":
        return res
    try:
        gen.hf_generate(ids, max_new_tokens=MAXL, **opts)
        return "NO ERROR past max_length"
    except graphopt.GraphoptError as e:
        return "ok" if "\n" not in str(e) else "multi-line error"


def main(argv=None):
    import graphopt

    p = argparse.ArgumentParser()
    p.add_argument("--only", default="")
    p.add_argument("--cases", default="")
    p.add_argument("--prefill", default="eager")
    a = p.parse_args(argv)
    names = a.only.split(",") if a.only else list(MODELS)
    cases = a.cases.split(",") if a.cases else list(CASES)
    for name in names:
        t0 = time.time()
        try:
            model = build(name)
            gen = graphopt.optimize_generation(model, max_batch_size=MAXB, max_length=MAXL, check_accuracy=False,
                                               prefill=a.prefill)
        except Exception as e:  # noqa: BLE001
            print(f"{name}: build/optimize {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                  flush=True)
            continue
        for c in cases:
            try:
                res = CASES[c](model, gen)
            except Exception as e:  # noqa: BLE001
                res = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                if "-v" in sys.argv:
                    traceback.print_exc()
            print(f"{name} {c}: {res}", flush=True)
        print(f"{name}: {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
