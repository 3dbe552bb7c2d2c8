"""Token generation with an optimized decode step replayed as a CUDA graph.

    gen = graphopt.optimize_generation(model, max_batch_size=8, max_length=2048)
    ids = gen.generate(input_ids, attention_mask=mask, max_new_tokens=256)   # [B, P + new], as HF's generate

What a :class:`Generator` holds and does:

* **One KV cache**, a transformers ``StaticCache`` of ``max_batch_size`` x ``max_length`` per layer,
  allocated once (its layers sized by one dummy call of the model). A batch of B prompts uses the
  first B rows: a StaticCache whose keys/values are views ``[:B]`` of the same memory, with its own
  position counters. Nothing is padded to ``max_batch_size``: a decode step reads B rows of the
  cache and computes B rows, and memory is allocated once whatever the batch sizes used.
* **One optimized decode step per batch size used** (``graphopt.optimize`` of the model called
  with ``input_ids`` [B, 1], ``attention_mask`` [B, max_length], ``position_ids`` [B, 1] and the
  cache; only the logits come back), optimized on the first ``generate`` with that batch size.
  The graph writes the new key/value into the cache at the cache's position (``index_copy_``)
  and advances the position (``add_``) in place: no copy of the cache per step. On a GPU the
  step is replayed as a CUDA graph (graphopt.runtime.cuda_graphs) bound to the generator's own input tensors
  and cache: a step is one replay with no input copied; the next token, the positions and the
  finished flags are updated on the device by a few small kernels.
* **Prefill**: the prompt written into the cache by the model itself (``prefill="eager"``, the
  default) or by a graph optimized for that prompt shape (``"graphopt"``: an optimize() per new
  prompt shape, 8 kept; for prompts of a few recurring shapes); its ``attention_mask`` spans the
  cache too ([B, max_length]: the prompt's mask, then ones).

``generate`` follows ``GenerationMixin.generate`` for decoder-only models: defaults from
``model.generation_config`` (``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``eos_token_id``,
``pad_token_id``, ``max_new_tokens``/``max_length``), an attention mask inferred from the pad token
when not given, positions ``cumsum(mask) - 1`` (left padding), temperature -> top-k -> top-p
warping and ``torch.multinomial`` for sampling (the global RNG unless ``generator=`` is given,
so a seeded run draws what HF's does), finished rows padded with ``pad_token_id``, and a stop when
every row has produced an EOS token. A generation_config that sets other options (beam search,
repetition penalty, min_p...) raises GenerationError: ``hf_generate`` applies them.

On the CPU the decode step runs as the optimized graph, called each step (no CUDA graph).

``hf_generate`` runs transformers' own ``model.generate`` (every option it has) on the same cache
and replayed decode steps.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections import OrderedDict

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from . import timing
from .errors import GenerationError

__all__ = ["Generator", "DecodeState", "LogitsStep", "optimize_generation", "warp_logits"]

_PREFILL_SPECIALIZATIONS = 8
_UNSET = object()  # a generate() option not given: the model's generation_config decides


class LogitsStep(nn.Module):
    """``model`` called as generate() calls it, returning only the logits (the cache it writes
    is the caller's; a graph returning it would rebuild a cache object every step): what the
    generator optimizes, for prefill and decode steps alike."""

    def __init__(self, model: nn.Module, cache_arg: str, extra: dict):
        super().__init__()
        self.model = model
        self.cache_arg = cache_arg
        self.extra = dict(extra)

    def forward(self, input_ids, attention_mask, position_ids, cache):
        kwargs = {self.cache_arg: cache, **self.extra}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **kwargs).logits


class DecodeState:
    """What one batch size uses: ``cache``, a StaticCache over the first ``batch`` rows of the
    generator's; the decode step's inputs ``input_ids`` [B, 1], ``position_ids`` [B, 1] and
    ``attention_mask`` [B, max_length], updated in place between steps; ``step()``, one decode
    step on them (logits [B, 1, V]; it writes the keys/values at the cache's position and advances
    it; it runs under ``torch.no_grad()`` whatever the caller's grad mode, so it replays the CUDA
    graph); ``module``, the optimized step (its ``.report``); ``runner``, what replays it."""

    def __init__(self, batch: int):
        self.batch = batch
        self.cache = None
        self.input_ids = self.position_ids = self.attention_mask = None
        self.step = None
        self.module = None
        self.runner = None
        self.prefills: OrderedDict = OrderedDict()  # prompt shape -> optimized prefill


def warp_logits(scores: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None) -> torch.Tensor:
    """HF's sampling warpers in HF's order (TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper, min_tokens_to_keep 1) on fp32 scores [B, V]."""
    if temperature is not None and temperature != 1.0:
        scores = scores / temperature
    if top_k is not None and top_k != 0:
        k = min(max(top_k, 1), scores.size(-1))
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], -float("inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cum <= (1 - top_p)
        remove[..., -1:] = 0
        scores = scores.masked_fill(remove.scatter(1, sorted_idx, remove), -float("inf"))
    return scores


# generation_config options the generator does not apply, and their values that mean "off"
# (None always does)
_OFF = {"num_beams": (1,), "repetition_penalty": (1.0,), "no_repeat_ngram_size": (0,), "min_length": (0,),
        "min_new_tokens": (0,), "typical_p": (1.0,), "epsilon_cutoff": (0.0,), "eta_cutoff": (0.0,),
        "encoder_repetition_penalty": (1.0,), "guidance_scale": (1.0,), "bad_words_ids": (), "suppress_tokens": (),
        "begin_suppress_tokens": (), "forced_bos_token_id": (), "forced_eos_token_id": (), "min_p": (),
        "sequence_bias": (), "top_h": (), "exponential_decay_length_penalty": ()}


def _unsupported_options(gc) -> list[str]:
    out = []
    for name, off in _OFF.items():
        v = getattr(gc, name, None)
        if v is None or (isinstance(v, (list, tuple, dict)) and not v) or v in off:
            continue
        out.append(f"{name}={v!r}")
    return out


class Generator:
    """Generation with a static KV cache, an optimized prefill and CUDA-graph-replayed decode
    steps (module docstring). Build it with :func:`optimize_generation`."""

    def __init__(self, model: nn.Module, *, max_batch_size: int, max_length: int, dtype=None, device=None,
                 prefill: str = "eager", cuda_graphs="auto", graph_backend: str = "cuda", **optimize_options):
        if not isinstance(model, nn.Module) or getattr(model, "config", None) is None:
            raise GenerationError("optimize_generation needs a transformers causal LM (a model with a .config)")
        if getattr(model.config, "is_encoder_decoder", False):
            raise GenerationError(f"{type(model).__name__} is an encoder-decoder model; only decoder-only models "
                                  "are supported")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise GenerationError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
        if not isinstance(max_length, int) or max_length < 2:
            raise GenerationError(f"max_length must be an int >= 2, got {max_length!r}")
        if prefill not in ("eager", "graphopt"):
            raise GenerationError(f"prefill must be 'eager' or 'graphopt', got {prefill!r}")
        for bad in ("cuda_graphs", "on_new_shape", "dynamic", "training", "devices"):
            if bad in optimize_options:
                raise GenerationError(f"optimize option {bad!r} is chosen by the generator")
        params = inspect.signature(model.forward).parameters
        self._cache_arg = next((a for a in ("cache", "past_key_values") if a in params), None)
        if self._cache_arg is None or "attention_mask" not in params:
            raise GenerationError(f"{type(model).__name__}.forward takes no cache/attention_mask argument")
        self._has_positions = "position_ids" in params
        self._extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

        first = next(iter(model.parameters()), None)
        want_dev = torch.device(device) if device is not None else (first.device if first is not None else torch.device("cpu"))
        want_dtype = dtype if dtype is not None else (first.dtype if first is not None else torch.float32)
        if first is not None and (first.device != want_dev or first.dtype != want_dtype):
            # the caller's model stays as it is: a converted copy serves the generator
            model = copy.deepcopy(model).to(device=want_dev, dtype=want_dtype)
        self.model = model
        self.device, self.dtype = want_dev, want_dtype
        self.max_batch_size, self.max_length = max_batch_size, max_length
        self.prefill_mode = prefill
        self.cuda_graphs = cuda_graphs
        self.graph_backend = graph_backend
        self.optimize_options = dict(optimize_options)
        self._states: dict[int, DecodeState] = {}
        self.stats = {"prefills": 0, "decode_steps": 0, "optimized": 0}
        self._cache = self._allocate_cache()
        if not getattr(type(model), "_can_compile_fullgraph", False):
            self._check_static_cache()

    # ------------------------------------------------------------------ the cache

    # relative RMS difference of the logits with and without the static cache above which a model is
    # taken not to support it (a full-precision run differs by rounding; bf16/fp16 by a few percent)
    STATIC_CACHE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
    STATIC_CACHE_TOLERANCE_LOW = 0.1

    def _check_static_cache(self):
        """For a model transformers does not declare static-cache ready (``_can_compile_fullgraph``):
        a few tokens prefilled into the static cache and one decoded, as generate() runs them, must
        give the logits one call on all of them gives without a cache (GPT-Neo's local attention
        slices its mask by the cache's full length, so its outputs change): else GenerationError."""
        n = min(8, self.max_length - 1)
        vocab = int(getattr(self.model.config, "vocab_size", 0) or 0)
        if n < 2 or vocab < 1:
            return
        ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0)).to(self.device)
        slot = self._state(1)
        step = self._step_module()
        full = torch.ones(1, self.max_length, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)[None]
        with self._eval():
            ref = self.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -2:].float()
            for layer in slot.cache.layers:
                layer.cumulative_length.zero_()
            a = step(ids[:, :-1], full, pos[:, :-1] if self._has_positions else None, slot.cache)
            b = step(ids[:, -1:], full, pos[:, -1:] if self._has_positions else None, slot.cache)
            for layer in slot.cache.layers:
                layer.cumulative_length.zero_()
        got = torch.cat([a[:, -1:], b[:, -1:]], dim=1).float()
        rel = float((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))
        tol = self.STATIC_CACHE_TOLERANCE.get(self.dtype, self.STATIC_CACHE_TOLERANCE_LOW)
        if not rel <= tol:
            raise GenerationError(
                f"{type(self.model).__name__} computes other logits with transformers' StaticCache than without a "
                f"cache (relative RMS difference {rel:.3g} over {n} tokens); optimize_generation needs a model that "
                "supports the static cache (transformers marks it _can_compile_fullgraph)")

    @contextlib.contextmanager
    def _eval(self):
        was = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train(was)

    def _allocate_cache(self):
        """StaticCache of max_batch_size x max_length: plain StaticLayers, sized by one dummy call of
        the model. A sliding-window layer gets one too, max_length long: the model masks the keys
        outside its window itself (transformers' sliding-window causal mask, from the config), so the
        tokens are those of its own generate(); the window's ring buffer is not kept (the layer's
        cache takes max_length positions instead of the window's)."""
        try:
            from transformers.cache_utils import StaticCache, StaticLayer
        except ImportError as e:  # pragma: no cover
            raise GenerationError(f"transformers' StaticCache is needed: {e}") from None
        from .capture import _register_hf_pytrees

        _register_hf_pytrees()
        cache = StaticCache(config=self.model.config, max_cache_len=self.max_length)
        for i, layer in enumerate(cache.layers):
            if type(layer) is StaticLayer:
                continue
            if getattr(layer, "is_sliding", False):
                cache.layers[i] = StaticLayer(max_cache_len=self.max_length)
                continue
            raise GenerationError(f"cache layer {i} is a {type(layer).__name__}; only full-attention and "
                                  "sliding-window layers are supported")
        ids = torch.zeros(self.max_batch_size, 1, dtype=torch.long, device=self.device)
        with self._eval():
            self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, **{self._cache_arg: cache},
                       **self._extra)
        for layer in cache.layers:
            if layer.keys is None or layer.keys.shape[2] != self.max_length:
                raise GenerationError(f"the model did not fill a {self.max_length}-long static cache")
            layer.cumulative_length.zero_()
        return cache

    def _state(self, batch: int) -> DecodeState:
        slot = self._states.get(batch)
        if slot is not None:
            return slot
        from transformers.cache_utils import Cache, StaticCache, StaticLayer

        slot = DecodeState(batch)
        layers = []
        for big in self._cache.layers:
            layer = StaticLayer.__new__(StaticLayer)
            layer.__dict__.update(vars(big))
            layer.keys, layer.values = big.keys[:batch], big.values[:batch]  # views: the same memory
            layer.batch_size = batch
            layer.cumulative_length = torch.zeros((), dtype=torch.long, device=self.device)
            layers.append(layer)
        cache = StaticCache.__new__(StaticCache)
        Cache.__init__(cache, layers=layers)
        slot.cache = cache
        slot.input_ids = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        slot.position_ids = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        slot.attention_mask = torch.ones(batch, self.max_length, dtype=torch.long, device=self.device)
        self._states[batch] = slot
        return slot

    def _step_module(self) -> LogitsStep:
        return LogitsStep(self.model, self._cache_arg, self._extra)

    def _optimize(self, inputs: dict, name: str, cuda_graphs):
        from .api import optimize

        options = {"model_name": f"{type(self.model).__name__} {name}", **self.optimize_options}
        timing.progress("generation: optimizing the %s", name)
        with self._eval():
            opt = optimize(self._step_module(), inputs, cuda_graphs=cuda_graphs, **options)
        self.stats["optimized"] += 1
        return opt

    def _decode_step(self, slot: DecodeState):
        """Optimize the decode step for this batch size and bind it to the state's tensors."""
        from .runtime.cuda_graphs import lower

        inputs = {"input_ids": slot.input_ids, "attention_mask": slot.attention_mask,
                  "position_ids": slot.position_ids if self._has_positions else None, "cache": slot.cache}
        # a meaningful example for the accuracy guard: a half-full cache of random keys/values
        # (optimize() runs on its own copies; generate() resets the position before use)
        past = self.max_length // 2
        gen = torch.Generator(device=self.device).manual_seed(0)
        for layer in slot.cache.layers:
            for t in (layer.keys, layer.values):
                t.copy_(torch.randn(t.shape, generator=gen, device=self.device, dtype=torch.float32).to(t.dtype))
            layer.cumulative_length.fill_(past)
        slot.position_ids.fill_(past)
        # planned for replay ("auto": a static-shape inference graph on a GPU is replayed, so the
        # passes price kernel launches as inside a CUDA graph); the generator's runner replays it
        opt = self._optimize(inputs, f"decode step (batch {slot.batch}, cache {self.max_length})",
                             cuda_graphs=self.cuda_graphs)
        flat, _ = pytree.tree_flatten(((), inputs))
        runner = lower(opt.graph_module, flat, cuda_graphs=self.cuda_graphs, reuse_outputs=True,
                       bind_inputs=True, backend=self.graph_backend)
        opt.report.notes.append(f"generation: {runner.decision.note()}")
        slot.module = opt
        call = runner.fixed_call(flat, ("decode", slot.batch), (), inputs)

        def step():
            # grad mode off whoever calls: a grad-enabled call would run the graph eagerly (the
            # runner replays only calls that record no autograd history)
            with torch.no_grad():
                return call()

        slot.step = step
        slot.runner = runner

    # ------------------------------------------------------------------ generate

    @torch.no_grad()
    def decode_state(self, batch: int) -> DecodeState:
        """The :class:`DecodeState` of ``batch`` rows; its decode step is optimized now if no
        generate() has used this batch size yet."""
        self._check_batch(batch)
        slot = self._state(batch)
        if slot.step is None:
            self._decode_step(slot)
        return slot

    def _check_batch(self, batch: int):
        if batch > self.max_batch_size:
            raise GenerationError(f"{batch} prompts but max_batch_size={self.max_batch_size}; "
                                  "build the generator with a larger max_batch_size or split the batch")

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[DecodeState, torch.Tensor]:
        """Start sequences: the prompts' keys/values written into the cache from position 0, the
        decode inputs set for the next token. Returns the batch's :class:`DecodeState` and the
        logits of the prompts' last position, [B, 1, V]."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
            raise GenerationError("input_ids must be an integer tensor [batch, prompt length]")
        batch, plen = input_ids.shape
        if batch < 1 or plen < 1:
            raise GenerationError(f"input_ids is empty: shape {tuple(input_ids.shape)}")
        if plen >= self.max_length:
            raise GenerationError(f"prompt length {plen} leaves no room in max_length={self.max_length}")
        ids = input_ids.to(self.device, torch.long)
        if attention_mask is None:
            mask = torch.ones_like(ids)
        else:
            if tuple(attention_mask.shape) != (batch, plen):
                raise GenerationError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected {(batch, plen)}")
            mask = attention_mask.to(self.device, torch.long)
        slot = self.decode_state(batch)
        for layer in slot.cache.layers:  # a fresh sequence: positions back to 0 (stale keys are masked)
            layer.cumulative_length.zero_()
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # HF's positions under left padding
        # the mask spans the whole static cache, as in the decode steps (positions after the prompt are
        # causally masked): a model that reads the keys' count from it (BLOOM's ALiBi) sees the cache's
        full = torch.ones(batch, self.max_length, dtype=torch.long, device=self.device)
        full[:, :plen] = mask
        kwargs = {"input_ids": ids, "attention_mask": full, "position_ids": pos if self._has_positions else None,
                  "cache": slot.cache}
        if self.prefill_mode == "eager":
            with self._eval():
                logits = self._step_module()(**kwargs)
        else:
            key = tuple(ids.shape)
            opt = slot.prefills.get(key)
            if opt is None:
                if len(slot.prefills) >= _PREFILL_SPECIALIZATIONS:
                    slot.prefills.popitem(last=False)
                opt = self._optimize(kwargs, f"prefill {key}", cuda_graphs=False)
                slot.prefills[key] = opt
            slot.prefills.move_to_end(key)
            logits = opt(**kwargs)
        self.stats["prefills"] += 1
        slot.attention_mask.fill_(1)
        slot.attention_mask[:, :plen] = mask
        slot.position_ids.copy_(pos[:, -1:] + 1)
        return slot, logits

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens=_UNSET, do_sample=_UNSET, temperature=_UNSET, top_k=_UNSET, top_p=_UNSET,
                 eos_token_id=_UNSET, pad_token_id=_UNSET, generator: torch.Generator | None = None) -> torch.LongTensor:
        """Prompt + generated ids, [B, P + n] (n <= max_new_tokens; fewer when every row ended
        with an EOS token), as ``model.generate`` returns them. An option not given comes from
        ``model.generation_config``; given as None it is off (as HF's update of the config)."""
        gc = getattr(self.model, "generation_config", None)

        def default(value, name, fallback=None):
            if value is _UNSET:
                value = getattr(gc, name, None) if gc is not None else None
            return fallback if value is None else value

        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
            raise GenerationError("input_ids must be an integer tensor [batch, prompt length]")
        batch, plen = input_ids.shape
        if batch < 1 or plen < 1:
            raise GenerationError(f"input_ids is empty: shape {tuple(input_ids.shape)}")
        self._check_batch(batch)
        max_new_tokens = default(max_new_tokens, "max_new_tokens")
        if max_new_tokens is None:
            total = default(_UNSET, "max_length")
            if total is None:  # transformers' default: 20 new tokens, at most max_position_embeddings in all
                total = plen + 20
                limit = getattr(self.model.config, "max_position_embeddings", None)
                total = min(total, limit) if isinstance(limit, int) else total
            if total <= plen:
                raise GenerationError(f"prompt length {plen} leaves no new token within max_length={total} (the model's "
                                      "generation_config or max_position_embeddings); pass max_new_tokens")
            max_new_tokens = total - plen
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if plen + max_new_tokens > self.max_length:
            raise GenerationError(f"prompt length {plen} + max_new_tokens {max_new_tokens} = {plen + max_new_tokens} "
                                  f"exceeds max_length={self.max_length}")
        do_sample = bool(default(do_sample, "do_sample", False))
        temperature = default(temperature, "temperature", 1.0)  # unset: as transformers samples, at 1.0
        top_k = default(top_k, "top_k")
        top_p = default(top_p, "top_p")
        if do_sample and (temperature is None or temperature <= 0):
            raise GenerationError(f"temperature must be > 0 for sampling, got {temperature!r}")
        if gc is not None:
            unsupported = _unsupported_options(gc)
            if unsupported:
                raise GenerationError(f"model.generation_config sets {', '.join(unsupported)}, which the generator "
                                      "does not apply; clear them or use model.generate")
        eos = default(eos_token_id, "eos_token_id")
        # an int, a list or a tensor of ids (as transformers takes them)
        eos = [] if eos is None else [int(e) for e in torch.as_tensor(eos).flatten().tolist()]
        pad = default(pad_token_id, "pad_token_id")
        pad = int(pad) if pad is not None else (eos[0] if eos else None)

        dev = self.device
        if attention_mask is None and pad is not None and pad not in eos and bool((input_ids == pad).any()):
            attention_mask = input_ids.ne(pad).long()  # as HF infers it from the pad token
        slot, logits = self.prefill(input_ids, attention_mask)
        out = torch.empty(batch, plen + max_new_tokens, dtype=torch.long, device=dev)
        out[:, :plen] = input_ids
        eos_t = torch.tensor(eos, dtype=torch.long, device=dev) if eos else None
        unfinished = torch.ones(batch, dtype=torch.long, device=dev)
        done = torch.zeros(max_new_tokens, dtype=torch.bool, device=dev)  # all rows finished after step i
        n = max_new_tokens
        for i in range(max_new_tokens):
            scores = logits[:, -1].to(dtype=torch.float32, copy=True)
            if do_sample:
                probs = torch.softmax(warp_logits(scores, temperature, top_k, top_p), dim=-1)
                tok = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
            else:
                tok = torch.argmax(scores, dim=-1)
            if eos_t is not None:
                tok = tok * unfinished + pad * (1 - unfinished)
                unfinished = unfinished & ~torch.isin(tok, eos_t)
                done[i] = unfinished.max() == 0
            out[:, plen + i] = tok
            if i == max_new_tokens - 1:
                break
            slot.input_ids.copy_(tok[:, None])
            logits = slot.step()  # writes the token's keys/values at the cache position, advances it
            self.stats["decode_steps"] += 1
            slot.position_ids.add_(1)
            # the previous step's flag, read while this step runs (one step of lag, no stall)
            if eos_t is not None and bool(done[i]):
                n = i + 1
                break
        return out[:, :plen + n]

    __call__ = generate

    @torch.no_grad()
    def hf_generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **generate_kwargs):
        """transformers' own ``model.generate`` (its loop, logits processors, stopping criteria,
        return types) driving this generator's cache and replayed decode steps: the model's
        forward is wrapped for the duration of the call so that one-token calls on the
        generator's cache run the optimized step (the inputs HF prepares copied into the step's
        tensors: ids, last position, the mask row of the new token), and every other call (the
        prefill) runs the model itself. HF's own compilation of the forward is turned off."""
        import functools

        from transformers.modeling_outputs import CausalLMOutputWithPast

        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise GenerationError("input_ids must be an integer tensor [batch, prompt length]")
        for bad in (self._cache_arg, "past_key_values", "cache_implementation"):
            if bad in generate_kwargs:
                raise GenerationError(f"{bad!r} is the generator's to choose")
        # transformers expands each prompt to max(num_beams, num_return_sequences) rows before the prefill:
        # the cache and the decode step are those of the expanded batch
        gc = generate_kwargs.get("generation_config") or getattr(self.model, "generation_config", None)
        expand = max(int(generate_kwargs.get(k, getattr(gc, k, None)) or 1) for k in ("num_beams", "num_return_sequences"))
        rows = input_ids.shape[0] * expand
        if expand > 1 and rows > self.max_batch_size:
            raise GenerationError(f"{input_ids.shape[0]} prompts x {expand} (num_beams / num_return_sequences) = {rows} "
                                  f"rows but max_batch_size={self.max_batch_size}")
        state = self.decode_state(rows)
        for layer in state.cache.layers:
            layer.cumulative_length.zero_()
        state.attention_mask.fill_(1)
        model, cache_arg = self.model, self._cache_arg
        original = model.forward
        # the tensors the decode step is bound to (beam search's reorder_cache gives a layer new ones)
        bound = [(layer, layer.keys, layer.values) for layer in state.cache.layers]

        @functools.wraps(original)
        def forward(*args, **kwargs):
            ids = kwargs.get("input_ids")
            if not args and kwargs.get(cache_arg) is state.cache and ids is not None:
                # a write past the cache's end fails in index_copy_ (on a GPU, a device-side fault): refused first.
                # The cache's own position (assisted decoding crops it back), read where HF's loop syncs anyway
                if int(state.cache.layers[0].cumulative_length) + ids.shape[1] > self.max_length:
                    raise GenerationError(f"hf_generate needs more than max_length={self.max_length} cache positions "
                                          f"(the prompt and the new tokens); ask for fewer new tokens or build the "
                                          "generator with a larger max_length")
            if args or kwargs.get(cache_arg) is not state.cache or ids is None or ids.shape[1] != 1:
                return original(*args, **kwargs)
            for layer, keys, values in bound:  # a replaced tensor copied back into the bound memory
                if layer.keys is not keys:
                    keys.copy_(layer.keys)
                    layer.keys = keys
                if layer.values is not values:
                    values.copy_(layer.values)
                    layer.values = values
            state.input_ids.copy_(ids)
            pos = kwargs.get("position_ids")
            if pos is not None:
                state.position_ids.copy_(pos[:, -1:])
            else:
                state.position_ids.copy_(state.cache.layers[0].cumulative_length)
            mask = kwargs.get("attention_mask")
            if isinstance(mask, dict):  # a model with config.layer_types: one 4-D mask per layer type
                # the full-attention layers' mask row is the padding (a sliding one also drops the keys
                # outside its window); with no full-attention layer each layer masks its window itself
                mask = mask.get("full_attention") if "full_attention" in mask else next(iter(mask.values()), None)
            if isinstance(mask, torch.Tensor) and mask.dim() == 4:  # HF's mask for a static cache: [B, 1, 1, max_length]
                row = mask[:, 0, -1, :]
                state.attention_mask.copy_(row == 0 if row.is_floating_point() else row)  # additive: 0 = attend
            elif isinstance(mask, torch.Tensor):  # 2D, one column per token so far
                state.attention_mask[:, :mask.shape[1]].copy_(mask)
            return CausalLMOutputWithPast(logits=state.step(), **{cache_arg: state.cache})

        model.forward = forward
        try:
            return model.generate(input_ids, attention_mask=attention_mask, **{cache_arg: state.cache},
                                  disable_compile=True, **generate_kwargs)
        finally:
            del model.forward
            for layer, keys, values in bound:
                layer.keys, layer.values = keys, values


def optimize_generation(model: nn.Module, *, max_batch_size: int, max_length: int, dtype=None, device=None,
                        **optimize_options) -> Generator:
    """A :class:`Generator` for ``model`` (a transformers decoder-only causal LM): a static KV
    cache of ``max_batch_size`` x ``max_length``, decode steps optimized by graphopt.optimize
    (``optimize_options``: its options, e.g. ``check_accuracy``, ``target``, ``precision``) and
    replayed as CUDA graphs on a GPU, and ``generate(input_ids, ...)`` returning ids as
    ``model.generate`` does. ``dtype``/``device``: run a converted copy of the model (the model
    itself is never changed). ``prefill``: "eager" or "graphopt" (module docstring)."""
    return Generator(model, max_batch_size=max_batch_size, max_length=max_length, dtype=dtype, device=device,
                     **optimize_options)
