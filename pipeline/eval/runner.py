"""One runner of requests x methods with one row schema: `make eval`, scripts/bench_runtime.py and the runtime smoke.

The protocol, so that a speedup can be trusted:
- **same hardware**: every baseline (`ar`, `pld`, `toolspec`, `ooo-oracle`, the transformers peers) runs with every
  core the machine gives (schedule `all-cores`); `ooo` runs under each schedule asked for (`split`, `colocated`,
  `adaptive`, `sequential`, `deferred`, see runtime/schedule.py) on the same cores, and its rows carry the sidecar's
  CPU seconds;
- **warm**: every variant decodes the first request once, untimed, before any timed row (first-call costs of tree
  masks, `generate` set-up and the sidecar's model load are nobody's);
- **shuffled**: the variants run in an order shuffled per request with a fixed seed;
- **one clock**: every variant is timed from the request's arrival (templating and tokenization included) to its
  last token; prefill and decode are split where the prompt's forward ends (for the transformers peers, at their
  first new token);
- **prefill once**: variants that prefill the same prompt on the same threads with no wave beside them (`ar`, `pld`,
  `toolspec`, `ooo-oracle`) share one measured prefill per request (its KV restored, its seconds and CPU seconds
  charged to each) and the same prefix cache, which never offers a request its own prompt, and so does `ooo` under
  `deferred` (its wave starts after the prefill); other `ooo` variants prefill themselves beside (or after) their
  wave. The transformers peers prefill the whole prompt themselves, without the prefix cache (their candidate
  generation does not continue from a prefilled cache: `HFPeers.generate`); their rows say `prefix_cache: false` and
  the report marks their end-to-end ratios;
- **busy rows**: each row records the machine's load, steal and busy CPU seconds around it (`measured`), so the
  report can flag rows that shared the cores with another job;
- `ooo-oracle`'s hint is the same request's `ar` output (`ar` runs first when the shuffle put it later).
A row: {key, run, target, benchmark, request_id, method, schedule, variant, text, token_digest, new_tokens,
forwards, accepted_lengths, tree_sizes, prefill_s, decode_s, wall_s, prompt_tokens, cached_tokens, hint_*, ...}.
"""

from __future__ import annotations

import functools
import hashlib
import random
import re
import time

from ..hardware import cpu_sample, cpu_usage
from ..runtime import Sidecar, generate, warm_up
from ..runtime.families import tokenizer_family
from ..runtime.hint import call_formats, opening_matches
from ..methods import ALL_METHODS, PEERS, uses_sidecar, variant
from ..runtime.schedule import WAVE_CHUNK, Schedule
from ..runtime.sidecar_client import SidecarLoadError


def variants(methods: list[str], schedules: list[str]) -> list[tuple[str, str]]:
    """(method, schedule) pairs: sidecar methods once per schedule, every other method on all cores; ar first."""
    unknown = sorted(set(methods) - set(ALL_METHODS))
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; expected some of {ALL_METHODS}")
    out = [("ar", "all-cores")]
    for m in methods:
        if m == "ar":
            continue
        if uses_sidecar(m):
            out += [(m, s) for s in schedules]
        else:
            out.append((m, "all-cores"))
    return out


def token_digest(ids: list[int], stop_ids: set[int]) -> str:
    """Digest of the output tokens without a trailing stop token (runtimes differ in whether they keep it)."""
    ids = list(ids)
    while ids and ids[-1] in stop_ids:
        ids.pop()
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:16]


def target_call_format(target, request: dict, text: str) -> dict:
    """For an `ar` row: the target's family, vocabulary size and template call format, and whether the hint's first
    rendering of the gold call (the first call format) starts with the token the target wrote first."""
    formats = call_formats(target.tokenizer, getattr(target, "chat_template_kwargs", None))
    gold = (request.get("gold") or [None])[0]
    return {"family": tokenizer_family(target.tokenizer).name, "vocab_size": len(target.tokenizer),
            "call_format": f"{formats[0].prefix!r} {formats[0].args_key}",
            "hint_opening_match": opening_matches(target.tokenizer, gold, formats[0], text) if gold else None}


def first_value_s(text: str, token_texts: list[str], prefill_s: float, decode_s: float) -> float | None:
    """When the target starts writing its first argument value, estimated from an `ar` decode (even token pace)."""
    m = re.search(r'"(?:arguments|parameters)"\s*:\s*\{\s*"[^"]*"\s*:\s*', text)
    if not m or not token_texts:
        return None
    pos, n = 0, 0
    while n < len(token_texts) and pos < m.end():
        pos += len(token_texts[n])
        n += 1
    return prefill_s + decode_s * n / len(token_texts)


class HFPeers:
    """transformers' own speculative decoding on the same loaded target (prompt lookup, assisted generation)."""

    def __init__(self, target, assistant_path: str | None = None, dtype: str = "auto", pld_tokens: int = 10):
        self.target, self.pld_tokens = target, pld_tokens
        self.forwards = 0
        target.model.register_forward_hook(lambda *a: self._count())
        self.assistant = self.assistant_tok = None
        if assistant_path:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from ..hardware import torch_dtype

            self.assistant = AutoModelForCausalLM.from_pretrained(assistant_path, dtype=torch_dtype(dtype))
            self.assistant = self.assistant.to(target.device).eval()
            self.assistant_tok = AutoTokenizer.from_pretrained(assistant_path)
            self.same_vocab = self.assistant_tok.get_vocab() == target.tokenizer.get_vocab()

    def _count(self) -> None:
        self.forwards += 1

    def generate(self, request: dict, method: str, max_new_tokens: int) -> dict:
        """The peer on `request`, from the whole prompt: its own prefill, without the runtime's prefix cache.

        transformers' candidate-based generation (prompt lookup, assisted) does not continue correctly from a cache
        filled beforehand: with the runtime's prefilled cache (or a plain DynamicCache of the prompt) its output
        differs from greedy decoding from the first token (transformers 5.25; plain `generate` continues fine, and
        tests/test_runner.py checks the peers against `ar` on a context-sensitive target). So the peers pay a
        whole prefill; the row says so (`prefix_cache: false`) and the report marks their end-to-end ratios. The
        prefill is timed to the first new token (a streamer), the decode from there on."""
        import torch

        from ..runtime.clock import clock_of

        clock = clock_of(self.target)  # on a GPU: every timestamp after the queued kernels have finished
        t0 = clock.now()  # the request arrives: templating and tokenization are timed, as for the runtime
        c0 = time.process_time()
        prompt = self.target.prompt_ids(request)
        ids = torch.tensor([prompt], device=self.target.device)
        stops = sorted(self.target.stop_ids)
        first = _FirstToken(clock)
        kw = dict(max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                  eos_token_id=stops, pad_token_id=self.target.tokenizer.pad_token_id or stops[0],
                  attention_mask=torch.ones_like(ids), streamer=first)
        if method == "hf-pld":
            kw["prompt_lookup_num_tokens"] = self.pld_tokens
        elif method == "hf-assisted":
            if self.assistant is None:
                raise ValueError("method hf-assisted needs an assistant model (eval.assistant.path)")
            kw["assistant_model"] = self.assistant
            if not self.same_vocab:
                kw["tokenizer"] = self.target.tokenizer
                kw["assistant_tokenizer"] = self.assistant_tok
        self.forwards = 0
        with torch.no_grad():
            out = self.target.model.generate(ids, **kw)
        end, c_end = clock.now(), time.process_time()
        t_first = first.at if first.at is not None else end
        c_first = first.cpu if first.cpu is not None else c_end
        new = out[0, len(prompt):].tolist()
        return {"token_ids": new, "text": self.target.decode([t for t in new if t not in self.target.stop_ids]),
                "wall_s": end - t0, "prefill_s": t_first - t0, "decode_s": end - t_first,
                "prefill_cpu_s": c_first - c0, "decode_cpu_s": c_end - c_first,
                "prefill_reused": False, "cached_tokens": 0, "prefix_cache": False,
                "forwards": max(self.forwards, 1), "new_tokens": len(new), "prompt_tokens": len(prompt)}


class _FirstToken:
    """A `generate` streamer that notes when the first new token came out (the prompt is its first `put`)."""

    def __init__(self, clock=None):
        self.puts, self.at, self.cpu, self.clock = 0, None, None, clock

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = self.clock.now() if self.clock is not None else time.perf_counter()
            self.cpu = time.process_time()

    def end(self) -> None:
        pass


def worker_cpu_s(sidecar) -> float | None:
    """CPU seconds a sidecar's worker process has used so far (every wave, finished or abandoned)."""
    pid = sidecar.pid() if sidecar is not None else None
    if pid is None:
        return None
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except Exception:  # noqa: BLE001 - no psutil, or the worker just died: not measured
        return None


class Runner:
    """Decodes requests with every (method, schedule) variant on one loaded target; yields rows.

    sidecar: {"factory": "module:function", "kwargs": {...}}: one worker per schedule (pinned by kwargs["cores"]), so
      a variant never inherits another variant's wave; or {"wave": callable} for tests.
    prefill_once: variants that prefill the same prompt on the same threads with no wave beside them (every method
      without a sidecar, the transformers peers included) compute one prefill per request and are each charged its
      measured seconds and CPU seconds, `ooo@deferred` too (its wave starts after the prefill); other `ooo` variants
      prefill themselves (their wave shares the cores or goes first).
    """

    def __init__(self, target, methods: list[str], *, run: str = "run", schedules: list[str] | None = None,
                 sidecar: dict | None = None, peers: HFPeers | None = None, max_new_tokens: int = 256,
                 seed: int = 0, threads: int | None = None, sidecar_timeout_s: float = 60.0,
                 tree_budget: str = "auto", prefill_once: bool = True, prefill_chunk: int | None = None,
                 wave_chunk: int = WAVE_CHUNK, layer_switch: bool = False):
        from ..runtime.target import PrefillMemo

        self.target, self.run_name, self.max_new_tokens, self.seed = target, run, max_new_tokens, seed
        self.variants = variants(methods, schedules or ["adaptive"])
        self.schedules = {s: Schedule.on(s, threads, wave_chunk=wave_chunk, layer_switch=layer_switch)
                          for s in {s for _, s in self.variants}}
        self.peers, self.tree_budget, self.prefill_once = peers, tree_budget, prefill_once
        self.prefill_chunk = prefill_chunk
        if prefill_once:  # a target with its own KV store (llama.cpp) makes its own memo
            target.memo = target.make_memo() if hasattr(target, "make_memo") else PrefillMemo()
        self.sidecars: dict[str, Sidecar] = {}
        needs = [s for m, s in self.variants if uses_sidecar(m)]
        if needs and not sidecar:
            raise ValueError("method ooo needs a sidecar (eval.sidecar: model, adapter)")
        for name in needs:
            cores = list(self.schedules[name].sidecar_cores)
            if "wave" in sidecar:
                self.sidecars[name] = Sidecar(sidecar["wave"], timeout_s=sidecar_timeout_s)
            else:
                self.sidecars[name] = Sidecar(factory=sidecar["factory"], start_method="spawn",
                                              timeout_s=sidecar_timeout_s,
                                              factory_kwargs={**sidecar.get("kwargs", {}), "cores": cores})
        try:
            for sc in self.sidecars.values():
                sc.wait_loaded()  # the model loads before any clock starts; one that cannot load fails the run
        except Exception:
            self.close()
            raise

    def sidecar_for(self, schedule: str) -> Sidecar | None:
        return self.sidecars.get(schedule)

    def warmup(self, request: dict, max_new_tokens: int = 16) -> None:
        """Every variant once, untimed (`ar` first: the oracle's hint); then the run's histories, acceptance
        statistics and memo start empty (`pipeline.runtime.warm_up`)."""
        done: dict = {}

        def decode(method: str, schedule: str):
            out = self._decode(request, method, schedule, done.get("ar"), max_new_tokens)
            done.setdefault(method, out)

        for schedule, sc in self.sidecars.items():  # a wave that raises or kills its worker here would do so on
            pending = sc.start(request)                  # every row: `ooo` measured as `toolspec` without saying so
            pending.wait()                               # (an answer without a call, e.g. null, is a model's answer)
            if pending.error is not None and (not sc.alive() or pending.error.startswith("sidecar wave failed")):
                raise SidecarLoadError(f"ooo@{schedule}: the sidecar on device {sc.device()} failed its warm-up "
                                       f"wave: {pending.error}")
        warm_up(self.target, request, [functools.partial(decode, m, s) for m, s in self.variants])

    def _decode(self, request: dict, method: str, schedule: str, ar, max_new_tokens: int):
        sched = self.schedules[schedule]
        self.target.set_threads(sched.threads(None))
        # the same prefill work shares one measured prefill: every method but a wave-beside-prefill one (`deferred`
        # starts its wave after the prefill, so its prefill is the baselines' own)
        reuse = self.prefill_once and (not uses_sidecar(method) or sched.deferred)
        if method in PEERS:
            return self.peers.generate(request, method, max_new_tokens)
        return generate(self.target, request, method, sidecar=self.sidecar_for(schedule),
                        oracle=ar if method == "ooo-oracle" else None, max_new_tokens=max_new_tokens,
                        schedule=sched, tree_budget=self.tree_budget, variant=variant(method, schedule),
                        reuse_prefill=reuse, prefill_chunk=self.prefill_chunk)

    def order(self, request_id: str) -> list[tuple[str, str]]:
        """The variants in this request's shuffled order; `ar` moves to just before `ooo-oracle` when the shuffle put
        it later (the oracle's hint is the same request's `ar` output, timed as any row)."""
        order = list(self.variants)
        random.Random(f"{self.seed}|{request_id}").shuffle(order)
        ar, oracle = ("ar", "all-cores"), ("ooo-oracle", "all-cores")
        if oracle in order and order.index(ar) > order.index(oracle):
            order.remove(ar)
            order.insert(order.index(oracle), ar)
        return order

    def key(self, benchmark: str, request: dict, method: str, schedule: str) -> str:
        return f"{self.target.name}|{benchmark}|{request['id']}|{variant(method, schedule)}"

    def run(self, benchmark: str, request: dict, done: set[str] | dict[str, dict] = frozenset()) -> list[dict]:
        """Rows for the variants of `request` not yet in `done` (keys, or rows by key), in this request's shuffled
        order. A finished `ar` row (from `done` rows) is the oracle's hint; without it `ar` runs again, untimed."""
        rows, ar = [], None
        ar_key = self.key(benchmark, request, "ar", "all-cores")
        if isinstance(done, dict) and ar_key in done:
            ar = done[ar_key]["text"]
        for method, schedule in self.order(request["id"]):
            key = self.key(benchmark, request, method, schedule)
            if key in done:
                continue
            if method == "ooo-oracle" and ar is None:  # ar finished in an earlier run that kept no text
                ar = self._decode(request, "ar", "all-cores", None, self.max_new_tokens)
            worker = self.sidecar_for(schedule) if uses_sidecar(method) else None
            before, w0 = cpu_sample(), worker_cpu_s(worker)
            out = self._decode(request, method, schedule, ar, self.max_new_tokens)
            usage = cpu_usage(before, cpu_sample())
            w1 = worker_cpu_s(worker)
            usage["sidecar_cpu_s"] = w1 - w0 if w0 is not None and w1 is not None else None
            row = {"key": key, "run": self.run_name, "target": self.target.name,
                   "backend": getattr(self.target, "backend", "transformers"), "benchmark": benchmark,
                   "request_id": request["id"], "method": method, "schedule": schedule,
                   "variant": variant(method, schedule), "threads": len(self.schedules[schedule].cores),
                   "gold": request.get("gold", []), "gold_accept": request.get("gold_accept")}
            if method in PEERS:
                row.update(text=out["text"], token_digest=token_digest(out["token_ids"], self.target.stop_ids),
                           new_tokens=out["new_tokens"], forwards=out["forwards"], accepted_lengths=[],
                           prefill_s=out["prefill_s"], decode_s=out["decode_s"], wall_s=out["wall_s"],
                           prefill_cpu_s=out["prefill_cpu_s"], decode_cpu_s=out["decode_cpu_s"],
                           prefill_reused=out["prefill_reused"], prompt_tokens=out["prompt_tokens"],
                           cached_tokens=out["cached_tokens"], prefix_cache=out["prefix_cache"])
            else:
                st = out.stats
                if method == "ar":
                    ar = out
                row.update(text=out.text, token_ids=out.token_ids,
                           token_digest=token_digest(out.token_ids, self.target.stop_ids),
                           new_tokens=st.new_tokens, forwards=st.forwards, accepted_lengths=st.accepted,
                           tree_sizes=st.tree_sizes, target_threads=st.threads, prefill_s=st.prefill_s,
                           decode_s=st.decode_s, wall_s=st.wall_s, overhead_s=st.overhead_s,
                           prefill_cpu_s=st.prefill_cpu_s, decode_cpu_s=st.decode_cpu_s,
                           prefill_reused=st.prefill_reused,
                           tree_nodes=st.tree_nodes, stop=st.stop, prompt_tokens=st.prompt_tokens,
                           cached_tokens=st.cached_tokens, draft_tokens=st.draft_tokens,
                           hint_ready_s=st.hint_ready_s, hint_tokens_accepted=st.hint_tokens,
                           hint_shared_tokens=st.hint_shared_tokens,
                           hint_other_tokens=st.hint_other_tokens, payload_bytes=st.payload_bytes,
                           hint_error=st.hint_error, sidecar_cpu_s=st.sidecar_cpu_s)
                if method == "ar":
                    row.update(target_call_format(self.target, request, out.text))
                    pieces = [self.target.decode([t]) for t in out.token_ids]
                    row["first_value_s"] = first_value_s(out.text, pieces, st.prefill_s, st.decode_s)
            # the machine while this row ran: measured wall/CPU (a reused prefill is not in them), load and steal
            row["measured"] = usage
            rows.append(row)
        return rows

    def close(self) -> None:
        for sc in self.sidecars.values():
            sc.close()
        self.target.set_threads(len(Schedule.on("all-cores").cores))


__all__ = ["Runner", "HFPeers", "PEERS", "ALL_METHODS", "variants", "variant", "token_digest", "first_value_s"]
