"""One runner of requests x methods with one row schema: `make eval`, scripts/bench_runtime.py and the runtime smoke.

The protocol, so that a speedup can be trusted:
- **same hardware**: every baseline (`ar`, `pld`, `toolspec`, `ooo-oracle`, the transformers peers) runs with every
  core the machine gives (schedule `all-cores`); `ooo` runs under each schedule asked for (`split`, `colocated`,
  `adaptive`, see runtime/schedule.py) on the same cores, and its rows carry the sidecar's CPU seconds;
- **warm**: every variant decodes the first request once, untimed, before any timed row (first-call costs of tree
  masks, `generate` set-up and the sidecar's model load are nobody's);
- **shuffled**: the variants run in an order shuffled per request with a fixed seed;
- **one clock**: every variant is timed from the request's arrival (templating and tokenization included) to its
  last token; prefill and decode are split where the prompt's forward ends (for the transformers peers, at the end
  of the target's first forward, which in assisted generation also verifies the first draft: their decode-phase
  figure is slightly flattered, their end-to-end figure is exact);
- the prefix cache (runtime/target.py) never offers a request its own prompt, so every variant of one request pays
  the same prefill.
A row: {key, run, target, benchmark, request_id, method, schedule, variant, text, token_digest, new_tokens,
forwards, accepted_lengths, tree_sizes, prefill_s, decode_s, wall_s, prompt_tokens, cached_tokens, hint_*, ...}.
"""

from __future__ import annotations

import hashlib
import random
import re
import time

from .runtime import Sidecar, generate
from .runtime.loop import METHOD_TABLE, Result
from .runtime.schedule import Schedule

PEERS = {
    "hf-pld": "transformers prompt-lookup decoding (prompt_lookup_num_tokens)",
    "hf-assisted": "transformers assisted generation with a small draft model (universal path across tokenizers)",
}
ALL_METHODS = tuple(METHOD_TABLE) + tuple(PEERS)


def variant(method: str, schedule: str) -> str:
    return method if schedule == "all-cores" else f"{method}@{schedule}"


def variants(methods: list[str], schedules: list[str]) -> list[tuple[str, str]]:
    """(method, schedule) pairs: sidecar methods once per schedule, every other method on all cores; ar first."""
    unknown = sorted(set(methods) - set(ALL_METHODS))
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; expected some of {ALL_METHODS}")
    out = [("ar", "all-cores")]
    for m in methods:
        if m == "ar":
            continue
        if m in METHOD_TABLE and METHOD_TABLE[m].sidecar:
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
        self.forwards, self.first_forward_end = 0, None
        target.model.register_forward_hook(lambda *a: self._count())
        self.assistant = self.assistant_tok = None
        if assistant_path:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from .hardware import torch_dtype

            self.assistant = AutoModelForCausalLM.from_pretrained(assistant_path, dtype=torch_dtype(dtype))
            self.assistant = self.assistant.to(target.device).eval()
            self.assistant_tok = AutoTokenizer.from_pretrained(assistant_path)
            self.same_vocab = self.assistant_tok.get_vocab() == target.tokenizer.get_vocab()

    def _count(self) -> None:
        self.forwards += 1
        if self.first_forward_end is None:
            self.first_forward_end = time.perf_counter()

    def generate(self, request: dict, method: str, max_new_tokens: int) -> dict:
        import torch

        t0 = time.perf_counter()  # the request arrives: templating and tokenization are timed, as for the runtime
        prompt = self.target.prompt_ids(request)
        ids = torch.tensor([prompt], device=self.target.device)
        stops = sorted(self.target.stop_ids)
        kw = dict(max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                  eos_token_id=stops, pad_token_id=self.target.tokenizer.pad_token_id or stops[0],
                  attention_mask=torch.ones_like(ids))
        if method == "hf-pld":
            kw["prompt_lookup_num_tokens"] = self.pld_tokens
        elif method == "hf-assisted":
            if self.assistant is None:
                raise ValueError("method hf-assisted needs an assistant model (eval.assistant.path)")
            kw["assistant_model"] = self.assistant
            if not self.same_vocab:
                kw["tokenizer"] = self.target.tokenizer
                kw["assistant_tokenizer"] = self.assistant_tok
        self.forwards, self.first_forward_end = 0, None
        with torch.no_grad():
            out = self.target.model.generate(ids, **kw)
        end = time.perf_counter()
        new = out[0, len(prompt):].tolist()
        prefill = (self.first_forward_end or end) - t0
        return {"token_ids": new, "text": self.target.decode([t for t in new if t not in self.target.stop_ids]),
                "wall_s": end - t0, "prefill_s": prefill, "decode_s": end - t0 - prefill,
                "forwards": max(self.forwards - 1, 1), "new_tokens": len(new), "prompt_tokens": len(prompt)}


class Runner:
    """Decodes requests with every (method, schedule) variant on one loaded target; yields rows.

    sidecar: {"factory": "module:function", "kwargs": {...}} built once per distinct set of sidecar cores (each
      schedule pins the worker itself through kwargs["cores"]), or {"wave": callable} for tests.
    """

    def __init__(self, target, methods: list[str], *, run: str = "run", schedules: list[str] | None = None,
                 sidecar: dict | None = None, peers: HFPeers | None = None, max_new_tokens: int = 256,
                 seed: int = 0, threads: int | None = None, sidecar_timeout_s: float = 60.0,
                 tree_budget: str = "auto"):
        self.target, self.run_name, self.max_new_tokens, self.seed = target, run, max_new_tokens, seed
        self.variants = variants(methods, schedules or ["adaptive"])
        self.schedules = {s: Schedule.on(s, threads) for s in {s for _, s in self.variants}}
        self.peers, self.tree_budget = peers, tree_budget
        self.sidecars: dict[tuple, Sidecar] = {}
        needs = [s for m, s in self.variants if m in METHOD_TABLE and METHOD_TABLE[m].sidecar]
        if needs and not sidecar:
            raise ValueError("method ooo needs a sidecar (eval.sidecar: model, adapter)")
        for name in needs:
            cores = tuple(self.schedules[name].sidecar_cores)
            if cores in self.sidecars:
                continue
            if "wave" in sidecar:
                self.sidecars[cores] = Sidecar(sidecar["wave"], timeout_s=sidecar_timeout_s)
            else:
                self.sidecars[cores] = Sidecar(factory=sidecar["factory"], start_method="spawn",
                                               timeout_s=sidecar_timeout_s,
                                               factory_kwargs={**sidecar.get("kwargs", {}), "cores": list(cores)})
            self.sidecars[cores]._ensure()  # load the sidecar model before any clock starts

    def sidecar_for(self, schedule: str) -> Sidecar | None:
        return self.sidecars.get(tuple(self.schedules[schedule].sidecar_cores))

    def warmup(self, request: dict, max_new_tokens: int = 16) -> None:
        """Every variant once, untimed; then the run's histories and acceptance statistics start empty."""
        for sc in self.sidecars.values():  # wait until each worker has loaded its model and answered one wave
            pending, t0 = sc.start(request), time.perf_counter()
            while pending.poll() is None and pending.error is None and time.perf_counter() - t0 < 600:
                time.sleep(0.05)
        for method, schedule in self.variants:
            self._decode(request, method, schedule, None, max_new_tokens)
        self.target.histories.clear()
        self.target.budgets.clear()

    def _decode(self, request: dict, method: str, schedule: str, ar: Result | None, max_new_tokens: int):
        sched = self.schedules[schedule]
        self.target.set_threads(sched.threads(None))
        if method in PEERS:
            return self.peers.generate(request, method, max_new_tokens)
        return generate(self.target, request, method, sidecar=self.sidecar_for(schedule),
                        oracle=ar if method == "ooo-oracle" else None, max_new_tokens=max_new_tokens,
                        schedule=sched, tree_budget=self.tree_budget, variant=variant(method, schedule))

    def order(self, request_id: str) -> list[tuple[str, str]]:
        order = list(self.variants)
        random.Random(f"{self.seed}|{request_id}").shuffle(order)
        return order

    def run(self, benchmark: str, request: dict, done: set[str] = frozenset()) -> list[dict]:
        """Rows for the variants of `request` not yet in `done` (keys), in this request's shuffled order."""
        rows, ar = [], None
        for method, schedule in self.order(request["id"]):
            key = f"{self.target.name}|{benchmark}|{request['id']}|{variant(method, schedule)}"
            if key in done:
                continue
            out = self._decode(request, method, schedule, ar, self.max_new_tokens)
            row = {"key": key, "run": self.run_name, "target": self.target.name, "benchmark": benchmark,
                   "request_id": request["id"], "method": method, "schedule": schedule,
                   "variant": variant(method, schedule), "threads": len(self.schedules[schedule].cores),
                   "gold": request.get("gold", []), "gold_accept": request.get("gold_accept")}
            if method in PEERS:
                row.update(text=out["text"], token_digest=token_digest(out["token_ids"], self.target.stop_ids),
                           new_tokens=out["new_tokens"], forwards=out["forwards"], accepted_lengths=[],
                           prefill_s=out["prefill_s"], decode_s=out["decode_s"], wall_s=out["wall_s"],
                           prompt_tokens=out["prompt_tokens"], cached_tokens=0)
            else:
                st = out.stats
                if method == "ar":
                    ar = out
                row.update(text=out.text, token_ids=out.token_ids,
                           token_digest=token_digest(out.token_ids, self.target.stop_ids),
                           new_tokens=st.new_tokens, forwards=st.forwards, accepted_lengths=st.accepted,
                           tree_sizes=st.tree_sizes, target_threads=st.threads, prefill_s=st.prefill_s,
                           decode_s=st.decode_s, wall_s=st.wall_s, overhead_s=st.overhead_s,
                           tree_nodes=st.tree_nodes, stop=st.stop, prompt_tokens=st.prompt_tokens,
                           cached_tokens=st.cached_tokens, draft_tokens=st.draft_tokens,
                           hint_ready_s=st.hint_ready_s, hint_tokens_accepted=st.hint_tokens,
                           hint_other_tokens=st.hint_other_tokens, payload_bytes=st.payload_bytes,
                           hint_error=st.hint_error, sidecar_cpu_s=st.sidecar_cpu_s)
                if method == "ar":
                    pieces = [self.target.decode([t]) for t in out.token_ids]
                    row["first_value_s"] = first_value_s(out.text, pieces, st.prefill_s, st.decode_s)
            rows.append(row)
        return rows

    def close(self) -> None:
        for sc in self.sidecars.values():
            sc.close()
        self.target.set_threads(len(Schedule.on("all-cores").cores))


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


__all__ = ["Runner", "HFPeers", "PEERS", "ALL_METHODS", "variants", "variant", "token_digest", "first_value_s",
           "first_difference"]
