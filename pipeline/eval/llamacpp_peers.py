"""llama-cpp-python's own speculation on the llama.cpp target's GGUF: the peers a llama.cpp user would switch on.

- `llama-pld`: `Llama(draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))`;
- `llama-draft`: `Llama(draft_model=GreedyDraft(<small GGUF>))`, a second, smaller model of the same vocabulary
  (Qwen2.5-Coder-0.5B for the 1.5B target) drafting `k` greedy tokens a step.
Both decode greedily (`temp=0`) through `Llama.generate`, which verifies the draft with `logits_all` (every position's
logits: the binding's rule whenever a draft model is set). Each request starts from an empty cache (`reset()`), like
`HFPeers`: their rows say `prefix_cache: false` and the report marks their end-to-end ratios. The row schema is
`HFPeers.generate`'s: prefill timed to the first new token, decode from there; `forwards` counts target evals.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


def _greedy_draft_class():
    from llama_cpp.llama_speculative import LlamaDraftModel

    class GreedyDraft(LlamaDraftModel):
        """A small GGUF proposing `k` greedy tokens; it keeps the KV of the longest prefix it shares with the target's
        tokens and evaluates only the rest (one token per step once it follows along)."""

        def __init__(self, gguf: str | Path, k: int = 8, n_ctx: int = 8192, threads: int = 1):
            import llama_cpp
            from llama_cpp import Llama

            self.lib, self.k = llama_cpp, k
            self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                             n_threads_batch=threads, verbose=False)

        def __call__(self, input_ids, /, **kwargs):
            llm, ids = self.llm, input_ids.tolist()
            n, limit = 0, min(llm.n_tokens, len(ids) - 1)  # at least one token evaluated: its logits draft
            while n < limit and int(llm.input_ids[n]) == ids[n]:
                n += 1
            llm.n_tokens = n
            llm.eval(ids[n:])
            out: list[int] = []
            vocab = llm.n_vocab()
            while True:
                logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
                out.append(int(logits.argmax()))
                if len(out) == self.k:
                    return np.array(out, dtype=np.intc)
                llm.eval(out[-1:])

    return GreedyDraft


class LlamaCppPeers:
    """llama-cpp-python's `Llama` with a draft model, per peer method, over the llama.cpp target's GGUF."""

    def __init__(self, target, draft_gguf: str | Path | None = None, pld_tokens: int = 10, draft_tokens: int = 8,
                 n_ctx: int = 4096):
        # n_ctx bounds prompt + output (the table's longest prompt is ~1,300 tokens); with a draft model the binding
        # keeps every position's logits (logits_all): n_ctx x vocabulary floats, 2.5 GB for Qwen2.5 at 4096
        self.target, self.draft_gguf = target, draft_gguf
        self.pld_tokens, self.draft_tokens, self.n_ctx = pld_tokens, draft_tokens, n_ctx
        self.llms: dict[str, object] = {}
        self.evals = 0

    def _llm(self, method: str):
        if method in self.llms:
            return self.llms[method]
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        threads = self.target.threads
        if method == "llama-pld":
            draft = LlamaPromptLookupDecoding(num_pred_tokens=self.pld_tokens)
        elif method == "llama-draft":
            if not self.draft_gguf:
                raise ValueError("method llama-draft needs a draft model GGUF (eval.assistant.path: its model folder, "
                                 "or eval.assistant.gguf)")
            draft = _greedy_draft_class()(self.draft_gguf, self.draft_tokens, self.n_ctx, threads)
        else:
            raise ValueError(f"unknown llama.cpp peer {method!r}; expected llama-pld or llama-draft")
        # logits_all=True explicitly: with a draft model the binding keeps every position's logits, but it sizes
        # that array by the logits_all argument (n_batch rows when false), which overflows past n_batch tokens
        llm = Llama(model_path=str(self.target.gguf), n_ctx=self.n_ctx, n_batch=512, n_threads=threads,
                    n_threads_batch=threads, draft_model=draft, logits_all=True, verbose=False)
        plain = llm.eval

        def counted(tokens):
            self.evals += 1
            plain(tokens)

        llm.eval = counted
        self.llms[method] = llm
        return llm

    def generate(self, request: dict, method: str, max_new_tokens: int) -> dict:
        """The peer on `request` from the whole prompt (an empty cache), greedy, until a stop id or the limit."""
        llm = self._llm(method)
        t0, c0 = time.perf_counter(), time.process_time()  # the request arrives
        prompt = self.target.prompt_ids(request)
        llm.reset()
        self.evals, new, first = 0, [], None
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if first is None:
                first = (time.perf_counter(), time.process_time(), self.evals)
            new.append(int(tok))
            if tok in self.target.stop_ids or len(new) >= max_new_tokens:
                break
        end, c_end = time.perf_counter(), time.process_time()
        t_first, c_first, _ = first or (end, c_end, 0)
        return {"token_ids": new, "text": self.target.decode([t for t in new if t not in self.target.stop_ids]),
                "wall_s": end - t0, "prefill_s": t_first - t0, "decode_s": end - t_first,
                "prefill_cpu_s": c_first - c0, "decode_cpu_s": c_end - c_first,
                "prefill_reused": False, "cached_tokens": 0, "prefix_cache": False,
                "forwards": max(self.evals - 1, 1), "new_tokens": len(new), "prompt_tokens": len(prompt)}


__all__ = ["LlamaCppPeers"]
