"""The engine side of OoO-Spec on vLLM: each step, one draft chain per row of the engine's batch, from token ids alone.

An engine hands `speculate` its batch as token arrays (each row: prompt + accepted output); rows have no request ids,
move between steps, end without notice, and two of them may hold the same prompt. The speculator finds each row's
request on the hint board (`board.py`: the registration whose prompt digest equals the row's first `length` tokens),
keeps one state per request (its `Drafting`: the runtime's drafters for its method, and the hint polled from the
board without blocking), and answers the chain with the most expected accepted tokens (`budget.best_chain`), at most
`k` tokens. Acceptance is learned per method from what the engine accepted, as the runtime's budget does.

    spec = Speculator(tokenizer, HintBoard(path), k=16, stop_ids=[...])
    drafts = spec.speculate([(tokens_row0, n0), None, (tokens_row2, n2)])   # None: the row sampled nothing
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import numpy as np

from ..methods import HINT_BITS, METHOD_TABLE
from ..payload import payload_bytes
from ..runtime.budget import Acceptance, best_chain, subtree
from ..runtime.drafters import History, context_of
from ..runtime.drafting import Drafting
from ..runtime.target import decode
from ..runtime.verify import build_tree
from .board import BoardHint, HintBoard, digest

log = logging.getLogger("pipeline.vllm_spec")


class RequestState:
    """One request in the engine: where its prompt ends, its drafters, the chain proposed last step, its figures."""

    def __init__(self, reg: dict, drafting: Drafting | None, hint: BoardHint | None):
        self.rid, self.length, self.digest = reg["rid"], reg["length"], reg["digest"]
        self.method, self.tenant, self.arrived = reg["method"], reg.get("tenant", ""), reg["arrived"]
        self.context = context_of(reg.get("request") or {})
        self.drafting, self.hint = drafting, hint
        self.output: list[int] = []     # output ids seen so far
        self.chain: list[int] = []      # the draft proposed last step
        self.chain_tree = None          # ... as a tree (its nodes' sources), for the acceptance statistics
        self.row = -1
        self.last_step = 0
        self.figures = {"steps": 0, "drafted": 0, "accepted": 0, "hint_accepted": 0, "draft_s": 0.0}


class Speculator:
    """Drafts for an engine's batch (see the module docstring).

    k: the most draft tokens a row gets per step (vLLM's num_speculative_tokens).
    min_p: a chain ends before a node whose estimated probability of being reached is below this.
    forget_after: steps after which a state whose row is gone and whose registration is gone is dropped.
    refresh_s: how often the board's registrations are re-read when every row is known."""

    def __init__(self, tokenizer, board: HintBoard, k: int, *, stop_ids, chat_template_kwargs: dict | None = None,
                 min_p: float = 0.05, max_tenants: int = 256, forget_after: int = 64, refresh_s: float = 0.05,
                 max_len: int | None = None):
        self.tokenizer, self.board, self.k = tokenizer, board, k
        self.stop_ids = set(stop_ids)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos = eos if eos in self.stop_ids else min(self.stop_ids)
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.min_p, self.max_tenants, self.forget_after, self.refresh_s = min_p, max_tenants, forget_after, refresh_s
        self.max_len = max_len
        self.regs: dict[str, dict] = {}
        self.states: dict[str, RequestState] = {}
        self.histories: OrderedDict[str, History] = OrderedDict()  # tenant -> its outputs (LRU): never shared
        self.acceptance: dict[str, Acceptance] = {}                 # method -> learned rates
        self.step = 0
        self.refreshed, self.refreshed_step = 0.0, -1
        self.step_s: list[float] = []  # the speculator's time per step (the last 4096 steps)

    # --- the board --------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Read the board's registrations (new ones only); requests whose registration went have ended."""
        self.regs = self.board.registered(self.regs)
        self.refreshed, self.refreshed_step = time.perf_counter(), self.step
        for rid in [r for r in self.states if r not in self.regs]:
            self.finish(self.states.pop(rid))

    def finish(self, s: RequestState) -> None:
        """A request that ended: its output feeds its tenant's history; its figures go to the board."""
        end = self.board.ended(s.rid)
        if end and end.get("output") and end["output"][:len(s.output)] == s.output:
            self._observe(s, end["output"][len(s.output):])  # the last step's acceptance, seen only now
        output = s.output
        if s.drafting is not None:
            text = decode(self.tokenizer, [t for t in output if t not in self.stop_ids])
            self.history(s.tenant).add(s.drafting.prompt, list(output), text, s.context)
        hint = s.hint
        self.board.record(s.rid, {**s.figures, "method": s.method,
                                  "sidecar_cpu_s": hint.cpu_s if hint is not None else None,
                                  "payload_bytes": payload_bytes(hint.payload) if hint and hint.payload else None,
                                  "hint_ready_s": (max(0.0, hint.ready_wall - s.arrived)
                                                   if hint is not None and hint.ready_wall else None),
                                  "hint_error": s.drafting.hint.error if s.drafting and s.drafting.hint else None,
                                  "draft_s": round(s.figures["draft_s"], 6)})

    def history(self, tenant: str) -> History:
        h = self.histories.pop(tenant, None) or History()
        self.histories[tenant] = h
        while len(self.histories) > self.max_tenants:
            self.histories.popitem(last=False)
        return h

    # --- rows -> requests ---------------------------------------------------------------------------------------
    def _claim(self, tokens: np.ndarray, n: int, claimed: set[str]) -> RequestState | None:
        """The request of a row not seen at this index last step: a state whose prompt and output agree with the
        row, else a new state for a registration whose prompt digest matches (the earliest arrival first)."""
        by_length: dict[int, str] = {}
        for attempt in range(2):
            if attempt == 1:
                if self.refreshed_step == self.step:
                    return None  # the board was read this step already
                self.refresh()  # a request registered since the last read
            pool = [(s.length, s.digest, s) for s in self.states.values() if s.rid not in claimed]
            pool += [(r["length"], r["digest"], r) for rid, r in sorted(self.regs.items(), key=lambda x: x[1]["arrived"])
                     if rid not in self.states and rid not in claimed]
            for length, dig, what in pool:
                if length > n:
                    continue
                if length not in by_length:
                    by_length[length] = digest(tokens[:length])
                if by_length[length] != dig:
                    continue
                if isinstance(what, RequestState):
                    out = what.output
                    if len(out) <= n - length and list(tokens[length:length + len(out)]) == out:
                        return what
                    continue
                return self._start(what, tokens)
        return None

    def _start(self, reg: dict, tokens: np.ndarray) -> RequestState:
        method = reg.get("method", "ooo")
        if method not in METHOD_TABLE:
            log.warning("request %s names an unknown method %r: no drafts", reg["rid"], method)
            method = "ar"
        request = reg.get("request") or {}
        prompt = [int(t) for t in tokens[:reg["length"]]]
        hint = BoardHint(self.board, reg["rid"]) if METHOD_TABLE[method].drafters else None
        drafting = None
        if METHOD_TABLE[method].drafters:
            drafting = Drafting(self.tokenizer, request, method, prompt, hint, arrived=reg["arrived"],
                                history=self.history(reg.get("tenant", "")), validate=method != "ooo-oracle",
                                chat_template_kwargs=self.chat_template_kwargs, eos=self.eos, max_depth=self.k)
        s = RequestState(dict(reg, method=method), drafting, hint)
        self.states[s.rid] = s
        return s

    # --- one step -----------------------------------------------------------------------------------------------
    def speculate(self, rows) -> list[list[int]]:
        """rows[i]: (the row's token array, its number of valid tokens), or None where the row sampled nothing this
        step (a prefill chunk): no draft. Returns one draft (a list of token ids, maybe empty) per row."""
        t0 = time.perf_counter()
        self.step += 1
        if t0 - self.refreshed > self.refresh_s:
            self.refresh()
        by_row = {s.row: s for s in self.states.values() if s.last_step == self.step - 1}
        drafts: list[list[int]] = []
        claimed: set[str] = set()
        for i, row in enumerate(rows):
            if row is None:
                drafts.append([])
                continue
            tokens, n = row
            s = by_row.get(i)
            if s is None or s.rid in claimed or not self._same(s, tokens, n):
                s = self._claim(tokens, n, claimed)
            if s is None:
                drafts.append([])
                continue
            claimed.add(s.rid)
            s.row, s.last_step = i, self.step
            drafts.append(self._draft(s, tokens, n))
        for rid in [r for r, s in self.states.items()
                    if self.step - s.last_step > self.forget_after and r not in self.regs]:
            self.finish(self.states.pop(rid))
        self.step_s.append(time.perf_counter() - t0)
        if len(self.step_s) > 4096:
            del self.step_s[:2048]
        return drafts

    @staticmethod
    def _same(s: RequestState, tokens: np.ndarray, n: int) -> bool:
        """Whether the row still holds `s`'s request: its prompt digest and the output seen so far agree."""
        seen = s.length + len(s.output)
        return n >= seen and (not s.output or int(tokens[seen - 1]) == s.output[-1]) \
            and digest(tokens[:s.length]) == s.digest

    def _observe(self, s: RequestState, new: list[int]) -> None:
        """The tokens the engine committed since the last step: what it accepted of the chain proposed then (the
        acceptance statistics and the figures learn it), then the target's own next token."""
        if s.chain:
            accepted = 0
            while accepted < min(len(s.chain), len(new) - 1) and new[accepted] == s.chain[accepted]:
                accepted += 1
            tree = s.chain_tree
            s.figures["accepted"] += accepted
            s.figures["hint_accepted"] += sum(1 for i in range(1, accepted + 1)
                                              if tree.sources[i] and not tree.sources[i] & ~HINT_BITS)
            self.acceptance.setdefault(s.method, Acceptance()).update(tree, list(range(1, accepted + 1)))
            s.chain, s.chain_tree = [], None
        s.output += new

    def _draft(self, s: RequestState, tokens: np.ndarray, n: int) -> list[int]:
        t0 = time.perf_counter()
        self._observe(s, [int(t) for t in tokens[s.length + len(s.output):n]])
        s.figures["steps"] += 1
        room = self.k if self.max_len is None else min(self.k, self.max_len - n - 1)
        if s.drafting is None or room <= 0 or (s.output and s.output[-1] in self.stop_ids):
            return []
        cands = s.drafting.candidates(s.output, decode(self.tokenizer, s.output))
        chain: list[int] = []
        if cands:
            tree = build_tree(s.output[-1] if s.output else int(tokens[n - 1]), cands, 4 * self.k, room)
            path = best_chain(tree, self.acceptance.setdefault(s.method, Acceptance()), room, self.min_p)
            if path:
                s.chain_tree = subtree(tree, [0] + path)
                chain = [tree.tokens[i] for i in path]
        s.chain = chain
        s.figures["drafted"] += len(chain)
        s.figures["draft_s"] += time.perf_counter() - t0
        return chain

    def figures(self) -> dict:
        """The speculator's time per step (median, p90, mean, in ms) and the learned acceptance per method."""
        if not self.step_s:
            return {"steps": 0}
        ms = np.asarray(self.step_s) * 1e3
        return {"steps": self.step, "step_ms_median": round(float(np.median(ms)), 3),
                "step_ms_p90": round(float(np.percentile(ms, 90)), 3), "step_ms_mean": round(float(ms.mean()), 3),
                "acceptance": {m: a.as_dict() for m, a in self.acceptance.items()}}


__all__ = ["Speculator", "RequestState"]
