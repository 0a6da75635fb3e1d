"""The eval's requests on vLLM's engine: vLLM without speculation, vLLM's own methods, and this project's proposer.

Run as: .venv-vllm/bin/python scripts/bench_vllm.py --recipe recipes/eval/vllm-cpu.yaml [--engines ar ooo]
                                                                                         [--limit 2]   (make bench-vllm)

Every engine runs the same test requests (the eval's evenly spaced selection), one at a time (batch 1, the latency a
tool-calling agent waits for), greedy, with the same prompt token ids (the target's template with the request's
tools) and the same prefix-cache setting; each engine is warmed up first and takes the requests in a seeded shuffle.
The `ooo` engine serves the proposer's methods (`toolspec`, `ooo` under each schedule, `ooo-oracle` with the plain
engine's own call as its hint: an upper bound) in a per-request shuffled order. Rows go to
eval/results/<run>/rows.jsonl in the eval's row format (keyed target|benchmark|id|variant; a stopped run resumes by
key), so `make report RUN=eval/results/<run>` renders the table: the plain engine is the `ar` reference. An engine
that cannot start (a method this vLLM build lacks) is recorded with its error in `engines.json` and skipped.

Schedules of the wave beside vLLM on a CPU: `beside` submits the request at once (the wave computes on its pinned
core while the engine prefills on every core); `sequential` runs the wave first on every core (the engine idle
meanwhile), then submits the request.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.hardware import cpu_sample, cpu_usage, machine, resolve_dtype  # noqa: E402
from pipeline.io import ResumableJsonl, atomic_open  # noqa: E402
from pipeline.methods import METHOD_TABLE  # noqa: E402
from pipeline.parsers import parse_calls  # noqa: E402
from pipeline.payload import payload_from_call  # noqa: E402
from pipeline.recipes import load_recipe  # noqa: E402
from pipeline.requests import load_requests, render_prompt, stop_token_ids  # noqa: E402

SCHEDULES = ("beside", "sequential")


ENGINE_KEYS = {"name", "speculative_config", "vllm_kwargs", "methods", "schedules", "num_speculative_tokens", "min_p"}


def check(cfg: dict, where: str) -> dict:
    """The `vllm_bench:` section, checked before any engine starts; InputError naming the key otherwise."""
    from pipeline.io import InputError
    from pipeline.sidecar.config import SidecarConfig

    for key in ("run", "target", "benchmarks", "engines"):
        if key not in cfg:
            raise InputError(f"{where}: vllm_bench.{key} is required")
    names = [e.get("name") for e in cfg["engines"]]
    if len(set(names)) != len(names) or "ar" not in names:
        raise InputError(f"{where}: vllm_bench.engines {names}: names must be unique and one must be `ar`")
    for e in cfg["engines"]:
        bad = sorted(set(e) - ENGINE_KEYS)
        if bad:
            raise InputError(f"{where}: engine {e.get('name')}: unknown key(s) {bad}; expected {sorted(ENGINE_KEYS)}")
        for m in e.get("methods") or []:
            if m not in METHOD_TABLE:
                raise InputError(f"{where}: engine {e['name']}: method {m!r}; expected one of {list(METHOD_TABLE)}")
        for sch in e.get("schedules") or []:
            if sch not in SCHEDULES:
                raise InputError(f"{where}: engine {e['name']}: schedule {sch!r}; expected one of {list(SCHEDULES)}")
    if cfg.get("sidecar"):
        SidecarConfig.from_section({k: v for k, v in cfg["sidecar"].items() if k != "cores"}, f"{where} sidecar")
    return cfg


def load_config(path: str, overrides: list[str]) -> dict:
    return check(load_recipe(path, overrides)["vllm_bench"], path)


def process_tree_cpu(exclude: set[int]) -> float:
    """CPU seconds of this process and its children (the engine core), except `exclude` (the wave service)."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        if p.pid in exclude:
            continue
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def proc_cpu(pid: int | None) -> float | None:
    import psutil

    if pid is None:
        return None
    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except psutil.NoSuchProcess:
        return None


def wave_identity(sidecar: dict) -> dict:
    """The eval's sidecar identity (adapter sha256, wave revision, settings) plus the wave's cores."""
    from pipeline.stages.eval import sidecar_identity

    return {**sidecar_identity({k: v for k, v in sidecar.items() if k != "cores"}), "cores": sidecar.get("cores")}


def variants_of(engine: dict) -> list[tuple[str, str]]:
    """(method, schedule) pairs an engine serves: one for vLLM's own engines, the table's methods for ours."""
    if "methods" not in engine:
        return [(engine["name"], "all-cores")]
    out = []
    for m in engine["methods"]:
        scheds = engine.get("schedules", ["beside"]) if METHOD_TABLE[m].sidecar else ["all-cores"]
        out += [(m, s) for s in scheds]
    return out


def variant_name(method: str, schedule: str) -> str:
    return method if schedule == "all-cores" else f"{method}@{schedule}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes/eval/vllm-cpu.yaml"))
    ap.add_argument("--engines", nargs="*", help="engine names to run (default: all of the recipe's)")
    ap.add_argument("--limit", type=int, help="requests per benchmark (default: the recipe's)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    args = ap.parse_args(argv)
    cfg = load_config(args.recipe, args.overrides)

    from transformers import AutoTokenizer, GenerationConfig
    from vllm import LLM, SamplingParams

    from pipeline.artifacts import seal
    from pipeline.eval.runner import token_digest
    from pipeline.io import write_manifest
    from pipeline.stages.eval import git_commit
    from pipeline.vllm_engine import engine_settings
    from pipeline.vllm_spec import Frontend

    target = cfg["target"]
    out_dir = ROOT / "eval" / "results" / cfg["run"]
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(target["path"])
    stops = set(stop_token_ids(tok, GenerationConfig.from_pretrained(target["path"])))
    requests = []
    for bench, limit in cfg["benchmarks"].items():
        limit = args.limit if args.limit is not None else limit
        for req in load_requests(ROOT / cfg.get("requests_root", "data/requests") / bench / f"{cfg.get('split', 'test')}.jsonl",
                                 limit, how="even"):
            requests.append((bench, req, tok(render_prompt(tok, req), add_special_tokens=False).input_ids))
    # the warm-up request is one the run does not measure: an engine that learns across requests (vLLM's suffix
    # decoding keeps every output in its tree) must not have seen a measured request's answer
    chosen = {r["id"] for _, r, _ in requests}
    first = cfg.get("benchmarks") and next(iter(cfg["benchmarks"]))
    spare = next(r for r in load_requests(ROOT / cfg.get("requests_root", "data/requests") / first /
                                          f"{cfg.get('split', 'test')}.jsonl") if r["id"] not in chosen)
    warm = (first, spare, tok(render_prompt(tok, spare), add_special_tokens=False).input_ids)
    dtype = resolve_dtype(target.get("dtype", "auto"))
    params = SamplingParams(temperature=0.0, max_tokens=int(cfg.get("max_new_tokens", 256)))
    rows_file = ResumableJsonl(out_dir / "rows.jsonl", key="key")
    done = rows_file.rows()  # a stopped run's rows: skipped, and the plain engine's text is the oracle's hint
    engines_log = json.loads((out_dir / "engines.json").read_text()) if (out_dir / "engines.json").exists() else {}
    names = args.engines or [e["name"] for e in cfg["engines"]]
    base_kwargs, env, settings = engine_settings(
        {"enable_prefix_caching": bool(cfg.get("prefix_caching", False)), **(cfg.get("vllm_kwargs") or {})},
        cfg.get("env") or {})
    os.environ.update(env)
    print(f"bench_vllm: {len(requests)} requests, engine settings {settings}", file=sys.stderr)
    try:
        for engine in cfg["engines"]:
            if engine["name"] not in names:
                continue
            pairs = variants_of(engine)
            key = lambda bench, req, m, s: f"{target['name']}|{bench}|{req['id']}|{variant_name(m, s)}"  # noqa: E731
            todo = [(b, r, ids) for b, r, ids in requests if any(key(b, r, m, s) not in done for m, s in pairs)]
            if not todo:
                continue
            rng = random.Random(f"{cfg.get('seed', 0)}|{engine['name']}")  # an engine's order, whatever runs with it
            log = run_engine(engine, pairs, todo, warm, done, key, cfg, target, dtype, base_kwargs, params, tok,
                             stops, rows_file, rng, token_digest, LLM, Frontend)
            engines_log[engine["name"]] = {**log, "settings": settings, "machine": machine(dtype)}
            with atomic_open(out_dir / "engines.json") as f:
                json.dump(engines_log, f, indent=1)
    finally:
        rows_file.finish()
        write_manifest(out_dir, "bench-vllm", {"recipe": args.recipe, "resolved": cfg},
                       [ROOT / cfg.get("requests_root", "data/requests") / b / f"{cfg.get('split', 'test')}.jsonl"
                        for b in cfg["benchmarks"]],
                       extra={"machine": machine(dtype), "sidecar": wave_identity(cfg["sidecar"])
                              if cfg.get("sidecar") else None, "git_commit": git_commit(out_dir),
                              "engine_settings": settings, "engines": engines_log})
        seal(out_dir)


def run_engine(engine, pairs, todo, warm, done, key, cfg, target, dtype, base_kwargs, params, tok, stops, rows_file,
               rng, token_digest, LLM, Frontend) -> dict:
    """One engine over the requests it has not answered yet; returns what the engine log records."""
    ours = "methods" in engine
    front = None
    kwargs = {**base_kwargs, **(engine.get("vllm_kwargs") or {})}
    if ours:
        sidecar = cfg.get("sidecar") if any(METHOD_TABLE[m].sidecar for m, _ in pairs) else None
        front = Frontend(sidecar)
        kwargs.update(front.engine_kwargs(int(engine.get("num_speculative_tokens", 16)),
                                          float(engine.get("min_p", 0.05))))
    elif engine.get("speculative_config"):
        kwargs["speculative_config"] = dict(engine["speculative_config"])
    if "speculative_config" in kwargs:  # vLLM's per-request count of verify steps and accepted draft tokens
        kwargs["per_request_spec_decode_metrics"] = "summary"
    t0 = time.perf_counter()
    try:
        llm = LLM(model=target["path"], tokenizer=target["path"], dtype=dtype, seed=0,
                  max_model_len=int(cfg.get("max_model_len", 4096)), disable_log_stats=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - an engine this build cannot run is recorded, the others go on
        if front is not None:
            front.close()
        print(f"bench_vllm: engine {engine['name']} did not start: {type(e).__name__}: {e}", file=sys.stderr)
        return {"error": f"{type(e).__name__}: {str(e)[:2000]}", "kwargs": repr(kwargs)[:2000]}
    start_s = time.perf_counter() - t0
    from pipeline.stages.eval import git_commit, gpu_stamp

    mach = machine(dtype)  # each row says where it ran, as the eval's rows do
    where = {"cpu": mach["cpu"]["model"], "flags": mach["cpu"]["flags"], "torch": mach.get("torch"),
             "dtype": mach.get("dtype"), "commit": git_commit(ROOT / "eval" / "results" / cfg["run"]),
             **gpu_stamp(mach)}
    identity = wave_identity(cfg["sidecar"]) if front is not None and front.sidecar is not None else None
    wave_pid = front.proc.pid if front is not None and front.proc is not None else None

    def decode(bench, req, ids, method, schedule, ar_text, tenant=None):
        """One request, timed from its arrival. Each variant drafts from its own history (the proposer's tenant),
        as the runtime's eval keeps one per variant: a method never sees another's output of the same request."""
        payload = None
        if method == "ooo-oracle":
            calls = parse_calls(ar_text or "", lenient=True).calls
            payload = payload_from_call(calls[0], req.get("tools") or []) if calls else None
        before, c0, w0 = cpu_sample(), process_tree_cpu({wave_pid} if wave_pid else set()), proc_cpu(wave_pid)
        t_arrive = time.perf_counter()
        tenant = variant_name(method, schedule) if tenant is None else tenant
        wave_cores = sorted(os.sched_getaffinity(0)) if schedule == "sequential" else None  # vLLM idle meanwhile
        rid = front.start_request(req, ids, method, payload=payload, tenant=tenant,
                                  wave_cores=wave_cores) if front is not None else None
        if schedule == "sequential":  # the wave first (the engine idle), then the request
            while front.board.hint(rid) is None and time.perf_counter() - t_arrive < 60:
                time.sleep(0.002)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        wall = time.perf_counter() - t_arrive
        seq = out.outputs[0]
        if front is not None:
            front.stop_request(rid, list(seq.token_ids))
        usage = cpu_usage(before, cpu_sample())
        usage["cpu_s"] = process_tree_cpu({wave_pid} if wave_pid else set()) - c0
        w1 = proc_cpu(wave_pid)
        usage["sidecar_cpu_s"] = w1 - w0 if w0 is not None and w1 is not None else None
        m = out.metrics
        decode_s = max(0.0, m.last_token_ts - m.first_token_ts) if m is not None and m.first_token_ts else None
        spec = seq.spec_decode_metrics.to_dict() if getattr(seq, "spec_decode_metrics", None) else {}
        ids_out = list(seq.token_ids)
        text_ids = ids_out[:-1] if ids_out and ids_out[-1] in stops else ids_out
        row = {"key": key(bench, req, method, schedule), "run": cfg["run"], "target": target["name"],
               "backend": "vllm", "engine": engine["name"], "benchmark": bench, "request_id": req["id"],
               "method": method, "schedule": schedule, "variant": variant_name(method, schedule),
               "threads": len(os.sched_getaffinity(0)), "gold": req.get("gold", []),
               "gold_accept": req.get("gold_accept"), "text": tok.decode(text_ids, skip_special_tokens=False),
               "token_ids": ids_out, "token_digest": token_digest(ids_out, stops), "new_tokens": len(ids_out),
               "forwards": 1 + spec["num_spec_steps"] if spec else len(ids_out), "accepted_lengths": [],
               "draft_tokens": spec.get("num_accepted_draft_tokens", 0), "drafted_tokens": spec.get("num_draft_tokens"),
               "prefill_s": wall - decode_s if decode_s is not None else None, "decode_s": decode_s, "wall_s": wall,
               "prompt_tokens": len(ids), "cached_tokens": out.num_cached_tokens or 0,
               "prefix_cache": bool(cfg.get("prefix_caching", False)), "stop": seq.finish_reason,
               "measured": usage, "machine": where}
        if rid is not None:
            row["rid"] = rid
        if METHOD_TABLE.get(method) is not None and METHOD_TABLE[method].sidecar:
            row["sidecar"] = identity
        return row

    for method, schedule in pairs:  # untimed: compile, caches, the wave's first load (a history of its own)
        decode(warm[0], warm[1], warm[2], method, schedule, None, tenant="warm-up")
    pending = []  # our rows wait for the proposer's figures, written at its next steps
    order = list(todo)
    rng.shuffle(order)
    from tqdm import tqdm

    for bench, req, ids in tqdm(order, desc=f"vllm {engine['name']}", unit="req", file=sys.stderr):
        ar_key = f"{target['name']}|{bench}|{req['id']}|ar"
        ar_text = done[ar_key]["text"] if ar_key in done else None
        mine = [p for p in pairs if key(bench, req, *p) not in done]
        rng.shuffle(mine)
        for method, schedule in mine:
            if method == "ooo-oracle" and ar_text is None:
                continue  # the plain engine's row is the oracle's hint: run engine `ar` first
            row = decode(bench, req, ids, method, schedule, ar_text)
            if front is None:
                rows_file.write(row)
                done[row["key"]] = row
            else:
                pending.append(row)
        pending = flush(pending, front, rows_file, done)
    if front is not None:
        decode(warm[0], warm[1], warm[2], "toolspec", "all-cores", None, tenant="warm-up")  # the last figures
        flush(pending, front, rows_file, done, wait_s=2.0)
    proposer = front.proposer_figures() if front is not None else {}
    llm.llm_engine.engine_core.shutdown()  # the engine core process goes before the next engine starts
    llm = None
    gc.collect()
    if front is not None:
        front.close()
    return {"start_s": round(start_s, 1), "speculative_config": kwargs.get("speculative_config"),
            "proposer": proposer}


def flush(pending: list[dict], front, rows_file, done, wait_s: float = 0.0) -> list[dict]:
    """Write the rows whose proposer figures have arrived (hint outcome, hint tokens, drafting time)."""
    left = []
    for row in pending:
        fig = front.figures(row["rid"], wait_s=wait_s)
        if fig is None:
            left.append(row)
            continue
        row.update(hint_ready_s=fig.get("hint_ready_s"), hint_error=fig.get("hint_error"),
                   hint_tokens_accepted=fig.get("hint_accepted", 0), proposer_steps=fig.get("steps"),
                   proposer_drafted=fig.get("drafted"), payload_bytes=fig.get("payload_bytes"),
                   sidecar_cpu_s=fig.get("sidecar_cpu_s"), overhead_s=fig.get("draft_s"))
        rows_file.write(row)
        done[row["key"]] = row
    return left


if __name__ == "__main__":
    main()
