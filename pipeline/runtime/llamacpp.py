"""The target on llama.cpp (llama-cpp-python's low-level API over a GGUF): the loop's `TargetBackend` on CPU kernels
that run a quantized model 7x faster than transformers' float32 on an AVX2 machine (issue #44).

How the loop's operations map onto llama.cpp's KV cache (one context, `kv_unified`, so sequences share cells):
- sequence 0 holds the request: the prompt and the committed output;
- **verify(tree)**: one `llama_decode` of the tree's tokens, each node at position past + depth and in the sequences
  of the leaves below it (the first leaf is sequence 0, the others borrow tree sequences that were given the prefix
  by `llama_memory_seq_cp`, which only tags cells); llama.cpp masks a token by its first sequence, a leaf below it,
  so every node sees the prefix, its ancestors and itself: the tree mask. Logits are asked for the tree's nodes only
  (a prefill asks for none), and every node's argmax is read (the loop's acceptance may walk to any of them);
- **keep(len, path)**: the cells of the root and the accepted path stay in sequence 0 (copied from the leaf's
  sequence where the path left the first leaf), every tree sequence is emptied, so rejected cells are freed;
- **prefix cache** across requests (`SeqPrefixCache`, the LRU rules of `PrefixCache`): an entry is a sequence that
  shares the prompt's cells (`seq_cp`, no copy); a hit copies the entry's first n positions back into sequence 0 and
  prefills the rest. The eval's `PrefillMemo` keeps a request's prefill the same way (`SeqMemo`);
- **threads**: `llama_set_n_threads` before a decode, so the adaptive schedule works between prefill chunks. There is
  no per-layer hook in the binding, so `inside` is asked before every chunk instead of before every layer.
Tokenization is the matching checkpoints/base/<model> folder's transformers tokenizer, so prompt ids, drafters and
stop ids are the transformers target's; the GGUF's own vocabulary is only checked to cover those ids.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import numpy as np

from pipeline.requests import render_prompt

from .target import PrefillMemo, PrefixCache, decode, encode
from .verify import Tree

MAIN = 0                # the request's sequence
TREE_SEQS = 64          # sequences 1..63 carry a verified tree's other leaves
STORE_SEQS = 64         # sequences 64..127 hold prefix-cache and memo entries
LOG_ERROR = 4           # ggml_log_level: only errors reach stderr

_log_callback = None    # the ctypes callback must outlive every call into llama.cpp


def _quiet(llama_cpp) -> None:
    """llama.cpp prints every model load and decode detail to stderr; keep its errors only."""
    global _log_callback
    if _log_callback is None:
        def log(level, text, _user):
            if level == LOG_ERROR and text:
                os.write(2, text)
        _log_callback = llama_cpp.llama_log_callback(log)
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))


class SeqPrefixCache(PrefixCache):
    """`PrefixCache` whose entries are llama.cpp sequences sharing the stored prompt's KV cells."""

    def __init__(self, target: LlamaCppTarget, max_tokens: int, min_tokens: int = 16):
        super().__init__(max_tokens, min_tokens)
        self.target = target

    def store(self, ids: list[int], key: str | None, cache, salt: str | None = None) -> None:
        """An entry of the same tokens and salt is kept (moved to the most recent end, under the new key), not
        replaced: dropping its sequence and copying sequence 0 anew gave a later reuse logits off by ~0.017 on the
        tiny GGUF (tests/runtime/test_llamacpp.py; cause not found in llama.cpp's cell bookkeeping yet)."""
        same = [e for e in self.entries if (e[0], e[2]) == (tuple(ids), salt)]
        if same:
            self.entries.remove(same[0])
            self.entries.append((same[0][0], key, salt, same[0][3]))
            return
        super().store(ids, key, cache, salt)

    def kept(self, ids: list[int], cache) -> int | None:
        while not self.target.free_seqs and self.entries:
            self.dropped(self.entries.pop(0)[3])  # no sequence left: the least recently used entry goes
        return self.target.save_seq(len(ids))

    def dropped(self, held) -> None:
        self.target.release_seq(held)


class SeqMemo(PrefillMemo):
    """`PrefillMemo` whose entries are llama.cpp sequences holding the request's measured prefill."""

    def __init__(self, target: LlamaCppTarget):
        super().__init__()
        self.target = target

    def kept(self, ids: list[int], cache) -> int | None:
        return self.target.save_seq(len(ids))

    def dropped(self, state) -> None:
        self.target.release_seq(state)


class LlamaCppTarget:
    """A GGUF in one llama.cpp context + the base folder's tokenizer. Not thread-safe; one request at a time."""

    tree = True
    backend = "llamacpp"

    def __init__(self, gguf: str | Path, tokenizer, generation_config=None, name: str | None = None,
                 chat_template_kwargs: dict | None = None, prefix_cache: bool | int = True, n_ctx: int = 16384,
                 n_batch: int = 512, threads: int | None = None):
        import llama_cpp

        from pipeline.requests import stop_token_ids

        self.lib, self.gguf = llama_cpp, Path(gguf)
        if not self.gguf.is_file():
            raise FileNotFoundError(f"{self.gguf}: no GGUF file (make models keeps it in checkpoints/.downloads/)")
        _quiet(llama_cpp)
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(str(self.gguf).encode(), mp)
        if not self.model:
            raise ValueError(f"{self.gguf}: llama.cpp could not load this GGUF")
        self.threads = int(threads or len(os.sched_getaffinity(0)))
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, n_batch
        cp.n_seq_max, cp.kv_unified = TREE_SEQS + STORE_SEQS, True
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise ValueError(f"{self.gguf}: llama.cpp could not create a context of {n_ctx} tokens")
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        if len(tokenizer) > self.n_vocab:
            raise ValueError(f"{self.gguf}: its vocabulary has {self.n_vocab} tokens, the tokenizer "
                             f"{getattr(tokenizer, 'name_or_path', '')} {len(tokenizer)}: not the same model")
        self.n_batch = n_batch
        self.max_context = n_ctx // 2  # a prompt's limit: the other half holds prefix entries, output and trees
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, TREE_SEQS)
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.name = name or self.gguf.stem
        self.stop_ids = set(stop_token_ids(tokenizer, generation_config))
        self.free_seqs = list(range(TREE_SEQS, TREE_SEQS + STORE_SEQS))
        self.n_past = 0
        self.tree_seqs: list[int] = []   # the last verify's leaf sequences (0 first)
        self.leaf_of: list[int] = []     # node -> index of the first leaf below it
        self.prefix_cache = None if not prefix_cache else SeqPrefixCache(
            self, n_ctx // 2 if prefix_cache is True else int(prefix_cache))
        self.cached_tokens = 0
        self.memo: PrefillMemo | None = None
        self.last_prefill: dict = {}
        self.curve = None
        self.budgets: dict[str, object] = {}
        self.histories: dict[str, object] = {}

    @classmethod
    def load(cls, gguf: str | Path, tokenizer_path: str | Path, **kwargs) -> LlamaCppTarget:
        """The GGUF with the tokenizer (and generation config) of the matching model folder."""
        from transformers import AutoTokenizer, GenerationConfig

        try:
            gen = GenerationConfig.from_pretrained(str(tokenizer_path))
        except OSError:
            gen = None
        return cls(gguf, AutoTokenizer.from_pretrained(str(tokenizer_path)), gen, **kwargs)

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.lib.llama_model_free(self.model)
            self.ctx = self.model = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the library may already be gone
            pass

    def calibrate(self, past: int = 512, reps: int = 3, cache: bool = True):
        """Measure (or load from the per-machine JSON cache) what one verify of k tree tokens costs here."""
        from pipeline.hardware import machine

        from .budget import CostCurve

        key = {"backend": "llamacpp", "machine": machine(), "model": self.name, "gguf_bytes": self.gguf.stat().st_size,
               "threads": self.threads, "past": past}
        self.curve = CostCurve.cached(self, key, past, reps) if cache else CostCurve.measure(self, past, reps)
        self.budgets.clear()
        return self.curve

    def make_memo(self) -> SeqMemo:
        return SeqMemo(self)

    # --- tokens ---------------------------------------------------------------------------------------------------
    def prompt_ids(self, request: dict) -> list[int]:
        return encode(self.tokenizer, render_prompt(self.tokenizer, request, self.chat_template_kwargs))

    def decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids)

    # --- sequences ------------------------------------------------------------------------------------------------
    def save_seq(self, n: int) -> int | None:
        """A free store sequence given sequence 0's first `n` positions (shared cells); None when none is free."""
        if not self.free_seqs:
            return None
        seq = self.free_seqs.pop()
        self.lib.llama_memory_seq_cp(self.mem, MAIN, seq, 0, n)
        return seq

    def release_seq(self, seq: int | None) -> None:
        if seq is not None and seq not in self.free_seqs:
            self.lib.llama_memory_seq_rm(self.mem, seq, -1, -1)
            self.free_seqs.append(seq)

    def _clear_tree(self) -> None:
        for seq in self.tree_seqs[1:]:
            self.lib.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self.tree_seqs, self.leaf_of = [], []

    def past(self) -> int:
        return self.n_past

    def set_threads(self, n: int) -> None:
        """Threads of the next decodes (the adaptive schedule changes it between chunks and rounds)."""
        if n >= 1 and n != self.threads:
            self.threads = n
            self.lib.llama_set_n_threads(self.ctx, n, n)

    def _decode(self, tokens: list[int], positions: list[int], seqs: list[list[int]], logits: bool) -> None:
        """One llama_decode of at most n_batch tokens; where the KV cells run out, prefix entries are evicted."""
        b = self.batch
        for i, (tok, pos, ss) in enumerate(zip(tokens, positions, seqs)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, len(ss), logits
            for j, s in enumerate(ss):
                b.seq_id[i][j] = s
        b.n_tokens = len(tokens)
        while True:
            ret = self.lib.llama_decode(self.ctx, b)
            if ret == 0:
                return
            if ret == 1 and self.prefix_cache is not None and self.prefix_cache.entries:
                self.prefix_cache.dropped(self.prefix_cache.entries.pop(0)[3])  # make room and try again
                continue
            raise RuntimeError(f"{self.gguf.name}: llama_decode returned {ret} for {len(tokens)} tokens at position "
                               f"{positions[0]} (1: the context of {self.lib.llama_n_ctx(self.ctx)} tokens is full)")

    # --- prefill --------------------------------------------------------------------------------------------------
    def prefill(self, ids: list[int], key: str | None = None, reuse: bool = False, prefix_cache: bool = True,
                chunk: int | None = None, between=None, salt: str | None = None, inside=None) -> float:
        """Start a new request: sequence 0 = `ids` (the prompt minus its last token); the arguments and the charged
        seconds are `Target.prefill`'s. Chunks are at most n_batch tokens; `between()` runs before every chunk after
        the first, `inside()` before every chunk (no per-layer hook in llama.cpp's binding)."""
        t0, c0 = time.perf_counter(), time.process_time()
        self._clear_tree()
        self.lib.llama_memory_seq_rm(self.mem, MAIN, -1, -1)
        self.n_past = 0
        hit = self.memo.get(key, ids, self.threads) if reuse and self.memo is not None else None
        if hit is not None and hit["state"] is not None:
            self.lib.llama_memory_seq_cp(self.mem, hit["state"], MAIN, -1, -1)
            self.n_past, self.cached_tokens = len(ids), hit["cached"]
            self.memo.hits += 1
            self.last_prefill = {"seconds": hit["seconds"], "cpu_s": hit["cpu_s"], "reused": True,
                                 "spent": time.perf_counter() - t0}
            return hit["seconds"]
        threads = self.threads
        store = self.prefix_cache if prefix_cache else None
        done, seq = store.lookup(ids, key, salt) if store is not None else (0, None)
        if seq is None:
            done = 0
        else:
            done = min(done, len(ids))
            self.lib.llama_memory_seq_cp(self.mem, seq, MAIN, 0, done)
        self.cached_tokens = self.n_past = done
        size = chunk if callable(chunk) else (lambda: chunk)
        while self.n_past < len(ids):
            if between is not None and self.n_past > done:
                between()
            if inside is not None:
                inside()
            step = size()
            end = min(self.n_past + min(int(step) if step else len(ids), self.n_batch), len(ids))
            part = ids[self.n_past:end]
            self._decode(part, list(range(self.n_past, end)), [[MAIN]] * len(part), logits=False)
            self.n_past = end
        if store is not None and ids:
            store.store(ids, key, self, salt)
        seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        if reuse and self.memo is not None:
            self.memo.put(key, ids, threads, self, seconds, cpu_s, done)
        self.last_prefill = {"seconds": seconds, "cpu_s": cpu_s, "reused": False, "spent": seconds}
        return seconds

    # --- rounds ---------------------------------------------------------------------------------------------------
    def logits(self, tree: Tree) -> np.ndarray:
        """One decode over the tree's tokens after sequence 0; logits [T, vocab] (float32). The cache grows by T."""
        self._clear_tree()
        n = len(tree)
        if n > self.n_batch:
            raise ValueError(f"a tree of {n} nodes exceeds n_batch {self.n_batch}")
        has_child = [False] * n
        for p in tree.parents[1:]:
            has_child[p] = True
        leaves = [i for i in range(n) if not has_child[i]]
        if len(leaves) > TREE_SEQS:
            raise ValueError(f"a tree with {len(leaves)} leaves exceeds the {TREE_SEQS} tree sequences")
        self.tree_seqs = [MAIN] + list(range(1, len(leaves)))
        for seq in self.tree_seqs[1:]:  # every leaf's sequence starts from the committed prefix (shared cells)
            self.lib.llama_memory_seq_cp(self.mem, MAIN, seq, -1, -1)
        seqs: list[list[int]] = [[] for _ in range(n)]
        self.leaf_of = [-1] * n
        for j, leaf in enumerate(leaves):
            node = leaf
            while node >= 0:
                seqs[node].append(self.tree_seqs[j])
                if self.leaf_of[node] < 0:
                    self.leaf_of[node] = j
                node = tree.parents[node]
        past = self.n_past
        self._decode(tree.tokens, [past + d for d in tree.depths], seqs, logits=True)
        self.n_past = past + n
        out = self.lib.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(out, shape=(n, self.n_vocab)).copy()

    def verify(self, tree: Tree) -> list[int]:
        """The target's greedy next token after every node of the tree (one decode)."""
        return self.logits(tree).argmax(-1).tolist()

    def keep(self, tree_len: int, nodes: list[int]) -> None:
        """After a verify of `tree_len` nodes, keep only the root's and `nodes`' entries (in that order)."""
        past = self.n_past - tree_len
        end = past + 1 + len(nodes)
        leaf = self.leaf_of[nodes[-1] if nodes else 0]
        seq = self.tree_seqs[leaf]
        if seq == MAIN:  # the path lies on sequence 0's own leaf: drop its tail
            self.lib.llama_memory_seq_rm(self.mem, MAIN, end, -1)
        else:            # the path left it: sequence 0 takes the path's cells from that leaf's sequence
            self.lib.llama_memory_seq_rm(self.mem, MAIN, past, -1)
            self.lib.llama_memory_seq_cp(self.mem, seq, MAIN, past, end)
        self._clear_tree()
        self.n_past = end

    def drop(self, n: int) -> None:
        """Forget the last `n` entries (the cost curve rewinds after each timed verify)."""
        self._clear_tree()
        self.n_past -= n
        self.lib.llama_memory_seq_rm(self.mem, MAIN, self.n_past, -1)


__all__ = ["LlamaCppTarget", "SeqPrefixCache", "SeqMemo"]
