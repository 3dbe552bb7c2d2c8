"""graphopt.optimize_generation on tiny decoders (CPU, fp32, random weights): the tokens are those
of transformers' own generate(), greedy and sampled; EOS, left padding, errors; the decode step's
cache writes; the CUDA-graph replay path on the emulated backend."""

import copy

import pytest
import torch

import graphopt
from graphopt import GenerationError, ir
from graphopt.examples import decoders

aten = torch.ops.aten
STEPS = 64
_CACHE: dict = {}


def _setup(family, attn="sdpa", **options):
    """(model, generator) for a family, built once per test session (max batch 2, length 80)."""
    key = (family, attn, tuple(sorted(options.items())))
    if key not in _CACHE:
        model = decoders.build(decoders.tiny_config(family, attn=attn), seed=0)
        gen = graphopt.optimize_generation(model, max_batch_size=2, max_length=80, check_accuracy=False, **options)
        _CACHE[key] = (model, gen)
    return _CACHE[key]


def _prompts(batch=2, length=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (batch, length), generator=g)


def _hf(model, ids, mask=None, **kw):
    kw.setdefault("pad_token_id", 0)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids), **kw)


@pytest.mark.parametrize("family,attn", [(f, "sdpa") for f in decoders.FAMILIES] + [("llama", "eager")])
def test_greedy_tokens_equal_transformers_generate(family, attn):
    model, gen = _setup(family, attn)
    ids = _prompts()
    out = gen.generate(ids, max_new_tokens=STEPS, do_sample=False, eos_token_id=None)
    ref = _hf(model, ids, max_new_tokens=STEPS, do_sample=False, eos_token_id=None)
    assert out.shape == ref.shape == (2, 7 + STEPS)
    assert torch.equal(out, ref)


def test_a_decoder_reading_the_key_count_from_the_mask_generates_as_hf():
    """BLOOM's ALiBi is built from the 2-D attention mask, so its width must be the static cache's:
    the prefill passes a mask that spans the cache, as the decode steps do (a prompt-wide one
    failed with a shape error)."""
    import transformers as tf

    cfg = tf.BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    torch.manual_seed(0)
    model = tf.BloomForCausalLM(cfg).eval()
    ids = _prompts()
    try:
        ref = _hf(model, ids, max_new_tokens=16, do_sample=False, eos_token_id=None, cache_implementation="static")
    except Exception as e:  # noqa: BLE001 - an older transformers' BLOOM takes no static cache
        pytest.skip(f"transformers' own static-cache generate fails on BLOOM here: {type(e).__name__}")
    gen = graphopt.optimize_generation(model, max_batch_size=2, max_length=32, check_accuracy=False)
    out = gen.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
    assert torch.equal(out, ref)
    # left-padded prompts: BLOOM takes no position_ids (its ALiBi counts the mask), as HF runs it
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ref = _hf(model, ids, mask, max_new_tokens=16, do_sample=False, eos_token_id=None)
    assert torch.equal(gen.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None), ref)


def test_a_model_that_computes_otherwise_with_a_static_cache_is_refused():
    """GPT-Neo's local attention slices its mask by the cache's full length, so with transformers'
    StaticCache its logits change (the generated tokens differed from its generate()'s from the first
    one): a model transformers does not mark static-cache ready is checked, and this one refused with a
    one-line GenerationError; a Llama unmarked the same way computes the same and generates HF's tokens."""
    import transformers as tf

    torch.manual_seed(0)
    neo = tf.GPTNeoForCausalLM(tf.GPTNeoConfig(
        vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
        window_size=8, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    assert not getattr(type(neo), "_can_compile_fullgraph", False)
    with pytest.raises(GenerationError, match="StaticCache") as ei:
        graphopt.optimize_generation(neo, max_batch_size=2, max_length=32, check_accuracy=False)
    assert "\n" not in str(ei.value)
    unmarked = type("UnmarkedLlama", (tf.LlamaForCausalLM,), {"_can_compile_fullgraph": False})
    llama = unmarked(tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    checked = []
    real = graphopt.generation.Generator._check_static_cache
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graphopt.generation.Generator, "_check_static_cache", lambda self: checked.append(real(self)))
        gen = graphopt.optimize_generation(llama, max_batch_size=2, max_length=32, check_accuracy=False)
    assert checked == [None]
    ids = _prompts()
    assert torch.equal(gen.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None),
                       _hf(llama, ids, max_new_tokens=8, do_sample=False, eos_token_id=None))


def test_a_sliding_window_shorter_than_the_cache_generates_as_hf():
    """A sliding-window layer (Mistral's, Gemma's) whose window is shorter than max_length gets a full
    static layer: the model's own sliding-window mask keeps the attention in the window, so the tokens
    are transformers' (they differ from the same model without a window: the window is exercised)."""
    import copy

    import transformers as tf

    cfg = tf.MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=6,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(cfg).eval()
    ids = _prompts()
    ref = _hf(model, ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
    wide = copy.deepcopy(model)
    wide.config.sliding_window = None
    assert not torch.equal(_hf(wide, ids, max_new_tokens=24, do_sample=False, eos_token_id=None), ref)
    gen = graphopt.optimize_generation(model, max_batch_size=2, max_length=40, check_accuracy=False)
    assert torch.equal(gen.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None), ref)


def _reference_sample(model, ids, steps, temperature, top_k, top_p, seed):
    """Sampling written out against the eager model's logits (DynamicCache, one token per step):
    temperature, then keep the top_k largest, then the smallest set of largest-probability tokens
    whose mass exceeds top_p; one multinomial draw per step from a generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    seq, cache, nxt = ids, None, ids
    arg = decoders.cache_arg(model)
    with torch.no_grad():
        for _ in range(steps):
            out = model(nxt, use_cache=True, **{arg: cache})
            cache = decoders.returned_cache(out)
            scores = out.logits[:, -1].double().float() / temperature
            kth = scores.sort(dim=-1, descending=True).values[:, top_k - 1:top_k]
            scores = torch.where(scores < kth, torch.full_like(scores, -float("inf")), scores)
            order = scores.argsort(dim=-1)  # ascending
            probs_sorted = torch.softmax(scores.gather(1, order), dim=-1)
            drop_sorted = probs_sorted.cumsum(-1) <= 1 - top_p
            drop_sorted[:, -1] = False
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            scores = scores.masked_fill(drop, -float("inf"))
            nxt = torch.multinomial(torch.softmax(scores, -1), 1, generator=g)
            seq = torch.cat([seq, nxt], dim=1)
    return seq


def test_sampling_is_seeded_and_equals_a_reference_sampler_and_hf():
    model, gen = _setup("llama")
    ids = _prompts()
    opts = dict(max_new_tokens=24, do_sample=True, temperature=0.8, top_k=40, top_p=0.9, eos_token_id=None)
    a = gen.generate(ids, generator=torch.Generator().manual_seed(5), **opts)
    b = gen.generate(ids, generator=torch.Generator().manual_seed(5), **opts)
    c = gen.generate(ids, generator=torch.Generator().manual_seed(6), **opts)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a, _reference_sample(model, ids, 24, 0.8, 40, 0.9, seed=5))
    torch.manual_seed(11)  # the global RNG, as HF's sampling draws from it
    ours = gen.generate(ids, **opts)
    torch.manual_seed(11)
    assert torch.equal(ours, _hf(model, ids, **opts))


def test_sampling_without_a_temperature_samples_at_one():
    """do_sample with no temperature given (none in the model's generation config either) samples
    at temperature 1, as transformers does; a temperature <= 0 is refused."""
    model, gen = _setup("llama")
    ids = _prompts()
    model.generation_config.temperature = None
    opts = dict(max_new_tokens=8, do_sample=True, top_k=20, eos_token_id=None)
    a = gen.generate(ids, generator=torch.Generator().manual_seed(3), **opts)
    assert torch.equal(a, gen.generate(ids, generator=torch.Generator().manual_seed(3), temperature=1.0, **opts))
    with pytest.raises(graphopt.GraphoptError, match="temperature must be > 0"):
        gen.generate(ids, temperature=0.0, **opts)


def test_eos_stops_each_row_and_pads_it():
    model, gen = _setup("llama")
    ids = _prompts()
    free = gen.generate(ids, max_new_tokens=STEPS, eos_token_id=None)
    eos = [int(free[0, 7 + 3]), int(free[1, 7 + 9])]  # row 0 ends at its 4th token, row 1 by its 10th
    out = gen.generate(ids, max_new_tokens=STEPS, eos_token_id=eos, pad_token_id=0)
    ref = _hf(model, ids, max_new_tokens=STEPS, eos_token_id=eos)
    assert torch.equal(out, ref)
    assert out.shape[1] < 7 + STEPS  # stopped when both rows had ended
    row0 = out[0, 7:]
    first = int((row0.unsqueeze(1) == torch.tensor(eos)).any(1).nonzero()[0])
    assert (row0[first + 1:] == 0).all()  # padded after its EOS


def test_left_padded_batch_equals_each_prompt_alone():
    model, gen = _setup("qwen2")
    short, long = _prompts(1, 5, seed=2), _prompts(1, 9, seed=3)
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    ids[0, 4:], mask[0, 4:] = short[0], 1
    ids[1], mask[1] = long[0], 1
    out = gen.generate(ids, mask, max_new_tokens=20, eos_token_id=None)
    assert torch.equal(out, _hf(model, ids, mask, max_new_tokens=20, eos_token_id=None))
    alone = [gen.generate(p, max_new_tokens=20, eos_token_id=None) for p in (short, long)]
    assert torch.equal(out[0, 9:], alone[0][0, 5:]) and torch.equal(out[1, 9:], alone[1][0, 9:])


def test_decode_graph_writes_the_cache_in_place():
    model, gen = _setup("glm4")
    opt = gen.decode_state(2).module
    layers = model.config.num_hidden_layers
    writes = ir.input_mutations(opt.graph_module)
    assert sorted(ir.target_name(n) for n, _ in writes) == sorted(["index_copy_"] * 2 * layers + ["add_.Tensor"] * layers)
    targets = [n.target for n in opt.graph_module.graph.nodes if n.op == "call_function"]
    assert aten.index_copy.default not in targets and aten.copy_.default not in targets
    outs = next(n for n in opt.graph_module.graph.nodes if n.op == "output").all_input_nodes
    assert len(outs) == 1 and tuple(outs[0].meta["val"].shape) == (2, 1, model.config.vocab_size)  # logits only


def test_replayed_decode_steps_on_the_emulated_backend():
    """The CUDA-graph path (bound inputs, first call eager then captured, replays) on the CPU
    stand-in: same tokens, one capture, every later step a replay, prefill optimized too; a
    step called directly with grad enabled is a replay (it runs under no_grad itself)."""
    model, gen = _setup("mistral", cuda_graphs=True, graph_backend="emulate", prefill="graphopt")
    ids = _prompts()
    out = gen.generate(ids, max_new_tokens=16, eos_token_id=None)
    assert torch.equal(out, _hf(model, ids, max_new_tokens=16, eos_token_id=None))
    stats = gen.decode_state(2).runner.stats
    assert stats["captures"] == 1 and stats["eager_calls"] == 1 and stats["replays"] == 14
    again = gen.generate(ids, max_new_tokens=16, eos_token_id=None)
    assert torch.equal(again, out) and stats["captures"] == 1 and stats["replays"] == 29
    with torch.enable_grad():  # a step called directly with grad enabled replays too
        gen.decode_state(2).step()
    assert stats["replays"] == 30 and not stats["fallbacks"], stats


@pytest.mark.parametrize("family", ["llama", "glm4"])
def test_the_gpu_plan_replayed_on_the_emulated_backend(family):
    """The decode step as planned for the H200 (fused rotary + cache writes, the position
    increments merged into one _foreach_add_; the graphopt ops run their references here),
    replayed through the emulated CUDA-graph runner: HF's tokens, one capture, every later step
    a replay bound to the caches the fused op writes."""
    model, gen = _setup(family, target="h200", cuda_graphs=True, graph_backend="emulate")
    ids = _prompts()
    out = gen.generate(ids, max_new_tokens=16, eos_token_id=None)
    assert torch.equal(out, _hf(model, ids, max_new_tokens=16, eos_token_id=None))
    state = gen.decode_state(2)
    layers = model.config.num_hidden_layers
    writes = sorted(ir.target_name(n) for n, _ in ir.input_mutations(state.module.graph_module))
    assert writes == sorted(["rotary_cache_write"] * 2 * layers + ["_foreach_add_.Scalar"] * layers)
    assert state.runner.stats["captures"] == 1 and state.runner.stats["replays"] == 14
    assert len(state.runner.bound_inputs) == 3 * layers


def test_generator_leaves_the_model_and_inputs_alone():
    model = decoders.build(decoders.tiny_config("gpt2"), seed=0).train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gen = graphopt.optimize_generation(model, max_batch_size=1, max_length=24, check_accuracy=False)
    ids = _prompts(1, 4)
    kept = ids.clone()
    model.eval()
    ref = _hf(model, ids, max_new_tokens=8, eos_token_id=None)
    model.train()
    assert torch.equal(gen.generate(ids, max_new_tokens=8, eos_token_id=None), ref)
    assert torch.equal(ids, kept) and model.training
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_bad_arguments_raise_generation_errors():
    model, gen = _setup("llama")
    with pytest.raises(GenerationError, match="exceeds max_length"):
        gen.generate(_prompts(1, 70), max_new_tokens=20)
    with pytest.raises(GenerationError, match="max_batch_size"):
        gen.generate(_prompts(3, 4), max_new_tokens=2)
    with pytest.raises(GenerationError, match="attention_mask"):
        gen.generate(_prompts(2, 4), torch.ones(2, 5, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(GenerationError, match="input_ids"):
        gen.generate(torch.randn(2, 4), max_new_tokens=2)
    with pytest.raises(GenerationError, match="max_batch_size"):
        graphopt.optimize_generation(model, max_batch_size=0, max_length=16)
    with pytest.raises(GenerationError, match="chosen by the generator"):
        graphopt.optimize_generation(model, max_batch_size=1, max_length=16, on_new_shape="reoptimize")


def test_benchmark_dry_run_writes_its_tables(tmp_path):
    """benchmarks/generation_bench.py --tiny on the CPU: every row measured, JSON and Markdown written;
    a variant that fails is a row with its error and the run goes on."""
    import importlib.util
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "generation_bench.py"
    spec = importlib.util.spec_from_file_location("generation_bench", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    class Broken(bench.Eager):
        name = "broken"

        def decode_ms(self, batch, past):
            raise RuntimeError("planted failure")

    bench.VARIANTS["broken"] = Broken
    stem = bench.main(["--tiny", "--device", "cpu", "--out", str(tmp_path), "--batches", "1", "--steps", "2",
                       "--new-tokens", "4", "--prefill-reps", "1", "--variants", "eager,broken,graphopt"])
    data = json.loads(stem.with_suffix(".json").read_text())
    rows = data["rows"]
    assert {(r["kind"], r["variant"]) for r in rows} >= {("decode", "eager"), ("decode", "graphopt"), ("prefill", "graphopt"),
                                                       ("e2e", "eager"), ("e2e", "graphopt"), ("decode", "broken")}
    broken = next(r for r in rows if r["variant"] == "broken" and r["kind"] == "decode")
    assert "planted failure" in broken["error"]
    for r in rows:
        if r["variant"] != "broken":
            assert "error" not in r, r
    g = next(r for r in rows if r["kind"] == "decode" and r["variant"] == "graphopt")
    assert g["ms"] > 0 and g["floor_kv_ms"] >= g["floor_weights_ms"] > 0 and g["accuracy"] == "passed"
    assert g["floor_all_ms"] > g["floor_weights_ms"]  # the input embedding table counted whole
    assert next(r for r in rows if r["kind"] == "e2e" and r["variant"] == "graphopt")["same_as_eager"] == "all"
    md = stem.with_suffix(".md").read_text()
    assert "## Decode step (ms)" in md and "## End to end" in md and data["meta"]["versions"]["torch"]
    assert "step / floor (weights + KV) <= 1.15" in md and "step / (all weight bytes / copy rate) <= 1.15" in md


def _greedy_margins(model, seq, plen):
    """For each token of ``seq`` after the prompt (greedy picks): how far its logit is below the
    best one, relative to the largest logit magnitude, under an fp64 copy of ``model`` reading
    the whole sequence at once (teacher forcing: the picks are checked, not re-made, so a
    near-tie the fp32 kernels break the other way is not a failure). [B, new tokens], >= 0."""
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        logits = ref(seq[:, :-1], attention_mask=torch.ones_like(seq[:, :-1])).logits[:, plen - 1:]
    picked = logits.gather(-1, seq[:, plen:, None]).squeeze(-1)
    return (logits.amax(-1) - picked) / logits.abs().amax()


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llama", "glm4"])
def test_cuda_graph_generation_on_the_gpu(family, monkeypatch):
    """On a GPU (fp32, TF32 off): the decode step is a replayed CUDA graph bound to the
    generator's cache (one capture per batch size, the first call its warm-up, every later step a
    replay), the cache tensors keep their addresses, every greedy token is the fp64 model's argmax
    on the generated sequence (within 1e-4 of the largest logit magnitude: the kernels differ from
    HF's, so exact equality with HF's generate would fail at the first near-tie), sampling with a
    seeded generator repeats, and a step called directly with grad enabled replays too."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = decoders.build(decoders.tiny_config(family), seed=0, device="cuda")
    gen = graphopt.optimize_generation(model, max_batch_size=2, max_length=96)
    ids = _prompts().cuda()
    ptrs = [layer.keys.data_ptr() for layer in gen._cache.layers]
    out = gen.generate(ids, max_new_tokens=STEPS, eos_token_id=None)
    state = gen.decode_state(2)
    runner = state.runner
    assert runner.decision.on, runner.decision.note()
    assert runner.stats["captures"] == 1 and runner.stats["eager_calls"] == 1 \
        and runner.stats["replays"] == STEPS - 2, (runner.stats, runner.decision.note())
    assert [layer.keys.data_ptr() for layer in gen._cache.layers] == ptrs
    assert state.module.report.accuracy.get("passed"), state.module.report.accuracy
    assert out.shape == (2, 7 + STEPS)
    margins = _greedy_margins(model, out, 7)
    worst = margins.max(dim=1)
    assert bool((margins <= 1e-4).all()), (
        f"a greedy token is not the fp64 argmax: worst margin per row {worst.values.tolist()} at new token "
        f"{worst.indices.tolist()}; tokens {out[:, 7:].tolist()}")
    opts = dict(max_new_tokens=16, do_sample=True, top_k=20, eos_token_id=None)
    a = gen.generate(ids, generator=torch.Generator("cuda").manual_seed(3), **opts)
    b = gen.generate(ids, generator=torch.Generator("cuda").manual_seed(3), **opts)
    assert torch.equal(a, b) and runner.stats["captures"] == 1, runner.stats
    # a step called directly, with grad enabled, still replays the graph
    before = runner.stats["replays"]
    with torch.enable_grad():
        state.step()
    assert runner.stats["replays"] == before + 1 and not runner.stats["fallbacks"], runner.stats


def test_hf_generate_drives_the_replayed_step():
    """transformers' own generate() loop (here with a repetition penalty the generator's loop does
    not apply, and a left-padded row) on the generator's cache and replayed decode steps: the same
    ids as model.generate, and the model's forward is its own again afterwards."""
    model, gen = _setup("mistral", cuda_graphs=True, graph_backend="emulate", prefill="graphopt")
    ids = _prompts()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    opts = dict(max_new_tokens=12, eos_token_id=None, pad_token_id=0, repetition_penalty=1.3)
    runner = gen.decode_state(2).runner
    before = runner.stats["replays"]
    out = gen.hf_generate(ids, mask, **opts)
    assert torch.equal(out, _hf(model, ids, mask, **opts))
    assert runner.stats["replays"] - before >= 10 and "forward" not in vars(model)
    with pytest.raises(GenerationError, match="generator's to choose"):
        gen.hf_generate(ids, cache_implementation="static")


def test_hf_generate_on_a_model_with_layer_types():
    """A config with ``layer_types`` (Qwen2's, Gemma2's) makes transformers' generate() pass the one-token
    calls a dict of 4-D masks, one per layer type: the padding is read from the full-attention one (it
    failed with "'dict' object has no attribute 'dim'")."""
    model, gen = _setup("qwen2")
    assert hasattr(model.config, "layer_types")
    ids = _prompts()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    opts = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(gen.hf_generate(ids, mask, **opts), _hf(model, ids, mask, **opts))


def test_hf_generate_expands_the_batch_for_beams_and_return_sequences():
    """transformers expands each prompt to max(num_beams, num_return_sequences) rows: the generator's cache
    and decode step are those of the expanded batch (the prompt's batch size failed in index_copy_), and
    more rows than max_batch_size is a GenerationError."""
    model, gen = _setup("llama")
    ids = _prompts(1)
    opts = dict(max_new_tokens=6, eos_token_id=None, pad_token_id=0, do_sample=True, top_k=20, num_return_sequences=2)
    torch.manual_seed(4)
    out = gen.hf_generate(ids, **opts)
    torch.manual_seed(4)
    assert out.shape[0] == 2 and torch.equal(out, _hf(model, ids, **opts))
    with pytest.raises(GenerationError, match="2 prompts x 2 .* max_batch_size=2"):
        gen.hf_generate(_prompts(2), **opts)


def test_hf_generate_beam_search_on_the_bound_replayed_step():
    """Beam search's reorder_cache replaces each layer's key/value tensors; the replayed step is bound to
    the generator's own, so the reordered cache is copied back into them before the step (the replay
    ignored the reorder and the beams differed from transformers')."""
    model, gen = _setup("mistral", cuda_graphs=True, graph_backend="emulate", prefill="graphopt")
    ids = _prompts(1, seed=3)
    opts = dict(max_new_tokens=10, eos_token_id=None, pad_token_id=0, num_beams=2)
    assert torch.equal(gen.hf_generate(ids, **opts), _hf(model, ids, **opts))


def test_hf_generate_past_the_cache_raises_a_generation_error():
    """transformers' generate() on the generator's cache asking for more positions than max_length: a
    one-line GenerationError before the write past the cache's end (it failed inside the step's
    index_copy_, on a GPU a device-side fault)."""
    model, gen = _setup("llama")
    for plen, new in ((74, 12), (81, 2)):  # the decode steps run out; the prompt alone is too long
        with pytest.raises(GenerationError, match="max_length=80") as ei:
            gen.hf_generate(_prompts(2, plen), max_new_tokens=new, eos_token_id=None, pad_token_id=0)
        assert "\n" not in str(ei.value)
    out = gen.hf_generate(_prompts(2, 74), max_new_tokens=7, eos_token_id=None, pad_token_id=0)  # 80 positions
    assert out.shape == (2, 81)


def test_default_length_is_twenty_new_tokens_as_transformers():
    """No max_new_tokens and no max_length in the generation config: 20 new tokens, as transformers'
    generate() (the generator took 20 as the total length, so 13 new tokens after a 7-token prompt and
    an error after a 25-token one)."""
    model, gen = _setup("llama")
    assert model.generation_config.max_length is None and model.generation_config.max_new_tokens is None
    for ids in (_prompts(), _prompts(2, 25)):
        out = gen.generate(ids, eos_token_id=None)
        assert out.shape == (2, ids.shape[1] + 20) and torch.equal(out, _hf(model, ids, eos_token_id=None))


def test_token_ids_given_as_tensors():
    """eos_token_id / pad_token_id given as tensors, as transformers' generate() takes them: the same ids as
    ints (a 0-d tensor failed with "iteration over a 0-d tensor")."""
    model, gen = _setup("llama")
    ids = _prompts()
    free = gen.generate(ids, max_new_tokens=6, eos_token_id=None)
    eos = int(free[0, 7 + 1])
    for e in (eos, [eos, 255]):
        want = gen.generate(ids, max_new_tokens=6, eos_token_id=e, pad_token_id=0)
        got = gen.generate(ids, max_new_tokens=6, eos_token_id=torch.tensor(e), pad_token_id=torch.tensor(0))
        assert torch.equal(got, want)
