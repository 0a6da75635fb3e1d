"""vLLM's engine under `make serve`: the same OpenAI server (pipeline/serve), vLLM decoding, the proposer drafting.

A serve recipe with `backend: vllm` (recipes/serve/qwen2.5-coder-1.5b-vllm-cpu.yaml) builds a `VllmTarget`: vLLM's
`LLMEngine` with the `OooProposer` inside (method ooo, toolspec or pld; `ar` runs the engine without speculation),
and a `Frontend` whose wave service is the sidecar. The server's worker thread calls `VllmTarget.generate` for one
request at a time, exactly where it would call the runtime's `generate`: the request is registered on the hint
board (its wave starts), submitted to the engine, stepped until it ends (each step's new tokens go to `on_commit`, so
streaming, cancellation and deadlines work as with the runtime), then unregistered. The tenant's history is the
proposer's, keyed by the request's cache salt (the tenant), so one client's calls never draft another's.
The process runs in vLLM's environment (`.venv-vllm`); the wave service in the project's (`Frontend`).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path

from ..methods import METHOD_TABLE
from ..requests import render_prompt, stop_token_ids
from ..runtime.loop import Result, Stats
from ..runtime.target import decode, encode
from .frontend import Frontend

log = logging.getLogger("pipeline.serve")


class VllmTarget:
    """What the server's engine needs of a target (tokenizer, stop ids, prompt ids, decode), over vLLM's engine."""

    backend = "vllm"

    def __init__(self, path: str, *, method: str, sidecar: dict | None, dtype: str, k: int = 16,
                 min_p: float = 0.05, chat_template_kwargs: dict | None = None, engine_kwargs: dict | None = None,
                 max_context: int | None = None):
        from transformers import AutoTokenizer, GenerationConfig
        from vllm import EngineArgs, LLMEngine

        from ..vllm_engine import engine_settings

        self.path, self.method, self.name = path, method, Path(path).name
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.stop_ids = set(stop_token_ids(self.tokenizer, GenerationConfig.from_pretrained(path)))
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.histories, self.budgets, self.memo, self.curve = {}, {}, None, None  # the runtime's, unused here
        self.front = Frontend(sidecar if METHOD_TABLE[method].sidecar else None)
        kwargs, env, self.settings = engine_settings({"enable_prefix_caching": True, **(engine_kwargs or {})}, {})
        os.environ.update(env)
        if METHOD_TABLE[method].drafters:
            kwargs.update(self.front.engine_kwargs(k, min_p, self.chat_template_kwargs))
            kwargs["per_request_spec_decode_metrics"] = "summary"  # verify steps and accepted tokens per request
        self.max_context = max_context or int(kwargs.pop("max_model_len", 8192))
        self.engine = LLMEngine.from_engine_args(EngineArgs(
            model=path, tokenizer=path, dtype=dtype, seed=0, max_model_len=self.max_context,
            disable_log_stats=False, **kwargs))
        self._ids = itertools.count()
        log.info("vLLM engine for %s: method %s, settings %s", path, method, self.settings)

    # --- what the server reads ---------------------------------------------------------------------------------
    def prompt_ids(self, request: dict) -> list[int]:
        return encode(self.tokenizer, render_prompt(self.tokenizer, request, self.chat_template_kwargs))

    def decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids)

    def set_threads(self, n: int) -> None:
        """vLLM binds its own threads (pipeline/vllm_engine.py)."""

    def status(self) -> dict:
        proc = self.front.proc
        return {"engine": "vllm", "settings": self.settings,
                "wave_service": None if self.front.sidecar is None else
                ("up" if proc is not None and proc.poll() is None else "down"),
                "wave_restarts": max(self.front.restarts, 0)}

    # --- one request -------------------------------------------------------------------------------------------
    def generate(self, target, request: dict, method: str, *, max_new_tokens: int = 256, on_commit=None,
                 tenant: str = "", **_) -> Result:
        """The runtime's `generate` contract on vLLM's engine: greedy tokens, `on_commit` after every step with the
        tokens it committed (raising there aborts the request), a `Result` with the runtime's `Stats`. `tenant`
        names the history the proposer drafts from (one per tenant)."""
        from vllm import SamplingParams

        t0 = time.perf_counter()
        prompt = target.prompt_ids(request)  # `target` may add the server's forced prefix (Prompted)
        stats = Stats(method, prompt_tokens=len(prompt))
        rid = self.front.start_request(request, prompt, method, tenant=tenant) if method != "ar" else None
        req_id = f"serve-{next(self._ids)}"
        self.engine.add_request(req_id, {"prompt_token_ids": prompt},
                                SamplingParams(temperature=0.0, max_tokens=max_new_tokens,
                                               stop_token_ids=sorted(self.stop_ids)))
        ids: list[int] = []
        first_at, out, hint = None, None, None
        arrived = time.time()
        try:
            while True:
                for o in self.engine.step():
                    if o.request_id != req_id:
                        continue
                    out = o
                    new = list(o.outputs[0].token_ids)[len(ids):]
                    if new:
                        first_at = first_at or time.perf_counter()
                        ids += new
                        if on_commit is not None:
                            on_commit(new)
                if out is not None and out.finished:
                    break
        except BaseException:
            self.engine.abort_request([req_id])
            raise
        finally:
            if rid is not None:
                hint = self.front.board.hint(rid)  # when the wave answered (or why it did not)
                self.front.stop_request(rid, ids)
        end = time.perf_counter()
        seq = out.outputs[0]
        spec = seq.spec_decode_metrics.to_dict() if getattr(seq, "spec_decode_metrics", None) else {}
        stats.new_tokens = len(ids)
        stats.forwards = 1 + spec["num_spec_steps"] if spec else len(ids)
        stats.draft_tokens = spec.get("num_accepted_draft_tokens", 0)
        stats.prefill_s = (first_at or end) - t0
        stats.decode_s, stats.wall_s = end - (first_at or end), end - t0
        stats.cached_tokens = out.num_cached_tokens or 0
        stats.stop = "eos" if ids and ids[-1] in self.stop_ids else "length"
        if hint is not None:
            stats.hint_ready_s = max(0.0, hint["ready_wall"] - arrived) if hint.get("payload") is not None else None
            stats.hint_error, stats.sidecar_cpu_s = hint.get("error"), hint.get("cpu_s")
        elif METHOD_TABLE[method].sidecar:
            stats.hint_error = "sidecar: no hint before the answer ended"
        # stats.hint_tokens stays 0: the proposer counts them at its next engine step, after this answer has gone
        body = ids[:-1] if ids and ids[-1] in self.stop_ids else ids
        return Result(self.decode(body), ids, stats)

    def close(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            try:
                engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - shutting down: the process goes anyway
                log.exception("vLLM engine shutdown")
        self.front.close()


__all__ = ["VllmTarget"]
