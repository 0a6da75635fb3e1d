"""One target, one worker thread, a bounded queue: the speculative runtime behind the HTTP server.

The runtime is batch 1 (one KV cache per `Target`), so a single worker thread runs `generate` for one request at a
time and the rest wait in a `queue.Queue(maxsize=queue_size)`; a request that finds the queue full is refused with
503 and a `Retry-After` estimated from the mean service time. Events (tokens committed in a round, the result, an
error) go back to the request's asyncio loop with `call_soon_threadsafe`. A client that disconnects (streaming or
not) cancels its job, and a job past `request_timeout_s` (counted from its arrival in the queue) ends with 504:
`on_commit` runs every round and raises, the worker moves on, and the job's sidecar wave is cancelled with it.

`tool_choice` "required" and a named function are lossless *forced prefixes*: the opening of a call in the
target's own call format (`call_format`: the chat template's, or fenced / indented / compact JSON, see
`pipeline.runtime.hint.call_formats`) up to the name's opening quote ("required") or through the name (a named
function), e.g. ```` ```json\n{\n  "name": "get_weather" ```` for a fenced target, is appended to the rendered prompt as
the start of the assistant turn. The target then writes its own greedy continuation of that prompt, and the
answer's text is prefix + continuation. The prefix ends wherever the call text does, not on a token boundary the
target would choose, which slightly shifts what it writes next; the output is still exactly its greedy answer to
that prompt (tests compare it with `ar`).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
import math
import queue
import threading
import time
from dataclasses import dataclass, field

from pipeline.requests import render_prompt
from pipeline.runtime import generate
from pipeline.runtime.drafters import History
from pipeline.runtime.hint import PROBE_NAME, call_formats, render
from pipeline.runtime.target import encode

from .metrics import Metrics
from .protocol import ApiError, Chat, bad

log = logging.getLogger("pipeline.serve")
CALL_FORMATS = ("auto", "template", "fenced", "indented", "compact")


class Cancelled(Exception):
    """The client went away; the job stops at the next commit."""


class DeadlineExceeded(Exception):
    """The job passed `request_timeout_s` (from its arrival in the queue); it stops at the next commit."""


def forced_prefix(tokenizer, chat: Chat, call_format: str = "auto") -> str:
    """The forced start of the assistant turn for `tool_choice` "required" / a named function ("" otherwise)."""
    if chat.tool_choice != "required" and chat.forced_name is None:
        return ""
    formats = {f.name: f for f in call_formats(tokenizer)}
    fmt = next(iter(formats.values())) if call_format == "auto" else formats.get(call_format)
    if fmt is None:
        raise ValueError(f"call_format {call_format!r}: this target has {sorted(formats)} (or 'auto')")
    name = chat.forced_name or PROBE_NAME
    text = render({"name": name, "arguments": {}}, fmt)
    at = text.index(json.dumps(name, ensure_ascii=False), text.index('"name"'))
    return text[:at + 1] if chat.forced_name is None else text[:at + len(json.dumps(name, ensure_ascii=False))]


def prompt_ids(target, request: dict, prefix: str = "", template_kwargs: dict | None = None) -> list[int]:
    """The target's prompt: its chat template over the request (`render_prompt`; the request's template variables
    over the target's), then the forced prefix."""
    kwargs = {**(getattr(target, "chat_template_kwargs", None) or {}), **(template_kwargs or {})}
    return encode(target.tokenizer, render_prompt(target.tokenizer, request, kwargs) + prefix)


class Prompted:
    """`target` as `generate` sees it for one request: the same model, cache and histories, the prompt with the
    forced prefix (`generate` reads the prompt through `target.prompt_ids`)."""

    def __init__(self, target, prefix: str, template_kwargs: dict | None = None):
        self._target, self._prefix, self._template_kwargs = target, prefix, template_kwargs

    def prompt_ids(self, request: dict) -> list[int]:
        return prompt_ids(self._target, request, self._prefix, self._template_kwargs)

    def __getattr__(self, name):
        return getattr(self._target, name)


@dataclass
class Job:
    chat: Chat
    prefix: str                     # forced start of the assistant turn ("" for tool_choice auto / none)
    prompt_tokens: int
    max_new_tokens: int
    loop: object = None             # the asyncio loop of the HTTP request; None: events are only kept
    events: object = None           # asyncio.Queue of ("tokens", ids) / ("done", Result) / ("error", exc)
    cancelled: bool = False
    deadline: float | None = None   # time.perf_counter() past which the job ends with 504
    first_token_at: float | None = None  # time.perf_counter() of the first committed round
    finished: float | None = None
    result: object = None
    waited_s: float = 0.0
    enqueued: float = field(default_factory=time.perf_counter)

    def emit(self, kind: str, value) -> None:
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the request's loop is gone (server shutting down)
            self.cancelled = True


class Engine:
    """Runs chat jobs one at a time on `target` with `method` (the sidecar process for "ooo")."""

    def __init__(self, target, method: str = "ooo", sidecar=None, *, model_name: str | None = None,
                 queue_size: int = 8, max_tokens: int = 256, max_context: int | None = None,
                 call_format: str = "auto", schedule=None, prefill_chunk: int | None = None,
                 request_timeout_s: float | None = None, shared_history: bool = False, history_tenants: int = 64,
                 history_outputs: int = 256, watchdog_s: float = 0.5, shared_prefix_cache: bool = False):
        if call_format not in CALL_FORMATS:
            raise ValueError(f"call_format {call_format!r}; expected one of {CALL_FORMATS}")
        if queue_size < 1:
            raise ValueError(f"queue_size {queue_size}: expected at least 1")
        self.target, self.method, self.sidecar, self.schedule = target, method, sidecar, schedule
        self.prefill_chunk, self.request_timeout_s = prefill_chunk, request_timeout_s
        self.outcomes = {"answered": 0, "failed": 0, "cancelled": 0, "timed_out": 0}
        # the history drafter's earlier calls, per tenant (LRU, bounded): one client's calls never draft another's
        self.shared_history, self.history_tenants, self.history_outputs = shared_history, history_tenants, history_outputs
        self.histories: OrderedDict[str, History] = OrderedDict()
        # the prefix caches (target and wave) likewise, by salt: a tenant never reuses, nor times, another's prompt KV
        self.shared_prefix_cache = shared_prefix_cache
        self.worker_restarts, self.watchdog_s = 0, watchdog_s
        self._closing = False
        self._revive_lock = threading.Lock()
        self.model_name = model_name or target.name
        self.max_tokens, self.call_format = max_tokens, call_format
        config = getattr(getattr(target, "model", None), "config", None)
        self.max_context = max_context or getattr(config, "max_position_embeddings", None)
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.metrics = Metrics(queue_depth=self.queue.qsize)
        self.running: Job | None = None
        self.served = 0
        self.service_s = 0.0
        self._thread: threading.Thread | None = None

    # --- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> Engine:
        if self._thread is None:
            self._closing = False
            self._thread = threading.Thread(target=self._work, name="serve-worker", daemon=True)
            self._thread.start()
            self._watchdog = threading.Thread(target=self._watch, name="serve-watchdog", daemon=True)
            self._watchdog.start()
        return self

    def _watch(self) -> None:
        while not self._closing:
            self.revive()
            time.sleep(self.watchdog_s)

    def revive(self) -> bool:
        """If the worker thread died (an error outside a job's own handling), answer its job 500 and start a new
        worker; True when it had died. Called by the watchdog every 0.5 s and by /health."""
        with self._revive_lock:
            if self._thread is None or self._thread.is_alive() or self._closing:
                return False
            job, self.running = self.running, None
            if job is not None:
                self.outcomes["failed"] += 1
                job.finished = time.perf_counter()
                self.metrics.observe(job, "failed", 500, method=self.method)
                job.emit("error", ApiError(500, "the worker died while generating this answer; it was restarted",
                                           kind="server_error"))
            self.worker_restarts += 1
            log.error("serve worker thread died; restarted (%d so far)", self.worker_restarts)
            self._thread = threading.Thread(target=self._work, name="serve-worker", daemon=True)
            self._thread.start()
            return True

    def close(self) -> None:
        self._closing = True
        if self._thread is not None:
            while True:  # cancel what waits, then stop the worker
                try:
                    job = self.queue.get_nowait()
                except queue.Empty:
                    break
                job.cancelled = True
                job.emit("error", ApiError(503, "server shutting down", kind="server_error"))
            self.queue.put(None)
            self._thread.join(timeout=60)
            self._thread = None
        if self.sidecar is not None and hasattr(self.sidecar, "close"):
            self.sidecar.close()
        if hasattr(self.target, "close"):  # an engine target (vLLM) stops its engine and its wave service
            self.target.close()

    def health(self) -> tuple[dict, int]:
        """(body, HTTP status): "ok" 200; "degraded" 200 while the sidecar process is down (requests go on without
        hints: ooo answers as toolspec); "failing" 503 when the worker thread was found dead (it is restarted, and
        its job answered 500)."""
        dead = self._thread is not None and not self._thread.is_alive() and not self._closing
        sidecar = self.sidecar.status() if self.sidecar is not None and hasattr(self.sidecar, "status") else None
        own = self.target.status() if hasattr(self.target, "status") else None  # an engine target (vLLM)
        if own is not None and own.get("wave_service") is not None:
            sidecar = own["wave_service"]  # the wave service, the sidecar's process beside vLLM's engine
        if dead:
            status, detail = "failing", "the worker thread died (restarting it)"
            self.revive()
        elif self.method == "ooo" and sidecar == "down":
            status, detail = "degraded", "sidecar down, serving toolspec"
        else:
            status, detail = "ok", None
        body = {"status": status, "detail": detail, "model": self.model_name, "method": self.method,
                "max_context": self.max_context, "sidecar": sidecar,
                "sidecar_pid": self.sidecar.pid() if sidecar == "up" and self.sidecar is not None else None,
                "sidecar_restarts": getattr(self.sidecar, "restarts", 0), "worker_restarts": self.worker_restarts,
                "queue": {"waiting": self.queue.qsize(), "size": self.queue.maxsize, "running": self.running is not None},
                "served": self.served, "outcomes": dict(self.outcomes),
                "backend": getattr(self.target, "backend", "transformers")}
        if getattr(self.target, "backend_choice", None):  # backend: auto (pipeline/runtime/auto.py)
            body["backend_choice"] = self.target.backend_choice
        if own is not None:
            body["engine"] = own
        return body, 503 if status == "failing" else 200

    # --- requests -----------------------------------------------------------------------------------------------
    def prepare(self, chat: Chat) -> Job:
        """Render and measure the prompt; ApiError 400 if it does not fit the context."""
        try:
            prefix = forced_prefix(self.target.tokenizer, chat, self.call_format)
        except ValueError as e:
            raise ApiError(500, f"tool_choice cannot be forced: {e}", kind="server_error") from None
        try:
            n = len(prompt_ids(self.target, chat.request, prefix, chat.chat_template_kwargs))
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation (role order, ...)
            raise bad(f"the chat template of {self.model_name} cannot render these messages: {e}",
                      param="messages") from None
        budget = chat.max_tokens or self.max_tokens
        if self.max_context is not None:
            if n >= self.max_context:
                raise bad(f"the prompt has {n} tokens, the context of {self.model_name} is {self.max_context} "
                          "tokens; shorten the messages or tools", param="messages", code="context_length_exceeded")
            budget = min(budget, self.max_context - n)
        return Job(chat, prefix, n, budget)

    def retry_after(self) -> int:
        mean = self.service_s / self.served if self.served else 1.0
        return max(1, math.ceil(mean * (self.queue.qsize() + 1)))

    def submit(self, job: Job, loop=None, events=None) -> Job:
        """Queue `job` (events go to `events` on `loop`); ApiError 503 with Retry-After when the queue is full."""
        job.loop, job.events = loop, events
        job.enqueued = time.perf_counter()
        if self.request_timeout_s:
            job.deadline = job.enqueued + float(self.request_timeout_s)
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            wait = self.retry_after()
            raise ApiError(503, f"server busy: {self.queue.maxsize} requests already wait for the target (batch 1); "
                           f"retry in about {wait} s", code="queue_full", kind="server_error",
                           headers={"Retry-After": str(wait)}) from None
        return job

    def history_for(self, tenant: str) -> History:
        """The tenant's history (every tenant's one when `shared_history`), most recently used kept last."""
        key = "*" if self.shared_history else tenant
        history = self.histories.pop(key, None) or History(self.history_outputs)
        self.histories[key] = history
        while len(self.histories) > self.history_tenants:
            self.histories.popitem(last=False)
        return history

    def cache_salt(self, chat: Chat) -> str | None:
        """The request's partition of the prefix caches: its tenant (and its body's `cache_salt`, if any); with
        `shared_prefix_cache` only the body's salt, so requests without one share one cache."""
        if self.shared_prefix_cache:
            return chat.cache_salt
        return chat.tenant if chat.cache_salt is None else f"{chat.tenant}|{chat.cache_salt}"

    def execute(self, job: Job):
        """Run one job now, in this thread (the worker's body; benchmarks call it directly)."""
        def on_commit(ids: list[int]) -> None:  # every round, streaming or not: a job that is no longer wanted stops
            if job.first_token_at is None:
                job.first_token_at = time.perf_counter()
            if job.cancelled:
                raise Cancelled(job.chat.id)
            if job.deadline is not None and time.perf_counter() > job.deadline:
                raise DeadlineExceeded(job.chat.id)
            if job.chat.stream:
                job.emit("tokens", ids)

        sidecar = self.sidecar if self.method == "ooo" else None
        request = dict(job.chat.request, cache_salt=self.cache_salt(job.chat))
        prompted = Prompted(self.target, job.prefix, job.chat.chat_template_kwargs)
        if hasattr(self.target, "generate"):  # an engine target (vLLM) decodes itself; its drafter keeps the history
            return self.target.generate(prompted, request, self.method, max_new_tokens=job.max_new_tokens,
                                        on_commit=on_commit, tenant="*" if self.shared_history else job.chat.tenant)
        return generate(prompted, request, self.method, sidecar=sidecar,
                        max_new_tokens=job.max_new_tokens, on_commit=on_commit, history=self.history_for(job.chat.tenant),
                        schedule=self.schedule, prefill_chunk=self.prefill_chunk)

    def _work(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            if job.cancelled:  # its client went away while it waited
                self.outcomes["cancelled"] += 1
                job.finished = time.perf_counter()
                self.metrics.observe(job, "cancelled", 499, method=self.method)
                continue
            job.waited_s = time.perf_counter() - job.enqueued
            self.running = job
            t0, event, outcome = time.perf_counter(), None, "answered"
            try:
                if job.deadline is not None and t0 > job.deadline:
                    raise DeadlineExceeded(job.chat.id)
                job.result = self.execute(job)
                event = ("done", job.result)
            except Cancelled:
                log.info("%s: client disconnected, stopped", job.chat.id)
                outcome = "cancelled"
            except DeadlineExceeded:
                log.warning("%s: past request_timeout_s (%s s), stopped", job.chat.id, self.request_timeout_s)
                event, outcome = ("error", ApiError(504, f"the request took longer than request_timeout_s = "
                                                         f"{self.request_timeout_s} s (queue wait included)",
                                                    code="timeout", kind="server_error")), "timed_out"
            except Exception as e:  # noqa: BLE001 - one failed request must not stop the server
                log.exception("%s: generation failed", job.chat.id)
                event, outcome = ("error", ApiError(500, f"generation failed: {e!r}", kind="server_error")), "failed"
            self.running = None
            self.outcomes[outcome] += 1
            job.finished = time.perf_counter()
            self.metrics.observe(job, outcome, {"answered": 200, "failed": 500, "cancelled": 499,
                                                "timed_out": 504}[outcome], job.result, self.method)
            if outcome == "answered":  # the Retry-After estimate is the mean time of a whole answer
                self.served += 1
                self.service_s += time.perf_counter() - t0
            if event is not None:
                job.emit(*event)


__all__ = ["Engine", "Job", "Prompted", "forced_prefix", "prompt_ids", "CALL_FORMATS", "Cancelled", "DeadlineExceeded"]
