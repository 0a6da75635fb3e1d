"""Fault-injection soak of `make serve`: many concurrent clients, bad inputs, vanishing clients, a sidecar killed and
stalled, on loopback only, bounded in count and time; prints what happened and fails when anything was lost or hung.

Run as: .venv/bin/python scripts/soak_serve.py [--recipe recipes/serve/tiny.yaml] [-n 2000] [--clients 16]
            [--kill-every 200] [--stall-every 500] [--max-minutes 20] [serve.key=value ...]      (make soak)
        real target: --recipe recipes/serve/qwen2.5-coder-1.5b-cpu.yaml -n 50 --clients 2 --kill-every 20

The server runs as its own process (`python -m pipeline.serve`), exactly as `make serve` starts it. Each of the
`--clients` threads sends requests drawn from a fixed mix: plain and streaming chats over the fixture requests'
tools, a forced `tool_choice`, a malformed body, an unknown model, a prompt over the context, a client that closes
a stream after its first chunk and one that gives up on a plain request mid-way. Every `--kill-every` requests the
sidecar process is killed (SIGKILL; /health names its pid), and every `--stall-every` one wave stalls (SIGSTOP for
a few seconds, then SIGCONT). Outcomes as the clients saw them: answered (200), refused (503), client error (4xx),
timed out (504), left (the client went away on purpose), lost (any other answer, a 5xx or a broken connection: must
be 0), hung (no answer within --hang-s: must be 0). It also checks that answers to a replayed subset equal `ar`'s
(the same model in this process), prints the server's RSS at start and end, p50/p95 latency, and compares
/metrics' totals with the clients' counts.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.io import read_jsonl  # noqa: E402
from pipeline.recipes import load_recipe  # noqa: E402

MIX = (("plain", 40), ("stream", 20), ("forced", 10), ("malformed", 5), ("unknown_model", 5), ("too_long", 5),
       ("drop_stream", 8), ("drop_plain", 7))
PROMPTS = ("What is the weather in Paris in fahrenheit?", "Compute 12*7+3 for me.", "Weather in Oslo, celsius.",
           "What is 2 to the power of 10?", "Tell me a joke.", "How warm is it in Rome today?")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> tuple[float, float]:
    """(the server process's RSS, with its children: the sidecar worker) in MB."""
    import psutil

    proc = psutil.Process(pid)
    own = proc.memory_info().rss
    return own / 2**20, (own + sum(p.memory_info().rss for p in proc.children(recursive=True))) / 2**20


class Soak:
    def __init__(self, args, base: str, model: str, tools: list, max_context: int):
        self.args, self.base, self.model, self.tools, self.max_context = args, base, model, tools, max_context
        self.lock = threading.Lock()
        self.outcomes: Counter = Counter()
        self.kinds: Counter = Counter()
        self.latency: list[float] = []
        self.lost: list[str] = []
        self.sent = 0
        self.answers: dict[str, dict] = {}  # prompt -> a plain answer (for the ar replay)
        self.kills = self.stalls = 0
        self.deadline = time.time() + 60 * args.max_minutes

    def body(self, kind: str, rng: random.Random) -> dict:
        prompt = rng.choice(PROMPTS)
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "tools": self.tools,
                "max_tokens": self.args.max_tokens}
        if kind == "forced":
            body["tool_choice"] = {"type": "function", "function": {"name": self.tools[0]["function"]["name"]}}
        elif kind == "unknown_model":
            body["model"] = "no-such-model"
        elif kind == "too_long":
            body["messages"][0]["content"] = "word " * (self.max_context + 10)
        return body

    def one(self, http: httpx.Client, kind: str, rng: random.Random) -> str:
        url = f"{self.base}/v1/chat/completions"
        body = self.body(kind, rng)
        if kind == "malformed":
            return self.status(http.post(url, content=b'{"model": ', timeout=self.args.hang_s).status_code)
        if kind in ("stream", "drop_stream"):
            with http.stream("POST", url, json=dict(body, stream=True), timeout=self.args.hang_s) as r:
                if r.status_code != 200:
                    return self.status(r.status_code)
                for line in r.iter_lines():
                    if kind == "drop_stream":
                        return "left"  # closes the stream after its first chunk
                    if line.startswith("data: ") and '"error"' in line:
                        return "lost"  # an error inside a stream that had started
                    if line == "data: [DONE]":
                        return "answered"
                return "lost"  # the stream ended without [DONE]
        if kind == "drop_plain":
            try:
                r = http.post(url, json=body, timeout=rng.uniform(0.05, 0.5))
            except httpx.TimeoutException:
                return "left"
            return self.status(r.status_code)  # it was answered faster than the client's patience
        r = http.post(url, json=body, timeout=self.args.hang_s)
        if r.status_code == 200 and kind == "plain":
            with self.lock:
                self.answers.setdefault(body["messages"][0]["content"], r.json()["choices"][0]["message"])
        return self.status(r.status_code)

    @staticmethod
    def status(code: int) -> str:
        return {200: "answered", 503: "refused", 504: "timed_out"}.get(code, "client_error" if 400 <= code < 500
                                                                       else f"lost ({code})")

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        kinds, weights = zip(*MIX)
        with httpx.Client() as http:
            while time.time() < self.deadline:
                with self.lock:
                    if self.sent >= self.args.n:
                        return
                    self.sent += 1
                    n = self.sent
                if self.args.kill_every and n % self.args.kill_every == 0:
                    self.kill(http, signal.SIGKILL)
                if self.args.stall_every and n % self.args.stall_every == 0:
                    self.kill(http, signal.SIGSTOP)
                kind = rng.choices(kinds, weights)[0]
                t0 = time.perf_counter()
                try:
                    out = self.one(http, kind, rng)
                except httpx.TimeoutException:
                    out = "hung"
                except httpx.HTTPError as e:
                    out = f"lost ({type(e).__name__})"
                seconds = time.perf_counter() - t0
                if out == "refused":  # a polite client waits before its next request (Retry-After, capped)
                    time.sleep(min(2.0, rng.uniform(0.2, 1.0)))
                with self.lock:
                    self.kinds[kind] += 1
                    self.outcomes[out.split(" ")[0]] += 1
                    if out.startswith("lost") or out == "hung":
                        self.lost.append(f"#{n} {kind}: {out}")
                    if out == "answered" and kind in ("plain", "stream", "forced"):
                        self.latency.append(seconds)

    def kill(self, http: httpx.Client, sig) -> None:
        pid = http.get(f"{self.base}/health", timeout=30).json().get("sidecar_pid")
        if not pid:
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        if sig == signal.SIGSTOP:  # a wave that stalls for a few seconds, then goes on
            self.stalls += 1
            threading.Timer(self.args.stall_s, resume, args=(pid,)).start()
        else:
            self.kills += 1


def resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:  # killed meanwhile (a kill landed on the stalled worker)
        pass


def metrics_totals(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.labels["status"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "ooo_requests_total"}


def ar_equal(recipe: dict, answers: dict[str, dict], tools: list, limit: int, max_tokens: int) -> tuple[int, int]:
    """How many replayed plain answers equal the same model's `ar` answer in this process, with the clients'
    `max_tokens` (a call cut off there is compared as the server sends it: its incomplete arguments text)."""
    from pipeline.runtime import Target, generate
    from pipeline.serve.calls import view

    serve = recipe["serve"]
    target = Target.load(serve["target"], dtype=serve.get("dtype", "auto"), prefix_cache=False)
    same = total = 0
    for prompt, message in list(answers.items())[:limit]:
        req = {"id": f"soak-{total}", "messages": [{"role": "user", "content": prompt}], "tools": tools}
        text = generate(target, req, "ar", max_new_tokens=max_tokens).text
        ref = view(text, final=True, find_calls=True)
        got_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
        want_calls = [(c.name, c.arguments) for c in ref.calls]
        equal = got_calls == want_calls and (message.get("content") or None) == (ref.content or None)
        if not equal:
            print(f"  not equal to ar for {prompt!r}:\n    served  {message.get('content')!r} {got_calls}\n"
                  f"    ar      {ref.content!r} {want_calls}\n    ar text {text!r}", flush=True)
        same += equal
        total += 1
    return same, total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/serve/tiny.yaml")
    ap.add_argument("-n", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--kill-every", type=int, default=200)
    ap.add_argument("--stall-every", type=int, default=500)
    ap.add_argument("--stall-s", type=float, default=3.0)
    ap.add_argument("--hang-s", type=float, default=300.0, help="no answer in this long: hung")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-minutes", type=float, default=20.0)
    ap.add_argument("--replay", type=int, default=6, help="plain answers compared with ar")
    ap.add_argument("overrides", nargs="*", help="serve.key=value for the server (default queue: one per client)")
    args = ap.parse_args(argv)
    if not any(o.startswith("serve.queue_size=") for o in args.overrides):
        args.overrides.append(f"serve.queue_size={args.clients}")
    recipe = load_recipe(args.recipe, args.overrides)
    serve = recipe["serve"]
    if args.recipe.endswith("tiny.yaml") and not Path(serve["target"]).exists():
        from pipeline.testing import build_tiny_serving_model

        build_tiny_serving_model(serve["target"])
    port = free_port()
    cmd = [sys.executable, "-m", "pipeline.serve", "--recipe", args.recipe, *args.overrides,
           f"serve.port={port}", "serve.host=127.0.0.1", "serve.log_level=warning"]
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open("/tmp/soak_server.log", "w"))
    base = f"http://127.0.0.1:{port}"
    try:
        end = time.time() + 900
        while time.time() < end:
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                sys.exit(f"soak: the server exited ({server.returncode}); see /tmp/soak_server.log")
            time.sleep(0.5)
        tools = read_jsonl(ROOT / "tests/fixtures/requests.jsonl")[0]["tools"]
        model = Path(serve["target"]).name if not serve.get("model_name") else serve["model_name"]
        health = httpx.get(f"{base}/health").json()
        soak = Soak(args, base, model, tools, health.get("max_context") or serve.get("max_context") or 4096)
        rss_start = rss_mb(server.pid)
        t0 = time.perf_counter()
        threads = [threading.Thread(target=soak.client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        time.sleep(1.0)  # the last cancelled jobs reach the metrics
        # after the last kill: requests are still answered, and the sidecar is back once its back-off has passed
        recovered_s, t_rec = None, time.perf_counter()
        while time.perf_counter() - t_rec < 90:
            code = httpx.post(f"{base}/v1/chat/completions", timeout=args.hang_s,
                              json=soak.body("plain", random.Random(0))).status_code
            soak.outcomes["answered" if code == 200 else "lost"] += 1
            if httpx.get(f"{base}/health", timeout=30).json()["status"] == "ok":
                recovered_s = time.perf_counter() - t_rec
                break
            time.sleep(1.0)
        health = httpx.get(f"{base}/health", timeout=30).json()
        totals = metrics_totals(httpx.get(f"{base}/metrics", timeout=30).text)
        rss_end = rss_mb(server.pid)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    same, replayed = ar_equal(recipe, soak.answers, tools, args.replay, args.max_tokens)
    o = soak.outcomes
    lat = sorted(soak.latency)
    q = (lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]) if lat else (lambda p: float("nan"))  # noqa: E731
    client_view = {"answered": o["answered"], "refused": o["refused"], "client_error": o["client_error"],
                   "timed_out": o["timed_out"]}
    server_view = {k: int(totals.get(k, 0)) for k in client_view}
    print(f"soak: {soak.sent} requests from {args.clients} clients in {wall:.0f} s on {args.recipe} "
          f"(mix: {dict(soak.kinds)})")
    print(f"  answered {o['answered']} | refused (503) {o['refused']} | client error (4xx) {o['client_error']} | "
          f"timed out (504) {o['timed_out']} | left on purpose {o['left']} | lost {o['lost']} | hung {o['hung']}")
    print(f"  sidecar killed {soak.kills}x, stalled {soak.stalls}x; restarts seen by /health: sidecar "
          f"{health.get('sidecar_restarts')}, worker {health.get('worker_restarts')}; status {health['status']} "
          + (f"{recovered_s:.0f} s after the run (back-off included)" if recovered_s is not None else
             "(not ok within 90 s of the run)"))
    print(f"  answers equal to ar on the replayed subset: {same}/{replayed}")
    print(f"  server RSS {rss_start[0]:.0f} MB at start, {rss_end[0]:.0f} MB at end ({rss_end[0] - rss_start[0]:+.0f} MB; "
          f"with the sidecar worker {rss_start[1]:.0f} -> {rss_end[1]:.0f} MB)")
    print(f"  latency of answered chats: p50 {q(0.5):.2f} s, p95 {q(0.95):.2f} s (n = {len(lat)})")
    cancelled = int(totals.get("cancelled", 0))
    print(f"  /metrics: {server_view} vs clients {client_view} (+ cancelled {cancelled}, "
          f"failed {int(totals.get('failed', 0))}); answered = the clients' answered + those who left "
          f"({o['left']}) - cancelled ({cancelled}) = {o['answered'] + o['left'] - cancelled}")
    for line in soak.lost[:10]:
        print(f"  LOST/HUNG {line}")
    ok = (o["lost"] == 0 and o["hung"] == 0 and server_view["refused"] == o["refused"]
          and server_view["client_error"] == o["client_error"] and server_view["timed_out"] == o["timed_out"]
          and server_view["answered"] == o["answered"] + o["left"] - cancelled and recovered_s is not None)
    print("soak: OK" if ok else "soak: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
