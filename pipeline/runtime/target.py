"""The target model with its KV cache (batch 1, greedy): prefill, verify a token tree in one forward, keep a path.

transformers 5.24 facts this relies on (read from the installed source, checked by tests/runtime/test_target.py):
- model forward takes `cache=` (`past_key_values=` is a deprecated alias) and returns `.cache`;
- a 4-D `attention_mask` is used as-is by `create_causal_mask` (no packed-sequence detection, no causal merge);
- `DynamicCache.crop(-k)` drops the last k entries (a positive argument raises); layers expose `.keys` / `.values`
  shaped [batch, kv_heads, seq, head_dim].
Prefix cache across requests (what vLLM's automatic prefix caching does): after a prefill the prompt's KV entries are
kept in a bounded LRU store; the next request's prefill reuses the longest prompt prefix any stored entry shares
(system prompt, the same tools, an earlier turn) and computes only the rest. It serves every method alike; an entry
keyed by a request id is not offered to the same id again, so methods compared on one request pay the same prefill;
with a `PrefillMemo` (the eval) variants that prefill the same prompt on the same threads compute it once and are
each charged the measured time.
Custom 4-D masks work with the `eager` and `sdpa` attention implementations of Llama, Qwen2, Qwen3 and Gemma 3 (whose
sliding-window layers get the tree mask with the window applied, as a per-layer-type dict); other implementations
(flash-attention kernels take no arbitrary mask) fall back to verifying the best single chain.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import torch

from pipeline.requests import render_prompt

from .clock import Clock
from .verify import Tree, tree_mask, tree_positions

TREE_MASK_IMPLEMENTATIONS = ("eager", "sdpa")


def decoder_body(model):
    """The model without its output layer (a CausalLM's `get_decoder()`), or None where transformers cannot say."""
    try:
        body = model.get_decoder()
    except (AttributeError, ValueError, NotImplementedError):
        return None
    return body if isinstance(body, torch.nn.Module) and body is not model else None


def fill_cache(model, **inputs) -> None:
    """A forward whose only product is the KV entries it writes into `inputs["cache"]`: the decoder body alone.

    A prefill never reads its logits, and the output layer is a small model's largest matrix (SmolLM2-135M: 49,152 x
    576, 21% of the weights), read in full even for one position; on the sidecar `logits_to_keep=1` also ran as a
    batched [1, 1, H] @ [1, H, V] that first copied the transposed embedding (scripts/bench_wave.py, one thread:
    1.92 -> 1.83 s per wave). On the 1.5B target the difference is not measurable (scripts/bench_prefill.py
    --output-layer). Models whose decoder transformers cannot name keep the whole forward with one position's logits."""
    body = decoder_body(model)
    if body is None:
        whole_forward(model, **inputs)
    else:
        body(**inputs, use_cache=True)


@contextmanager
def layer_hooks(model, call):
    """Within it, `call()` runs before every decoder layer's forward (a pre-hook on each module of the decoder body's
    `layers`); nothing where `call` is None or the model's layers cannot be named."""
    body = decoder_body(model)
    layers = getattr(body if body is not None else getattr(model, "model", None), "layers", None)
    if call is None or not isinstance(layers, torch.nn.ModuleList):
        yield
        return
    hooks = [layer.register_forward_pre_hook(lambda module, args: call()) for layer in layers]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def whole_forward(model, **inputs) -> None:
    """The whole model on `inputs`, one position's logits: how every prefill ran before `fill_cache`."""
    model(**inputs, use_cache=True, logits_to_keep=1)


@contextmanager
def output_layer_prefill():
    """Within it, `fill_cache` is `whole_forward`: the benchmarks' before/after (scripts/bench_prefill.py
    --output-layer, scripts/bench_wave.py --methods wave-head)."""
    global fill_cache
    plain = fill_cache
    fill_cache = whole_forward
    try:
        yield
    finally:
        fill_cache = plain


def encode(tokenizer, text: str) -> list[int]:
    """Text -> ids without special-token decoration (the fast backend directly: ~2x faster than the wrapper)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


def decode(tokenizer, ids: list[int]) -> str:
    """Ids -> text, special tokens kept, no clean-up (the fast backend directly: ~20x faster than the wrapper)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode(ids, skip_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


class PrefixCache:
    """Bounded LRU store of prompt KV caches: (tokens, per-layer keys/values). Longest shared prefix wins.

    `key`: the request's id (a request never reuses its own entry). `salt`: entries are shared only between requests
    with the same salt (vLLM's `cache_salt`): a server salts by tenant, so a client cannot time whether another one
    sent the same system prompt and tools."""

    def __init__(self, max_tokens: int = 32768, min_tokens: int = 16):
        self.max_tokens, self.min_tokens = max_tokens, min_tokens
        self.entries: list[tuple[tuple[int, ...], str | None, str | None, list]] = []  # most recently used last

    def lookup(self, ids: list[int], key: str | None = None, salt: str | None = None) -> tuple[int, list | None]:
        """(shared prefix length, the entry's per-layer (keys, values)) of the best entry; (0, None) if none pays."""
        best, best_i = 0, -1
        for i, (toks, k, s, _) in enumerate(self.entries):
            if (key is not None and k == key) or s != salt:
                continue
            n, limit = 0, min(len(toks), len(ids))
            while n < limit and toks[n] == ids[n]:
                n += 1
            if n > best:
                best, best_i = n, i
        if best < self.min_tokens:
            return 0, None
        entry = self.entries.pop(best_i)
        self.entries.append(entry)
        return best, entry[3]

    def store(self, ids: list[int], key: str | None, cache, salt: str | None = None) -> None:
        if len(ids) < self.min_tokens or len(ids) > self.max_tokens:
            return
        toks = tuple(ids)
        for e in [e for e in self.entries if (e[0], e[2]) == (toks, salt)]:
            self.entries.remove(e)
            self.dropped(e[3])
        self.entries.append((toks, key, salt, self.kept(ids, cache)))
        while sum(len(e[0]) for e in self.entries) > self.max_tokens:
            self.dropped(self.entries.pop(0)[3])

    def kept(self, ids: list[int], cache):
        """What an entry holds of `cache` for `ids`: here copies of the per-layer keys/values (a backend whose KV
        lives elsewhere, e.g. llama.cpp's sequences, overrides this and `dropped`)."""
        return [(layer.keys[..., :len(ids), :].clone(), layer.values[..., :len(ids), :].clone())
                for layer in cache.layers]

    def dropped(self, held) -> None:
        """An entry's `kept` value leaves the store (evicted, replaced or cleared)."""

    def clear(self) -> None:
        for e in self.entries:
            self.dropped(e[3])
        self.entries.clear()


class PrefillMemo:
    """One request's measured prefills, so that variants doing the same work pay one measured prefill (the eval).

    Keyed by (request key, prompt ids, torch threads): the first prefill of a request on n threads is computed and
    timed; a later one with the same key, ids and threads restores its KV (the tensors are shared: the cache only ever
    grows by concatenation, never in place) and is charged the measured seconds and CPU seconds. Holds one request's
    entries (a new key drops the old ones), so memory stays at a few prompt caches."""

    def __init__(self):
        self.key = None
        self.entries: dict[tuple, dict] = {}
        self.hits = 0

    def get(self, key, ids: list[int], threads: int) -> dict | None:
        return self.entries.get((tuple(ids), threads)) if key is not None and key == self.key else None

    def put(self, key, ids: list[int], threads: int, cache, seconds: float, cpu_s: float, cached: int) -> None:
        if key is None:
            return
        if key != self.key:
            self.clear()
            self.key = key
        old = self.entries.get((tuple(ids), threads))
        if old is not None:
            self.dropped(old["state"])
        self.entries[(tuple(ids), threads)] = {"state": self.kept(ids, cache), "seconds": seconds, "cpu_s": cpu_s,
                                               "cached": cached}

    def kept(self, ids: list[int], cache):
        """What an entry holds of `cache`: the per-layer (keys, values) tensors themselves (a llama.cpp target keeps
        a KV sequence instead and overrides this and `dropped`)."""
        return [(layer.keys, layer.values) for layer in cache.layers]

    def dropped(self, state) -> None:
        """An entry's `kept` value is forgotten (a new request's key, or `clear`)."""

    def clear(self) -> None:
        for entry in self.entries.values():
            self.dropped(entry["state"])
        self.key, self.entries = None, {}


def sliding_window(config) -> int | None:
    """The window of a model whose layers include sliding-window attention (Gemma 3: 5 of every 6), else None."""
    types = getattr(config, "layer_types", None) or ()
    return int(config.sliding_window) if "sliding_attention" in types and getattr(config, "sliding_window", None) else None


def window_mask(mask: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """A tree mask [1, 1, T, past + T] with a sliding window on top: a query at position p sees a key at position k
    only when p - k < window (transformers' sliding-window rule), cache key i being at position i, a tree key at its
    node's position."""
    n = positions.shape[-1]
    past = mask.shape[-1] - n
    q = positions[0][:, None]
    k = torch.cat([torch.arange(past, device=positions.device), positions[0]])[None, :]
    return mask.masked_fill((q - k >= window)[None, None], torch.finfo(mask.dtype).min)


class Target:
    """A causal LM + tokenizer + one DynamicCache. Not thread-safe; one request at a time."""

    def __init__(self, model, tokenizer, tree: bool | None = None, name: str | None = None,
                 chat_template_kwargs: dict | None = None, prefix_cache: bool | int = True):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})  # e.g. Qwen3's enable_thinking
        self.name = name or getattr(model.config, "_name_or_path", "") or model.config.model_type
        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        self.tree = (impl in TREE_MASK_IMPLEMENTATIONS) if tree is None else tree
        self.device = next(model.parameters()).device
        self.clock = Clock(self.device)  # prefill / verify / keep end synchronized: the loop's timestamps see the work
        self.dtype = next(model.parameters()).dtype
        self.stop_ids = self._stop_ids()
        self.window = sliding_window(model.config)  # Gemma 3's sliding layers: the tree mask needs the window too
        self.cache = None
        # prefix_cache: True (32k tokens), a token budget, or False (off)
        self.prefix_cache = None if not prefix_cache else PrefixCache(32768 if prefix_cache is True else int(prefix_cache))
        self.cached_tokens = 0  # prompt tokens the last prefill took from the prefix cache
        self.memo: PrefillMemo | None = None  # set by the eval's runner: variants doing the same work prefill once
        self.last_prefill: dict = {}  # the last prefill: seconds charged, spent, cpu_s, reused (from the memo)
        self.curve = None       # CostCurve after calibrate(): the tree budget's cost of k tree tokens
        self.budgets: dict[str, object] = {}  # method -> TreeBudget (acceptance statistics of this run)
        self.histories: dict[str, object] = {}  # method -> History, earlier calls of this run (ToolSpec retrieval)

    @classmethod
    def load(cls, path: str | Path, dtype: str = "auto", device: str = "cpu", attn: str | None = None,
             **kwargs) -> Target:
        """From a model folder; dtype "auto" = bf16 where native (GPU, AVX-512 BF16 / AMX), else float32."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from pipeline.hardware import torch_dtype

        kw = {"dtype": torch_dtype(dtype, device)}
        if attn:
            kw["attn_implementation"] = attn
        model = AutoModelForCausalLM.from_pretrained(str(path), **kw).to(device)
        return cls(model, AutoTokenizer.from_pretrained(str(path)), name=Path(path).name, **kwargs)

    def calibrate(self, past: int = 512, reps: int = 3, cache: bool = True):
        """Measure (or load from the per-machine JSON cache) what one forward of k tree tokens costs here."""
        from pipeline.hardware import machine

        from .budget import CostCurve

        key = {"machine": machine(), "model": self.name, "layers": self.model.config.num_hidden_layers,
               "hidden": self.model.config.hidden_size, "dtype": str(self.dtype), "device": str(self.device),
               "threads": torch.get_num_threads(), "past": past}
        self.curve = CostCurve.cached(self, key, past, reps) if cache else CostCurve.measure(self, past, reps)
        self.budgets.clear()
        return self.curve

    def _stop_ids(self) -> set[int]:
        from pipeline.requests import stop_token_ids

        return set(stop_token_ids(self.tokenizer, getattr(self.model, "generation_config", None)))

    # --- tokens ---------------------------------------------------------------------------------------------------
    def prompt_ids(self, request: dict) -> list[int]:
        return encode(self.tokenizer, render_prompt(self.tokenizer, request, self.chat_template_kwargs))

    def decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids)

    # --- cache ----------------------------------------------------------------------------------------------------
    def past(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    @torch.inference_mode()
    def prefill(self, ids: list[int], key: str | None = None, reuse: bool = False, prefix_cache: bool = True,
                chunk: int | None = None, between=None, salt: str | None = None, inside=None) -> float:
        """Start a new request: fill a fresh cache with `ids` (the prompt minus its last token), reusing the longest
        prefix the prefix cache holds (not one stored under the same `key`); returns the seconds it is charged.

        reuse: take this request's earlier measured prefill on the same threads from `self.memo` (restored KV,
          charged its measured seconds; `last_prefill["spent"]` says what the restore really took).
        prefix_cache: false neither reads nor stores the prefix cache (the cost curve's synthetic prompt).
        salt: the prefix cache's partition (`PrefixCache`): only entries stored with the same salt are reused.
        chunk: feed the uncached prompt in chunks of this many tokens (None: one forward), or a callable asked for
          each chunk's size (after `between()`); `between()` is called before every chunk after the first (the
          adaptive schedule sets the thread count there, so the target gets every core back as soon as the wave
          answers, mid-prefill). Chunked and whole prefill give the same cache.
        inside: called before every decoder layer of every chunk's forward (`layer_hooks`): where the schedule gives
          the target every core back between two layers of one forward, no chunk has to end first."""
        from transformers import DynamicCache

        t0, c0 = self.clock.now(), time.process_time()
        threads = torch.get_num_threads()
        # A sliding-window model (Gemma 3) keeps every entry in its sliding layers too: the cache is cut and reordered
        # by position (crop, keep), and the window is a mask (`logits`), as the model's own masks make it.
        self.cache = DynamicCache() if self.window else DynamicCache(config=self.model.config)
        hit = self.memo.get(key, ids, threads) if reuse and self.memo is not None else None
        if hit is not None:
            for i, (k, v) in enumerate(hit["state"]):
                self.cache.update(k, v, i)
            self.cached_tokens = hit["cached"]
            self.memo.hits += 1
            self.last_prefill = {"seconds": hit["seconds"], "cpu_s": hit["cpu_s"], "reused": True,
                                 "spent": self.clock.now() - t0}
            return hit["seconds"]
        store = self.prefix_cache if prefix_cache else None
        done, layers = store.lookup(ids, key, salt) if store is not None else (0, None)
        if layers is not None:
            done = min(done, len(ids))
            for i, (k, v) in enumerate(layers):
                self.cache.update(k[..., :done, :], v[..., :done, :], i)
        self.cached_tokens = done
        size = chunk if callable(chunk) else (lambda: chunk)
        start = done
        with layer_hooks(self.model, inside):
            while start < len(ids):
                if between is not None and start > done:
                    between()
                step = size()
                end = min(start + max(int(step), 1), len(ids)) if step else len(ids)
                x = torch.tensor([ids[start:end]], device=self.device)
                pos = torch.arange(start, end, device=self.device)[None]
                fill_cache(self.model, input_ids=x, position_ids=pos, cache=self.cache)
                start = end
        if store is not None and ids:
            store.store(ids, key, self.cache, salt)
        seconds, cpu_s = self.clock.now() - t0, time.process_time() - c0
        if reuse and self.memo is not None:
            self.memo.put(key, ids, threads, self.cache, seconds, cpu_s, done)
        self.last_prefill = {"seconds": seconds, "cpu_s": cpu_s, "reused": False, "spent": seconds}
        return seconds

    def set_threads(self, n: int) -> None:
        """Intra-op threads for the next forwards (the adaptive schedule changes it at round boundaries)."""
        if n >= 1 and torch.get_num_threads() != n:
            torch.set_num_threads(n)

    @torch.inference_mode()
    def logits(self, tree: Tree) -> torch.Tensor:
        """One forward over the tree's tokens after the cache; logits [T, vocab]. The cache grows by T entries."""
        past = self.past()
        x = torch.tensor([tree.tokens], device=self.device)
        if tree.is_chain():  # the ordinary causal mask is the tree mask of a chain
            out = self.model(input_ids=x, cache=self.cache, use_cache=True)
        else:
            if not self.tree:
                raise ValueError(f"target {self.name} cannot verify a tree (attention {self.model.config._attn_implementation})")
            mask = tree_mask(tree.parents, past, self.dtype, self.device)
            pos = tree_positions(tree.depths, past, self.device)
            if self.window:  # a 4-D mask is used as-is by every layer: the sliding layers get theirs with the window
                mask = {"full_attention": mask,
                        "sliding_attention": window_mask(mask, pos, self.window)}
            out = self.model(input_ids=x, attention_mask=mask, position_ids=pos, cache=self.cache, use_cache=True)
        return out.logits[0]

    def verify(self, tree: Tree) -> list[int]:
        """The target's greedy next token after every node of the tree (one forward), the device synchronized."""
        out = self.logits(tree).argmax(-1).tolist()
        self.clock.sync()  # `tolist` waited for the argmax; this also waits for the cache writes of the forward
        return out

    def drop(self, n: int) -> None:
        """Forget the last `n` cache entries (the cost curve rewinds after each timed forward)."""
        self.cache.crop(-n)

    def make_memo(self) -> PrefillMemo:
        """A fresh `PrefillMemo` for this target (the eval's runner sets one per run)."""
        return PrefillMemo()

    @torch.inference_mode()
    def keep(self, tree_len: int, nodes: list[int]) -> None:
        """After a verify of `tree_len` nodes, keep only the root's and `nodes`' entries (in that order)."""
        past = self.past() - tree_len
        keep = [0] + list(nodes)
        if keep == list(range(len(keep))):
            self.cache.crop(-(tree_len - len(keep)))  # a chain prefix: just drop the tail (a view: no device work)
            return
        idx = torch.tensor(keep, device=self.device) + past
        for layer in self.cache.layers:
            layer.keys = torch.cat([layer.keys[..., :past, :], layer.keys.index_select(-2, idx)], dim=-2)
            layer.values = torch.cat([layer.values[..., :past, :], layer.values.index_select(-2, idx)], dim=-2)
        self.clock.sync()  # the copies are this round's work, not the next verify's
