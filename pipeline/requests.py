"""Canonical requests, written once: loading them from JSONL (checked, with a sample rule) and rendering a prompt.

Every stage, the runtime, the server and the scripts read requests and render prompts through these two functions, so
a target sees the same prompt in traces, eval and serving (with its `chat_template_kwargs`, e.g. Qwen3's
`enable_thinking`).
"""

from __future__ import annotations

import random
from pathlib import Path

from .io import InputError, iter_jsonl, where

SAMPLES = ("even", "shuffle", "first")
_FIELDS = (("id", str), ("messages", list), ("tools", list))


def sample(requests: list, limit: int | None, how: str = "even", seed: int = 0) -> list:
    """At most `limit` of `requests`: evenly spaced (every subset represented in proportion, deterministic),
    the first N of a seeded shuffle (raising the limit extends the sample), or simply the first N."""
    if limit is None or limit >= len(requests):
        if how == "shuffle":
            requests = list(requests)
            random.Random(seed).shuffle(requests)
        return list(requests)
    if how == "even":
        step = len(requests) / limit
        return [requests[int(i * step)] for i in range(limit)]
    if how == "shuffle":
        requests = list(requests)
        random.Random(seed).shuffle(requests)
        return requests[:limit]
    if how == "first":
        return list(requests[:limit])
    raise ValueError(f"sample {how!r}; expected one of {SAMPLES}")


def load_requests(paths, limit: int | None = None, how: str = "even", seed: int = 0,
                  require_gold: bool = False) -> list[dict]:
    """Requests of one or more JSONL files, each checked (string id, messages, tools; gold when asked) and unique by
    id across the files; `limit` applies per file with the `how` rule of `sample`."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    out: list[dict] = []
    seen: dict[str, str] = {}
    for path in paths:
        if not Path(path).is_file():
            raise InputError(f"{path}: requests not found (run `make data` first)")
        reqs = []
        for lineno, req in iter_jsonl(path):
            fields = _FIELDS + ((("gold", list),) if require_gold else ())
            for key, kind in fields:
                if not isinstance(req.get(key), kind):
                    raise InputError(f"{where(path, lineno, req.get('id'))}: expected `{key}` to be a {kind.__name__}")
            if req["id"] in seen:
                raise InputError(f"{where(path, lineno, req['id'])}: duplicate id (first at {seen[req['id']]})")
            seen[req["id"]] = where(path, lineno)
            reqs.append(req)
        out += sample(reqs, limit, how, seed)
    return out


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """The ids generation stops at, for every model the project runs (target, wave, traces backends): the chat
    template's turn end <|im_end|> where the tokenizer has it, the tokenizer's eos and the generation config's eos
    ids; sorted."""
    ids = set()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    eos = getattr(generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if not ids:
        raise ValueError("the tokenizer has neither <|im_end|> nor an eos token: generation could never stop")
    return sorted(ids)


def render_prompt(tokenizer, request: dict, chat_template_kwargs: dict | None = None) -> str:
    """The model's own chat template over the request's messages, with its tools, ready for the assistant turn."""
    kwargs = {"add_generation_prompt": True, "tokenize": False, **(chat_template_kwargs or {})}
    if request.get("tools"):
        kwargs["tools"] = request["tools"]
    return tokenizer.apply_chat_template(request["messages"], **kwargs)


__all__ = ["load_requests", "render_prompt", "sample", "SAMPLES"]
