"""The `eval` stage: targets x benchmarks x methods through the runtime, beside transformers' own speculation.

Run as: python -m pipeline.stages.eval --recipe recipes/eval/cpu.yaml [eval.key=value ...]     (`make eval`)

For every target, every benchmark's test requests (with an optional limit) are decoded with every method; one row
per (target, benchmark, request, method) is appended to `eval/results/<run>/rows.jsonl` (a rerun skips finished
rows), then the report (`pipeline.report`) is rendered from the rows. Methods: the runtime's `ar`, `pld`,
`toolspec`, `ooo` (with the sidecar wave in its own process), `ooo-oracle`, and two external peers in the same
process on the same target: transformers' prompt-lookup decoding (`hf-pld`) and assisted generation with a small
draft model (`hf-assisted`; the universal path with `assistant_tokenizer` when the tokenizers differ). Every
method's output is compared with `ar`'s token by token.

Placement on CPU: `split` pins the target to all cores but one and the sidecar to the last core (the analogue of
the paper's separate GPUs); `colocated` lets both use every core. `ar` always runs with the target's cores.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

from ..io import InputError, ResumableJsonl, read_jsonl, write_manifest
from ..recipes import load_recipe, section
from ..sidecar.factory import FACTORY

RUNTIME_METHODS = ("ar", "pld", "toolspec", "ooo", "ooo-oracle")
PEER_METHODS = ("hf-pld", "hf-assisted")
KNOWN = {"run", "out", "requests_root", "split", "benchmarks", "targets", "methods", "sidecar", "assistant",
         "placement", "max_new_tokens", "hf_pld_tokens", "threads", "sidecar_timeout_s", "warmup"}
DEFAULTS = {"out": "eval/results", "requests_root": "data/requests", "split": "test", "placement": "split",
            "max_new_tokens": 256, "hf_pld_tokens": 10, "threads": None, "sidecar_timeout_s": 60.0,
            "methods": list(RUNTIME_METHODS + PEER_METHODS), "sidecar": None, "assistant": None, "warmup": True}


def token_digest(ids: list[int], stop_ids: set[int]) -> str:
    """Digest of the output tokens without a trailing stop token (runtimes differ in whether they keep it)."""
    ids = list(ids)
    while ids and ids[-1] in stop_ids:
        ids.pop()
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:16]


def round_robin(requests: dict[str, list[dict]]) -> list[tuple[str, dict]]:
    """(benchmark, request) pairs taking one request of each benchmark in turn."""
    from itertools import zip_longest

    rows = zip_longest(*[[(b, r) for r in reqs] for b, reqs in requests.items()])
    return [pair for row in rows for pair in row if pair is not None]


def placement_cores(placement: str, threads: int | None = None) -> tuple[list[int], list[int]]:
    """(target cores, sidecar cores) for a placement."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if threads:
        cores = cores[:threads]
    if placement == "split" and len(cores) >= 2:
        return cores[:-1], cores[-1:]
    if placement in ("split", "colocated"):
        return cores, cores
    raise InputError(f"eval.placement: {placement!r}; expected 'split' or 'colocated'")


def pin(cores: list[int]) -> None:
    import torch

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


def first_value_s(text: str, token_texts: list[str], prefill_s: float, decode_s: float) -> float | None:
    """When the target starts writing its first argument value, estimated from an `ar` decode (even token pace)."""
    import re

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

    def __init__(self, target, assistant_path: str | None, dtype: str, pld_tokens: int):
        import torch

        self.target, self.pld_tokens = target, pld_tokens
        self.forwards = 0
        target.model.register_forward_hook(lambda *a: self._count())
        self.assistant = self.assistant_tok = None
        if assistant_path:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            self.assistant = AutoModelForCausalLM.from_pretrained(assistant_path, dtype=getattr(torch, dtype))
            self.assistant = self.assistant.to(target.device).eval()
            self.assistant_tok = AutoTokenizer.from_pretrained(assistant_path)
            self.same_vocab = self.assistant_tok.get_vocab() == target.tokenizer.get_vocab()

    def _count(self) -> None:
        self.forwards += 1

    def generate(self, request: dict, method: str, max_new_tokens: int) -> dict:
        import torch

        prompt = self.target.prompt_ids(request)
        ids = torch.tensor([prompt], device=self.target.device)
        kw = dict(max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                  eos_token_id=sorted(self.target.stop_ids), pad_token_id=self.target.tokenizer.pad_token_id
                  or sorted(self.target.stop_ids)[0], attention_mask=torch.ones_like(ids))
        if method == "hf-pld":
            kw["prompt_lookup_num_tokens"] = self.pld_tokens
        elif method == "hf-assisted":
            if self.assistant is None:
                raise InputError("method hf-assisted needs eval.assistant.path (a small draft model)")
            kw["assistant_model"] = self.assistant
            if not self.same_vocab:
                kw["tokenizer"] = self.target.tokenizer
                kw["assistant_tokenizer"] = self.assistant_tok
        self.forwards = 0
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.target.model.generate(ids, **kw)
        wall = time.perf_counter() - t0
        new = out[0, len(prompt):].tolist()
        return {"token_ids": new, "text": self.target.tokenizer.decode(new, skip_special_tokens=False),
                "wall_s": wall, "forwards": max(self.forwards - 1, 1), "new_tokens": len(new)}


def load_requests(cfg: dict) -> dict[str, list[dict]]:
    out = {}
    for bench, limit in (cfg["benchmarks"] or {}).items():
        path = Path(cfg["requests_root"]) / bench / f"{cfg['split']}.jsonl"
        if not path.is_file():
            raise InputError(f"{path}: requests not found (run `make data` first, or fix eval.benchmarks)")
        reqs = read_jsonl(path)
        # A limit takes evenly spaced requests, so every subset (e.g. BFCL Java and JavaScript, API-Bank levels 1
        # and 2) is represented in proportion; the choice is deterministic.
        out[bench] = reqs[:: max(len(reqs) // limit, 1)][:limit] if limit else reqs
    return out


def run(cfg: dict, recipe: dict) -> Path:
    from ..runtime import Sidecar, Target, generate
    from ..runtime.loop import Result

    run_dir = Path(cfg["out"]) / cfg["run"]
    methods = list(cfg["methods"])
    unknown = sorted(set(methods) - set(RUNTIME_METHODS) - set(PEER_METHODS))
    if unknown:
        raise InputError(f"eval.methods: unknown {unknown}; expected some of {RUNTIME_METHODS + PEER_METHODS}")
    if "ar" not in methods:
        methods.insert(0, "ar")
    requests = load_requests(cfg)
    target_cores, sidecar_cores = placement_cores(cfg["placement"], cfg["threads"])
    sc = cfg.get("sidecar") or None
    if "ooo" in methods and not sc:
        raise InputError("eval.methods has 'ooo' but eval.sidecar is not set (model, adapter)")
    writer = ResumableJsonl(run_dir / "rows.jsonl", key="key")
    done = writer.done_ids()
    inputs = [Path(cfg["requests_root"]) / b / f"{cfg['split']}.jsonl" for b in requests]
    write_manifest(run_dir, "eval", recipe, inputs, extra={"placement": {"mode": cfg["placement"],
                   "target_cores": target_cores, "sidecar_cores": sidecar_cores}})
    try:
        for tcfg in cfg["targets"]:
            tname = tcfg["name"]
            # Round-robin over benchmarks: a run stopped early still has rows in every cell.
            todo = [(b, r) for b, r in round_robin(requests)
                    if any(f"{tname}|{b}|{r['id']}|{m}" not in done for m in methods)]
            if not todo:
                continue
            pin(target_cores)
            target = Target.load(tcfg["path"], dtype=tcfg.get("dtype", "bfloat16"), device=tcfg.get("device", "cpu"))
            peers = None
            if set(methods) & set(PEER_METHODS):
                peers = HFPeers(target, (cfg.get("assistant") or {}).get("path"), tcfg.get("dtype", "bfloat16"),
                                cfg["hf_pld_tokens"])
            sidecar = None
            if "ooo" in methods:
                sidecar = Sidecar(factory=FACTORY, start_method="spawn",
                                  timeout_s=cfg["sidecar_timeout_s"],
                                  factory_kwargs={"model": sc["model"], "adapter": sc.get("adapter"),
                                                  "dtype": sc.get("dtype", "bfloat16"), "cores": sidecar_cores,
                                                  "max_value_tokens": sc.get("max_value_tokens"),
                                                  "device": sc.get("device", "cpu")})
                sidecar._ensure()  # load the sidecar model before the clock starts on the first request
            if cfg["warmup"]:
                generate(target, todo[0][1], "ar", max_new_tokens=8)
                target.histories.clear()
                if sidecar is not None:  # wait for the worker's model load (one wave), so request 1 is not penalised
                    pending = sidecar.start(todo[0][1])
                    t0 = time.perf_counter()
                    while pending.poll() is None and pending.error is None and time.perf_counter() - t0 < 600:
                        time.sleep(0.05)
            bar = tqdm(todo, desc=f"eval {tname}", unit="req")
            for bench, req in bar:
                ar_res = None
                for method in methods:
                    key = f"{tname}|{bench}|{req['id']}|{method}"
                    if key in done and method != "ar":
                        continue
                    row = {"key": key, "run": cfg["run"], "target": tname, "benchmark": bench,
                           "request_id": req["id"], "method": method, "placement": cfg["placement"],
                           "gold": req.get("gold", []), "gold_accept": req.get("gold_accept")}
                    if method in PEER_METHODS:
                        out = peers.generate(req, method, cfg["max_new_tokens"])
                        ar_prefill = ar_res.stats.prefill_s if ar_res else 0.0
                        row.update(text=out["text"], token_digest=token_digest(out["token_ids"], target.stop_ids),
                                   new_tokens=out["new_tokens"], forwards=out["forwards"], accepted_lengths=[],
                                   prefill_s=ar_prefill, decode_s=max(out["wall_s"] - ar_prefill, 1e-9),
                                   wall_s=out["wall_s"])
                    else:
                        res: Result = generate(target, req, method, sidecar=sidecar if method == "ooo" else None,
                                               max_new_tokens=cfg["max_new_tokens"],
                                               oracle=ar_res if method == "ooo-oracle" else None)
                        if method == "ar":
                            ar_res = res
                            if key in done:
                                continue  # re-run only to serve as the oracle of a resumed request
                        st = res.stats
                        row.update(text=res.text, token_digest=token_digest(res.token_ids, target.stop_ids),
                                   new_tokens=st.new_tokens, forwards=st.forwards, accepted_lengths=st.accepted,
                                   prefill_s=st.prefill_s, decode_s=st.decode_s, wall_s=st.wall_s,
                                   overhead_s=st.overhead_s, tree_nodes=st.tree_nodes, stop=st.stop,
                                   hint_ready_s=st.hint_ready_s,
                                   hint_tokens_accepted=st.hint_tokens, payload_bytes=st.payload_bytes,
                                   hint_error=st.hint_error)
                        if method == "ar":
                            pieces = [target.tokenizer.decode([t]) for t in res.token_ids]
                            row["first_value_s"] = first_value_s(res.text, pieces, st.prefill_s, st.decode_s)
                    writer.write(row)
            if sidecar is not None:
                sidecar.close()
    finally:
        writer.close()
    writer.finish()
    return run_dir


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(prog="python -m pipeline.stages.eval", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("overrides", nargs="*", help="eval.key=value overrides")
    args = ap.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        cfg = {**DEFAULTS, **section(recipe, "eval", known=KNOWN, where=args.recipe)}
        cfg.setdefault("run", recipe.get("recipe_name", "run"))
        for k in ("targets", "benchmarks"):
            if not cfg.get(k):
                raise InputError(f"{args.recipe}: eval.{k} is required")
        run_dir = run(cfg, recipe)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    from ..report import render

    render(run_dir)
    print((run_dir / "summary.md").read_text())
    return run_dir


if __name__ == "__main__":
    main()
