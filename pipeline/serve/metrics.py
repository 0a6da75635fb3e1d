"""What a serving user watches: Prometheus metrics at `GET /metrics` and one access-log line per request.

The names follow vLLM's `/metrics` where there is an equivalent (a request counter by outcome, queue depth, time to
first token, end-to-end latency); the speculative ones are this project's (tokens per target forward, hint
outcomes, prefill tokens the prefix cache saved). Each engine has its own registry, so several engines (tests) never
share counters. Access log (logger `pipeline.serve.access`, one line per request, key=value):
    id=chatcmpl-... tenant=key:3f2a... status=200 outcome=answered tokens=41 forwards=9 hint=used seconds=3.214
"""

from __future__ import annotations

import logging

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pipeline.methods import hint_outcome

access_log = logging.getLogger("pipeline.serve.access")
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 300, 600)
TPF_BUCKETS = (1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32)
STATUSES = ("answered", "failed", "cancelled", "timed_out", "refused", "client_error")
HINTS = ("used", "ready-unused", "late", "rejected", "failed", "none")


class Metrics:
    """The server's instruments; `observe` after every job, `refused` / `client_error` for what never ran."""

    def __init__(self, queue_depth=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ooo_requests", "Chat requests by outcome", ["status"], registry=r)
        self.queue = Gauge("ooo_queue_depth", "Requests waiting for the target", registry=r)
        if queue_depth is not None:
            self.queue.set_function(queue_depth)
        self.ttft = Histogram("ooo_time_to_first_token_seconds", "Arrival to the first committed token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("ooo_e2e_request_latency_seconds", "Arrival to the last token (queue wait included)",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.tpf = Histogram("ooo_tokens_per_forward", "Tokens committed per target forward, per request",
                             buckets=TPF_BUCKETS, registry=r)
        self.hints = Counter("ooo_hint_outcomes", "What became of each request's sidecar hint", ["outcome"],
                             registry=r)
        self.saved = Counter("ooo_prefix_cache_saved_tokens", "Prompt tokens the prefix cache did not recompute",
                             registry=r)
        self.generated = Counter("ooo_generation_tokens", "Tokens generated", registry=r)
        for s in STATUSES:  # every series exists from the start (a scrape before the first request sees zeros)
            self.requests.labels(status=s)
        for h in HINTS:
            self.hints.labels(outcome=h)

    def observe(self, job, outcome: str, http_status: int, result=None, method: str = "") -> None:
        """One finished job (answered, failed, cancelled or timed out) and its access-log line."""
        self.requests.labels(status=outcome).inc()
        seconds = job.finished - job.enqueued if job.finished else None
        hint, tokens, forwards = "none", 0, 0
        if result is not None:
            st = result.stats
            tokens, forwards = st.new_tokens, st.forwards
            if method == "ooo":
                hint = hint_outcome(st.hint_error, st.hint_ready_s, st.hint_tokens)
            self.hints.labels(outcome=hint).inc()
            self.tpf.observe(st.mean_accepted)
            self.saved.inc(st.cached_tokens)
            self.generated.inc(st.new_tokens)
            if seconds is not None:
                self.e2e.observe(seconds)
        if job.first_token_at is not None:
            self.ttft.observe(job.first_token_at - job.enqueued)
        access_log.info("id=%s tenant=%s status=%d outcome=%s tokens=%d forwards=%d hint=%s seconds=%s",
                        job.chat.id, job.chat.tenant, http_status, outcome, tokens, forwards, hint,
                        "-" if seconds is None else f"{seconds:.3f}")

    def rejected(self, status: int, why: str = "") -> None:
        """A request answered with an error before it ran: 503 (queue full) is `refused`, a 4xx `client_error`."""
        self.requests.labels(status="refused" if status == 503 else "client_error").inc()
        access_log.info("id=- status=%d outcome=%s error=%s", status, "refused" if status == 503 else "client_error",
                        why.replace(" ", "_")[:80] or "-")

    def text(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["Metrics", "STATUSES", "HINTS"]
