"""The greedy speculative decode loop shared by every method, and its entry point `generate`.

Each round: (1) poll the sidecar without blocking, (2) collect candidates from the method's drafters (best
first), (3) merge them into a token tree and verify it in one target forward, (4) accept the longest path that
equals the target's argmax plus the target's own next token, and keep only that path in the cache.
Methods: ar (no drafters), pld (prompt lookup, one chain), toolspec (schema + history + lookup),
ooo (sidecar hint + toolspec), ooo-oracle (the call parsed from the target's own `ar` output as an instantly
ready hint: the ceiling of any sidecar). Every method's tokens equal `ar`'s (tests/runtime prove it in float64).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from .drafters import HintDrafter, History, context_of
from .drafting import Drafting
from .sidecar_client import Ready
from .budget import TreeBudget
from .backend import TargetBackend as Target  # transformers or llama.cpp (runtime/backend.py)
from .verify import accept, best_chain, build_tree, truncate_at_stop
from ..jsonscan import scan
from ..methods import (EXTRA, HINT, HINT_BITS, HISTORY, LOOKUP, METHOD_TABLE, METHODS, REALIGN, SCHEMA,  # noqa: F401
                       Method)
from ..parsers import parse_calls
from ..payload import payload_from_call


@dataclass
class Stats:
    method: str
    prompt_tokens: int = 0
    cached_tokens: int = 0            # prompt tokens taken from the prefix cache (not recomputed)
    new_tokens: int = 0
    forwards: int = 0                 # target forwards after prefill (one per round)
    accepted: list[int] = field(default_factory=list)  # tokens committed per round (draft accepted + 1)
    tree_nodes: int = 0               # tokens fed to the target over all rounds
    tree_sizes: list[int] = field(default_factory=list)  # tokens verified per round (the budget's choice)
    threads: list[int] = field(default_factory=list)     # target threads per round (adaptive schedule)
    prefill_s: float = 0.0            # charged: measured here, or this request's earlier measured prefill (reused)
    decode_s: float = 0.0
    prefill_reused: bool = False      # the prefill was restored from the eval's memo (same prompt, same threads)
    prefill_cpu_s: float = 0.0        # this process's CPU seconds (every thread) in prefill (charged like prefill_s)
    decode_cpu_s: float = 0.0         # ... in decode
    verify_s: float = 0.0             # time inside target forwards during decode
    draft_s: float = 0.0              # time spent proposing and building trees
    wall_s: float = 0.0               # request arrival -> last token
    stop: str = ""                    # "eos" or "length"
    hint_ready_s: float | None = None  # request arrival -> wave finished (None: not seen before the last round)
    hint_tokens: int = 0              # accepted draft tokens that only a hint candidate proposed in their round
    hint_shared_tokens: int = 0       # accepted draft tokens a hint candidate proposed, other drafters' too
    hint_other_tokens: int = 0        # ... of them drafted for a tool other than the payload's top tool
    draft_tokens: int = 0             # accepted draft tokens from any drafter (new tokens minus bonus tokens)
    sidecar_cpu_s: float | None = None  # CPU seconds the sidecar's wave used for this request
    payload_bytes: int | None = None
    hint_error: str | None = None

    @property
    def mean_accepted(self) -> float:
        return self.new_tokens / max(self.forwards, 1)

    @property
    def overhead_s(self) -> float:
        """Loop time that is not a target forward: drafting + bookkeeping."""
        return self.decode_s - self.verify_s

    def as_dict(self) -> dict:
        return asdict(self) | {"mean_accepted": self.mean_accepted, "overhead_s": self.overhead_s}


@dataclass
class Result:
    text: str
    token_ids: list[int]
    stats: Stats


def warm_up(target: Target, request: dict, decodes=(), sidecars=()) -> None:
    """Untimed first calls, so that no measured or served request pays for loading: one wave from every sidecar
    (each worker loads its model and answers), then every `decodes` callable (each one decode of `request`); then
    the target forgets the run (histories, the budgets' statistics, memoised prefills), so warm-up never drafts.
    The eval's runner and the server both warm up through it."""
    for sidecar in sidecars:
        if sidecar is not None:
            sidecar.start(request).wait()
    for decode in decodes:
        decode()
    target.histories.clear()
    target.budgets.clear()
    if getattr(target, "memo", None) is not None:  # a replayed target has none
        target.memo.clear()


def oracle_payload(target: Target, request: dict, oracle=None, max_new_tokens: int = 256):
    """The payload of the call the target itself writes (from `oracle`: an ar Result or text; else runs ar)."""
    if oracle is None:
        oracle = generate(target, request, "ar", max_new_tokens=max_new_tokens)
    text = oracle.text if isinstance(oracle, Result) else str(oracle)
    calls = parse_calls(text, lenient=True).calls
    return payload_from_call(calls[0], request.get("tools") or []) if calls else None


@dataclass
class Round:
    """What one request's rounds share: the target, the method's drafters, the tree's shape, the stats."""
    target: Target
    prompt: list[int]
    drafting: Drafting                  # the method's drafters (drafting.py), best first
    hint: HintDrafter | None
    budget: TreeBudget | None           # None: every round verifies up to max_nodes
    eos: int | None
    max_nodes: int
    max_depth: int
    max_new_tokens: int
    stats: Stats

    def propose(self, output: list[int]) -> list[tuple[list[int], int]]:
        """Every drafter's candidates (best first), or none when the budget says this round should not draft."""
        hint, budget = self.hint, self.budget
        draft = bool(self.drafting) and (budget is None or budget.should_draft())
        if self.drafting and not draft and hint is not None and not hint.calls and hint.error is None:
            hint.poll()  # a hint that just arrived is worth drafting for at once
            if hint.calls:
                draft, budget.skip = True, False
        if not draft:
            return []
        return self.drafting.candidates(output, self.target.decode(output))

    def count(self, tree, path: list[int], new: list[int], t0: float, t1: float, t2: float) -> None:
        stats, sources = self.stats, tree.sources
        from_hint = sum(1 for i in path[:len(new)] if sources[i] and not sources[i] & ~HINT_BITS)  # hint-only tokens
        stats.hint_tokens += from_hint
        stats.hint_shared_tokens += sum(1 for i in path[:len(new)] if sources[i] & HINT_BITS)
        if self.hint is not None and self.hint.other_tool:
            stats.hint_other_tokens += from_hint
        stats.draft_tokens += min(len(path), len(new))
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.forwards += 1
        stats.tree_nodes += len(tree)
        stats.tree_sizes.append(len(tree))
        stats.accepted.append(len(new))
        if self.budget is not None:
            self.budget.update(tree, path, t1 - t0)


def speculative_round(r: Round, root: int, output: list[int]) -> tuple[list[int], bool]:
    """One round: propose -> build the tree -> verify in one target forward -> accept -> trim the cache.

    Returns the tokens committed (the accepted draft + the target's own next token) and whether decoding stopped.
    """
    t0 = time.perf_counter()
    # propose + build: candidates merged into one token tree rooted at the last committed token
    make_tree = build_tree if r.target.tree else best_chain
    tree = make_tree(root, r.propose(output), r.max_nodes, r.max_depth)
    if r.budget is not None:  # hardware-aware: the subtree with the most expected tokens per second on this machine
        tree, _ = r.budget.choose(tree)
    t1 = time.perf_counter()
    # verify: one forward; argmax[i] = the target's next token after node i
    argmax = r.target.verify(tree)
    t2 = time.perf_counter()
    # accept: the longest path whose every token equals the target's argmax after its parent, plus the target's own
    # next token after the path (so every round commits >= 1 token and the output is exactly greedy `ar`'s)
    path, bonus = accept(tree, argmax)
    new, stopped = truncate_at_stop([tree.tokens[i] for i in path] + [bonus], r.target.stop_ids,
                                    r.max_new_tokens - len(output))
    r.count(tree, path, new, t0, t1, t2)
    if not stopped:
        r.target.keep(len(tree), path)  # trim: only the accepted path stays in the cache
    return new, stopped


def generate(target: Target, request: dict, method: str = "ar", sidecar=None, *, max_new_tokens: int = 256,
             max_nodes: int = 32, max_depth: int = 24, history: History | None = None, oracle=None,
             validate_hint: bool = True, extra_drafters: list | None = None, on_commit=None,
             tree_budget: str = "auto", schedule=None, variant: str | None = None,
             reuse_prefill: bool = False, prefill_chunk: int | None = None) -> Result:
    """Decode `request` greedily with `method`; the tokens equal `ar`'s for every method and any sidecar.

    The request's lifecycle around `speculative_round`: start the sidecar's wave, prefill (threads from the
    schedule), build the method's drafters, run rounds until a stop token or max_new_tokens, record the stats.

    sidecar: for "ooo", a `Sidecar` (started here, when the request arrives) or an already started hint
      (`Pending` / `Ready`, anything with a non-blocking `poll()`); None = no hint (ooo degrades to toolspec).
    oracle: for "ooo-oracle", the `ar` Result (or its text) whose call becomes the hint; None runs `ar` first.
    history: earlier outputs for the history drafter; default: the target's per-method history of this run.
    max_nodes / max_depth: the token tree's size and depth per round (root included in max_nodes).
    extra_drafters: more drafters (anything with `propose(ctx) -> list[list[int]]`), tried before the method's.
    on_commit: called after every round with the token ids committed in it (streaming; a stop token included).
    tree_budget: "auto" = each round verifies the tree size that maximises expected tokens per second from the
      target's measured cost curve (`target.curve`, see budget.py; without a curve: the fixed size); "fixed" =
      always up to max_nodes.
    schedule: an object with `threads(pending) -> int` asked before prefill and at every round boundary (the adaptive
      schedule: every core except while the sidecar's wave computes); None leaves the threads alone. A schedule with
      `layer_switch` is also asked before every decoder layer of the prefill, where it may only raise the count.
    variant: the key of this run's history and acceptance statistics (default: the method); variants of one method
      (e.g. ooo under two schedules) must not see each other's outputs of the same request.
    reuse_prefill: take this request's earlier measured prefill on the same threads from `target.memo` (the eval's
      rule for variants that do the same prefill work); prefill_s and wall_s are charged the measured seconds.
    prefill_chunk: prefill in chunks of this many tokens, asking the schedule for the thread count between chunks
      and for each chunk's length (`Schedule.chunk`: adaptive shortens them while the wave computes); None: one
      forward, threads chosen once before it.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    if tree_budget not in ("auto", "fixed"):
        raise ValueError(f"tree_budget {tree_budget!r}; expected 'auto' or 'fixed'")
    pending = None
    if method == "ooo-oracle":
        pending = Ready(oracle_payload(target, request, oracle, max_new_tokens))
        if pending.payload is None:
            pending.error = "no tool call in the target's ar output"
    started, arrived = time.perf_counter(), time.time()  # the request arrives
    # `deferred`: the wave starts once the prefill is done (the hint's ready time still counts from the arrival)
    defer = method == "ooo" and hasattr(sidecar, "start") and getattr(schedule, "deferred", False)
    if method == "ooo" and sidecar is not None and not defer:
        pending = sidecar.start(request) if hasattr(sidecar, "start") else sidecar
    history = history if history is not None else target.histories.setdefault(variant or method, History())
    stats = Stats(method)
    prompt = target.prompt_ids(request)
    stats.prompt_tokens = len(prompt)

    def set_threads() -> None:
        if schedule is not None:
            n = schedule.threads(pending)
            target.set_threads(n)
            stats.threads.append(n)

    # prefill: every prompt token but the last (the first round's root)
    if pending is not None and getattr(schedule, "sequential", False):
        while pending.poll() is None and getattr(pending, "error", None) is None:  # the wave first, every core
            time.sleep(0.002)
    set_threads()
    shift = _prefill(target, request, prompt, stats, schedule, pending, set_threads, reuse_prefill, prefill_chunk)
    if defer:
        pending = sidecar.start(request)
        set_threads()  # n-1 while the wave computes
    wave_running = getattr(pending, "running", lambda: False)
    cancel_wave = getattr(pending, "cancel", lambda: None)
    validate = validate_hint and method != "ooo-oracle"  # the oracle is the target's own call, valid or not
    eos = target.tokenizer.eos_token_id if target.tokenizer.eos_token_id in target.stop_ids else None
    drafting = Drafting(target.tokenizer, request, method, prompt, pending, arrived=arrived, history=history,
                        validate=validate, chat_template_kwargs=getattr(target, "chat_template_kwargs", None),
                        eos=eos, max_depth=max_depth, extra=extra_drafters)
    hint = drafting.hint
    budget = None
    if tree_budget == "auto" and getattr(target, "curve", None) is not None and drafting:
        budget = target.budgets.setdefault(variant or method, TreeBudget(target.curve, max_nodes))
        budget.start_request()
    rounds = Round(target, prompt, drafting, hint, budget, eos, max_nodes, max_depth, max_new_tokens, stats)
    # decode: rounds until a stop token or max_new_tokens
    t_decode, c_decode = time.perf_counter(), time.process_time()
    output: list[int] = []
    root = prompt[-1]
    try:
        while True:
            new, stopped = speculative_round(rounds, root, output)
            output += new
            if on_commit is not None and new:
                on_commit(new)
            if stopped:
                stats.stop = "eos" if new and new[-1] in target.stop_ids else "length"
                break
            root = new[-1]
            if wave_running() and scan(target.decode(output)).state == "done":
                cancel_wave()  # the call is written: the wave can no longer help, its core goes back to the target
            set_threads()
    finally:
        if stats.stop == "":  # left by an exception (a client that went away): its wave is not needed
            cancel_wave()
    end = time.perf_counter()
    stats.decode_s, stats.wall_s = end - t_decode, end - started + shift
    stats.decode_cpu_s = time.process_time() - c_decode
    stats.new_tokens = len(output)
    if hint is not None:  # a hint that arrives after the last round is "not ready" (hint_ready_s None)
        stats.hint_ready_s, stats.payload_bytes, stats.hint_error = hint.ready_s, hint.bytes, hint.error
        if stats.hint_ready_s is not None and defer:  # it arrived after a prefill that is charged, not spent, here
            stats.hint_ready_s += shift
        stats.sidecar_cpu_s = getattr(pending, "cpu_s", None)
    cancel_wave()  # the request has ended: a queued wave is dropped, a running one abandoned
    body = output[:-1] if output and output[-1] in target.stop_ids else output
    text = target.decode(body)
    history.add(prompt, output, text, context_of(request))
    return Result(text, output, stats)


def _prefill(target: Target, request: dict, prompt: list[int], stats: Stats, schedule, pending, set_threads,
             reuse: bool, chunk_size: int | None) -> float:
    """Prefill prompt[:-1] into the target's cache; returns the seconds charged but not spent (a reused prefill)."""
    def next_chunk() -> int | None:  # the schedule shortens chunks while it holds a core for the wave
        return schedule.chunk(stats.threads[-1], chunk_size)

    def give_back() -> None:  # before every decoder layer of a prefill forward: every core once the wave answers
        if schedule.threads(pending) > stats.threads[-1]:
            set_threads()

    chunk = next_chunk if schedule is not None and hasattr(schedule, "chunk") else chunk_size
    stats.prefill_s = target.prefill(prompt[:-1], key=request.get("id"), reuse=reuse, chunk=chunk,
                                     between=set_threads if schedule is not None else None,
                                     salt=request.get("cache_salt"),
                                     inside=give_back if getattr(schedule, "layer_switch", False) else None)
    stats.cached_tokens = getattr(target, "cached_tokens", 0)
    done = getattr(target, "last_prefill", {})
    stats.prefill_reused, stats.prefill_cpu_s = bool(done.get("reused")), float(done.get("cpu_s") or 0.0)
    return stats.prefill_s - float(done.get("spent", stats.prefill_s))  # reused: the measured prefill - the restore
