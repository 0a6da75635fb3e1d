"""The method table: every method a runtime, eval, report, server or script can name, in one place (no torch).

A method is a row naming its drafters (`pipeline/runtime/loop.py` maps drafter keys to drafters); the transformers
peers (`PEERS`) run in the eval beside them; `variant()` names a method under a schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

HINT, SCHEMA, HISTORY, LOOKUP, EXTRA, REALIGN = 1, 2, 4, 8, 16, 32  # draft source bits (a node may carry several)
HINT_BITS = HINT | REALIGN  # the sidecar's hint: as aligned, and realigned where the output's value left it


@dataclass(frozen=True)
class Method:
    """A row of the method table: which drafters a method runs, and how a report must read its rows."""

    name: str
    drafters: tuple[str, ...]     # keys of DRAFTERS, best first
    sidecar: bool = False         # takes a sidecar hint
    upper_bound: bool = False     # not a real method: reported apart, kept out of means
    description: str = ""


# method -> drafters: eval, report, the server and the scripts read this one table
METHOD_TABLE: dict[str, Method] = {m.name: m for m in (
    Method("ar", (), description="autoregressive greedy decoding (the reference)"),
    Method("pld", ("lookup1",), description="prompt lookup: n-gram match over prompt + output"),
    Method("toolspec", ("schema", "history", "lookup"),
           description="ToolSpec: schema state machine + history of earlier calls + lookup"),
    Method("ooo", ("hint", "realign", "schema", "history", "lookup"), sidecar=True,
           description="toolspec + the sidecar's hint, aligned structurally"),
    Method("ooo-oracle", ("hint", "realign", "schema", "history", "lookup"), upper_bound=True,
           description="ooo with the target's own ar call as an instantly ready hint: the ceiling of any sidecar"),
)}
METHODS = tuple(METHOD_TABLE)

PEERS = {
    "hf-pld": "transformers prompt-lookup decoding (prompt_lookup_num_tokens)",
    "hf-assisted": "transformers assisted generation with a small draft model (universal path across tokenizers)",
    "llama-pld": "llama-cpp-python's LlamaPromptLookupDecoding (10 tokens a step)",
    "llama-draft": "llama-cpp-python's speculation with a small draft model's GGUF (greedy drafts)",
}
# peer -> the target backend it runs on (its row needs that backend's target; pipeline/runtime/backend.py)
PEER_BACKENDS = {"hf-pld": "transformers", "hf-assisted": "transformers", "llama-pld": "llamacpp",
                 "llama-draft": "llamacpp"}
ALL_METHODS = tuple(METHOD_TABLE) + tuple(PEERS)


def variant(method: str, schedule: str) -> str:
    """A method under a schedule: `ooo@adaptive`; baselines (every core) keep the method's name."""
    return method if schedule == "all-cores" else f"{method}@{schedule}"


def upper_bound(name: str) -> bool:
    """Whether a method or variant is an upper bound (reported apart, never averaged in)."""
    method = name.split("@")[0]
    return method in METHOD_TABLE and METHOD_TABLE[method].upper_bound


def uses_sidecar(method: str) -> bool:
    """Whether a method runs the sidecar's wave (its rows name the sidecar; it prefills beside the wave)."""
    return method in METHOD_TABLE and METHOD_TABLE[method].sidecar


def hint_outcome(error: str | None, ready_s: float | None, tokens: int | None) -> str:
    """What became of a request's hint: used (hint tokens accepted) / ready-unused / rejected (validation) / failed
    (sidecar error, timeout, crash, down) / late (not ready before the last round). The eval report and the server's
    metrics count the same outcomes."""
    if error:
        return "failed" if error.startswith("sidecar") else "rejected"
    if ready_s is None:
        return "late"
    return "used" if tokens else "ready-unused"


__all__ = ["hint_outcome", "Method", "METHOD_TABLE", "METHODS", "PEERS", "PEER_BACKENDS", "ALL_METHODS", "variant",
           "upper_bound", "HINT", "SCHEMA", "HISTORY", "LOOKUP", "EXTRA", "REALIGN", "HINT_BITS"]
