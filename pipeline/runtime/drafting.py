"""One request's drafting: the method's drafters, built from the method table, and the candidates they propose.

Every engine that speculates with this project's drafters drafts through `Drafting`: the runtime's own loop
(`loop.Round`: candidates -> a token tree, verified with a tree mask) and the vLLM proposer (`pipeline/vllm_spec`:
candidates -> the one chain vLLM verifies, `budget.best_chain`). The rules of drafting (which drafters a method runs,
their order, the call formats they write in, the hint they poll) are written here once.

    drafting = Drafting(tokenizer, request, "ooo", prompt_ids, pending, arrived=time.time(), history=History())
    cands = drafting.candidates(output_ids, text)   # [(token ids, source bit)], best first
"""

from __future__ import annotations

from .drafters import (Context, HintDrafter, History, HistoryDrafter, PromptLookup, RealignDrafter, SchemaDrafter,
                       context_of)
from .hint import call_formats
from ..methods import EXTRA, HINT, HISTORY, LOOKUP, METHOD_TABLE, REALIGN, SCHEMA

# drafter key -> (source bit, factory(request, prompt, pending, arrived, history, validate, formats))
DRAFTERS = {
    "lookup1": (LOOKUP, lambda r, p, *_: PromptLookup(p, k=10, max_cands=1)),
    "lookup": (LOOKUP, lambda r, p, *_: PromptLookup(p, k=10, max_cands=2)),
    "schema": (SCHEMA, lambda r, p, pend, arr, hist, val, fmts: SchemaDrafter(r, fmts)),
    "history": (HISTORY, lambda r, p, pend, arr, hist, val, fmts: HistoryDrafter(hist)),
    "hint": (HINT, lambda r, p, pend, arr, hist, val, fmts: HintDrafter(r, fmts, pend, arr, val)),
    "realign": (REALIGN, lambda *_: RealignDrafter()),  # bound to the method's HintDrafter below
}


class Drafting:
    """The drafters of `method` for one request, best first, each with its source bit (`methods.py`).

    tokenizer: the target's; chat_template_kwargs: the target's template variables, as its prompts were rendered
    (the request's own `chat_template_kwargs` win), so the drafts are written in the call format the prompt asks for.
    pending: the sidecar's hint in flight (anything with a non-blocking `poll()`), or None.
    extra: more drafters tried before the method's (source bit EXTRA)."""

    def __init__(self, tokenizer, request: dict, method: str, prompt: list[int], pending=None, *, arrived: float,
                 history: History, validate: bool = True, chat_template_kwargs: dict | None = None,
                 eos: int | None = None, max_depth: int = 24, extra: list | None = None):
        self.tokenizer, self.prompt, self.eos, self.max_depth = tokenizer, prompt, eos, max_depth
        keys = METHOD_TABLE[method].drafters
        template_kwargs = {**(chat_template_kwargs or {}), **(request.get("chat_template_kwargs") or {})}
        formats = history.formats(call_formats(tokenizer, template_kwargs), context_of(request)) if keys else []
        made = [(DRAFTERS[k][1](request, prompt, pending, arrived, history, validate, formats), DRAFTERS[k][0])
                for k in keys]
        self.hint = next((d for d, _ in made if isinstance(d, HintDrafter)), None)
        for d, _ in made:
            if isinstance(d, RealignDrafter):
                d.hint = self.hint
        self.drafters = [(d, EXTRA) for d in extra or []] + made

    def __bool__(self) -> bool:
        return bool(self.drafters)

    def candidates(self, output: list[int], text: str) -> list[tuple[list[int], int]]:
        """Every drafter's candidate continuations of `output` (whose decoded text is `text`), best first."""
        ctx = Context(self.tokenizer, self.prompt, output, self.eos, self.max_depth, text)
        return [(c, bit) for drafter, bit in self.drafters for c in drafter.propose(ctx) if c]


__all__ = ["Drafting", "DRAFTERS"]
