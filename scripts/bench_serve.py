"""What the HTTP server costs: the same requests through the runtime in-process, over HTTP, and over HTTP streaming.

Run as: python scripts/bench_serve.py --recipe recipes/serve/qwen2.5-coder-1.5b-cpu.yaml [-n 8]
        [--requests data/requests/bfcl/test.jsonl ...] [--build-tiny] [serve.method=toolspec ...]
        (make bench-serve RECIPE=... ARGS="...")

The engine is built from the recipe exactly as `make serve` builds it and uvicorn serves it on a free loopback port.
Each request then runs in three modes, one after the other with the server otherwise idle: `Engine.execute` in this
process (the runtime alone), the openai client without streaming, and the openai client with `stream=True`;
`--repeat` times in rotating order, the median per request counts. Before each run the target's per-method
history and prefix cache are cleared, so no run reuses an earlier run of the same request. One warm-up round is not counted.
Printed: the machine, then per mode the wall time (mean, p50, p95), the HTTP overhead per request (HTTP wall time
minus the in-process time of the same request), the time to the first streamed delta, and whether the answer equals
the in-process one. `--build-tiny` writes a tiny random model at serve.target first if it is missing (tiny recipe).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

from pipeline.hardware import machine
from pipeline.recipes import load_recipe
from pipeline.requests import load_requests
from pipeline.serve import create_app
from pipeline.serve.app import answer
from pipeline.serve.cli import ServeConfig, build_engine
from pipeline.serve.protocol import parse_chat
from pipeline.testing import build_tiny_serving_model

MODES = ("in-process", "http", "http-stream")


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def start_server(engine, host: str):
    import uvicorn

    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            sys.exit("bench_serve: the server did not start")
        time.sleep(0.02)
    return server, thread, f"http://{host}:{port}/v1"


def summary(message) -> tuple:
    """(content, [(name, arguments)]) of a chat.completion message dict."""
    return (message.get("content") or "",
            [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []])


def run_streamed(client, body: dict) -> tuple[tuple, float | None]:
    t0, first = time.perf_counter(), None
    content, calls = "", {}
    for ch in client.chat.completions.create(**body, stream=True):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        if (d.content or d.tool_calls) and first is None:
            first = time.perf_counter() - t0
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, ["", ""])
            c[0] += tc.function.name or ""
            c[1] += tc.function.arguments or ""
    return (content, [tuple(c) for _, c in sorted(calls.items())]), first


def measure(engine, client, body: dict, mode: str) -> dict:
    """One run of `body` in `mode`: seconds, the answer (content, calls), first streamed delta, tokens, forwards."""
    engine.target.histories.clear()  # no drafting from an earlier run of the same request
    if getattr(engine.target, "prefix_cache", None) is not None:
        engine.target.prefix_cache.clear()  # no prompt KV from an earlier run of the same request either
    out = {}
    t0 = time.perf_counter()
    if mode == "in-process":
        job = engine.prepare(parse_chat(dict(body), engine.model_name))
        result = engine.execute(job)
        out["s"] = time.perf_counter() - t0
        out["answer"] = summary(answer(engine, job, result)["choices"][0]["message"])
        out["tokens"], out["forwards"] = result.stats.new_tokens, result.stats.forwards
    elif mode == "http":
        plain = client.chat.completions.create(**body)
        out["s"] = time.perf_counter() - t0
        out["answer"] = summary(plain.choices[0].message.model_dump())
    else:
        out["answer"], out["first"] = run_streamed(client, body)
        out["s"] = time.perf_counter() - t0
    return out


def main(argv=None) -> None:
    import openai

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--requests", nargs="+", default=["tests/fixtures/requests.jsonl"])
    ap.add_argument("-n", type=int, default=8, help="requests per file (evenly spaced)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per request and mode (the median counts)")
    ap.add_argument("--build-tiny", action="store_true")
    ap.add_argument("--out", help="write the per-request rows here (JSONL)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    cfg = ServeConfig.from_recipe(load_recipe(args.recipe, args.overrides), args.recipe)
    if args.build_tiny and not Path(cfg.target).exists():
        build_tiny_serving_model(cfg.target)
    requests = load_requests(args.requests, limit=args.n)
    engine = build_engine(cfg)
    server, thread, url = start_server(engine, cfg.host)
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600)
    rows = []
    try:
        bodies = [{"model": engine.model_name, "messages": r["messages"], "tools": r["tools"]} for r in requests]
        for mode in MODES:  # warm-up round (not counted): first-call costs of torch, the wave and the HTTP stack
            measure(engine, client, bodies[0], mode)
        for req, body in zip(requests, bodies):
            runs: dict[str, list[dict]] = {m: [] for m in MODES}
            for rep in range(args.repeat):
                for mode in MODES[rep % 3:] + MODES[:rep % 3]:  # rotate the order between repeats
                    runs[mode].append(measure(engine, client, body, mode))
            ref = runs["in-process"][0]
            row = {"id": req["id"], "tokens": ref["tokens"], "forwards": ref["forwards"]}
            for mode in MODES:
                row[mode] = statistics.median(r["s"] for r in runs[mode])
                row[f"{mode}_same"] = all(r["answer"] == ref["answer"] for r in runs[mode])
            row["first_delta"] = statistics.median(r["first"] for r in runs["http-stream"] if r["first"] is not None) \
                if any(r["first"] is not None for r in runs["http-stream"]) else None
            rows.append(row)
            print(f"{req['id']}: {row['tokens']} tokens, in-process {row['in-process']:.3f} s, "
                  f"http {row['http']:.3f} s, stream {row['http-stream']:.3f} s", file=sys.stderr)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.close()
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    report(rows, engine, cfg)


def report(rows: list[dict], engine, cfg) -> None:
    m = machine(cfg.dtype)
    print(f"machine: {m['cpu']['model']} ({m['cpu']['cores']} cores, {' '.join(m['cpu']['flags'])}), "
          f"torch {m.get('torch')}, {m.get('threads')} threads, dtype {m.get('dtype')}")
    print(f"target: {engine.model_name}, method {engine.method}, {len(rows)} requests, "
          f"{sum(r['tokens'] for r in rows) / max(len(rows), 1):.1f} tokens/request, "
          f"{sum(r['tokens'] for r in rows) / max(sum(r['forwards'] for r in rows), 1):.2f} tokens/forward\n")
    print("| mode        |  n | mean s | p50 s  | p95 s  | overhead mean ms | p50 ms | p95 ms | first delta p50 s | same answer |")
    print("|-------------|----|--------|--------|--------|------------------|--------|--------|-------------------|-------------|")
    for mode in MODES:
        wall = [r[mode] for r in rows]
        over = [1000 * (r[mode] - r["in-process"]) for r in rows]
        first = [r["first_delta"] for r in rows if r.get("first_delta") is not None]
        same = "-" if mode == "in-process" else f"{sum(r[f'{mode}_same'] for r in rows)}/{len(rows)}"
        overhead = ("-", "-", "-") if mode == "in-process" else \
            (f"{sum(over) / len(over):.1f}", f"{pct(over, 50):.1f}", f"{pct(over, 95):.1f}")
        ttft = f"{pct(first, 50):.3f}" if mode == "http-stream" and first else "-"
        print(f"| {mode:11} | {len(wall):2} | {sum(wall) / len(wall):6.3f} | {pct(wall, 50):6.3f} | {pct(wall, 95):6.3f} "
              f"| {overhead[0]:>16} | {overhead[1]:>6} | {overhead[2]:>6} | {ttft:>17} | {same:>11} |")


if __name__ == "__main__":
    main()
