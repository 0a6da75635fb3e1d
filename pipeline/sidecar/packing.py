"""Prefix-shared packing of a request's sidecar rows for training, and the collator that batches packed requests.

A request's rows share everything up to the row question (see `rows.py`), so training runs them the way the wave
runs them at inference: one sequence = the shared prefix once, then each row's suffix (question + end of turn +
generation prompt) followed by its answer tokens (answer + <|im_end|>):

    input_ids    = prefix | suffix_1 answer_1 | suffix_2 answer_2 | ...
    segment_ids  = 0 ...0 | 1 ...          1 | 2 ...          2 | ...     (-1 for padding, added by the collator)
    position_ids = 0..P-1 | P, P+1, ...      | P, P+1, ...      | ...     (each row restarts right after the prefix)
    labels       = -100   | -100.. answer_1  | -100.. answer_2  | ...     (loss on answer tokens only)

The 4-D attention mask lets token q see token k iff k <= q and (k is in the prefix or k is in q's row): row j sees
the prefix and itself, never another row; so every answer token gets exactly the logits it would get in its own
prefix + suffix + answer sequence (tests/sidecar/test_packing.py proves it in float64, gradients included).

Tokenization is `rows.render_prefix_and_suffixes` + `rows.answer_ids`, the very calls the wave predictor uses. Rows
are regrouped per request; each row's question is rebuilt from its metadata (kind, tool, param) with `rows.py`'s own
question functions and checked against the question in the row's prompt, so a rows file that does not belong to the
requests file fails loudly instead of training on mismatched prefixes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ..io import InputError
from ..schema import param_names
from .rows import (QUESTION_STYLES, answer_ids, check_question_style, function_question, render_prefix_and_suffixes,
                   slot_question, user_content)

IGNORE = -100
PAD_SEGMENT = -1


def row_question(request: dict, row: dict, where: str = "rows", style: str = "long") -> str:
    """The question a row asks in `style`, rebuilt from its metadata; the row's own prompt must ask the same question
    in one of the styles (rows written in one style train in another: the metadata names the question)."""
    check_question_style(style)
    kind = row.get("kind")
    rid = request["id"]
    if kind == "function":
        asked = {s: function_question(s) for s in QUESTION_STYLES}
    elif kind == "slot":
        tools, i, p = request["tools"], row.get("tool"), row.get("param")
        if not isinstance(i, int) or not 0 <= i < len(tools) or p not in param_names(tools[i]):
            raise InputError(f"{where} (record {rid}): slot row names tool {i!r} parameter {p!r}, which the request "
                             f"does not have; expected a tool index < {len(tools)} and one of its parameters")
        asked = {s: slot_question(tools, i, p, s) for s in QUESTION_STYLES}
    else:
        raise InputError(f"{where} (record {rid}): row kind {kind!r}; expected 'function' or 'slot'")
    prompt = row.get("prompt")
    content = prompt[-1].get("content") if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict) else None
    if content not in {user_content(request, q) for q in asked.values()}:
        raise InputError(f"{where} (record {rid}): the {kind} row's prompt does not match the request's dialogue and "
                         f"question {asked['long']!r} (or {asked['short']!r}); the rows were built from a different "
                         "request file or by an older rows.py (rerun `make labels`)")
    return asked[style]


def row_answer(row: dict, request_id: str, where: str = "rows") -> str:
    completion = row.get("completion")
    if not (isinstance(completion, list) and len(completion) == 1 and isinstance(completion[0].get("content"), str)):
        raise InputError(f"{where} (record {request_id}): expected completion = [one assistant message with content]")
    return completion[0]["content"]


def keep_row(row: dict, null_keep: float, seed: int = 0) -> bool:
    """Subsample the `null` slot rows of tools that are not chosen; every other row is kept.

    `rows.build_rows` writes slot rows for the called tool only, so rows from the labels stage have none to thin;
    this applies to rows files of other origin that train the other tools' slots as `null`. The decision hashes (seed, request, tool, param), so it is the same on every run, resume and process.
    """
    if null_keep >= 1.0 or row.get("kind") != "slot" or row.get("chosen") or not row.get("null"):
        return True
    key = f"{seed}|{row['request_id']}|{row.get('tool')}|{row.get('param')}".encode()
    return int(hashlib.sha256(key).hexdigest()[:8], 16) / 0xFFFFFFFF < null_keep


def pack_request(tokenizer, request: dict, rows: list[dict], compact: bool = True,
                 chat_template_kwargs: dict | None = None, max_length: int | None = None,
                 where: str = "rows", questions: str = "long") -> tuple[list[dict], int]:
    """Pack one request's rows into prefix-shared sequences (several when `max_length` forces it).

    Returns (sequences, dropped): each sequence {"request_id", "input_ids", "position_ids", "segment_ids", "labels",
    "n_rows"}; `dropped` counts rows that do not fit even alone with the prefix. `questions` is the question style
    the rows are trained in (`rows.QUESTION_STYLES`).
    """
    asked = [row_question(request, row, where, questions) for row in rows]
    answers = [answer_ids(tokenizer, row_answer(row, request["id"], where)) for row in rows]
    prefix, suffixes = render_prefix_and_suffixes(tokenizer, request, asked, compact, chat_template_kwargs)
    P = len(prefix)
    sequences: list[dict] = []
    dropped = 0
    cur = None
    for suffix, answer in zip(suffixes, answers):
        n = len(suffix) + len(answer)
        if max_length is not None and P + n > max_length:
            dropped += 1
            continue
        if cur is None or (max_length is not None and len(cur["input_ids"]) + n > max_length):
            cur = {"request_id": request["id"], "input_ids": list(prefix), "position_ids": list(range(P)),
                   "segment_ids": [0] * P, "labels": [IGNORE] * P, "n_rows": 0}
            sequences.append(cur)
        cur["n_rows"] += 1
        cur["input_ids"] += suffix + answer
        cur["position_ids"] += list(range(P, P + n))
        cur["segment_ids"] += [cur["n_rows"]] * n
        cur["labels"] += [IGNORE] * len(suffix) + answer
    return sequences, dropped


def pack_rows(tokenizer, requests: dict[str, dict], rows: list[tuple[str, dict]], compact: bool = True,
              chat_template_kwargs: dict | None = None, max_length: int | None = None, null_keep: float = 1.0,
              seed: int = 0, progress: bool = False, questions: str = "long",
              function_repeat: int = 1) -> tuple[list[dict], dict]:
    """Group rows by request (first-seen order), subsample null rows, pack each request.

    `function_repeat` packs the function row of a request with two or more tools that many times (each copy its own
    row after the prefix): the same gradient as weighting its loss by that factor. A function answer is one digit
    among ~17 answer tokens per request, and a single-tool request (always `0`, ~40% of the rows here) teaches only
    the prior, so one copy leaves the choice among several tools undertrained (v2 answered `0` on 74 of 104
    multi-tool requests; `0` was right on 39). The copies cost ~8 tokens each with short questions.

    `rows` holds (location, row) pairs, the location ("file:line") naming the row in errors. Returns the packed
    sequences and counts: requests, rows_in, rows_kept (function copies included), function_copies,
    rows_dropped_too_long, sequences, tokens, answer_tokens,
    unpacked_tokens (what the same rows cost one by one).
    """
    groups: dict[str, list[tuple[str, dict]]] = {}
    for loc, row in rows:
        rid = row.get("request_id")
        if rid not in requests:
            raise InputError(f"{loc} (record {rid}): request_id not found in the requests files; expected the id of a "
                             "request the rows were built from")
        groups.setdefault(rid, []).append((loc, row))
    if int(function_repeat) < 1:
        raise ValueError(f"function_repeat={function_repeat!r}; expected an integer >= 1")
    stats = {"requests": 0, "rows_in": len(rows), "rows_kept": 0, "rows_dropped_too_long": 0, "sequences": 0,
             "tokens": 0, "answer_tokens": 0, "unpacked_tokens": 0, "function_copies": 0}
    sequences: list[dict] = []
    items = groups.items()
    if progress:
        from tqdm import tqdm
        items = tqdm(items, desc="pack", unit="req")
    for rid, group in items:
        kept = [row for _, row in group if keep_row(row, null_keep, seed)]
        if not kept:
            continue
        if function_repeat > 1 and len(requests[rid]["tools"]) > 1:
            copies = [row for row in kept if row.get("kind") == "function"] * (int(function_repeat) - 1)
            stats["function_copies"] += len(copies)
            kept += copies
        seqs, dropped = pack_request(tokenizer, requests[rid], kept, compact, chat_template_kwargs, max_length,
                                     where=group[0][0], questions=questions)
        stats["requests"] += 1
        stats["rows_kept"] += len(kept) - dropped
        stats["rows_dropped_too_long"] += dropped
        for s in seqs:
            P = s["segment_ids"].count(0)
            stats["tokens"] += len(s["input_ids"])
            stats["answer_tokens"] += sum(1 for x in s["labels"] if x != IGNORE)
            stats["unpacked_tokens"] += s["n_rows"] * P + len(s["input_ids"]) - P
        sequences += seqs
    stats["sequences"] = len(sequences)
    return sequences, stats


def target_call_ids(tokenizer, request: dict, calls: list[dict],
                    chat_template_kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of a request answered with `calls` in the target's own chat template: the prompt is
    the template with the generation prompt, the answer the assistant turn the template renders for those calls,
    up to and including its end-of-turn token (what the target learns to write, and to stop after)."""
    kwargs = chat_template_kwargs or {}
    tools = request.get("tools") or None
    turn = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}}
                           for c in calls]}
    prompt = tokenizer.apply_chat_template(request["messages"], tools=tools, add_generation_prompt=True,
                                           tokenize=False, **kwargs)
    full = tokenizer.apply_chat_template(request["messages"] + [turn], tools=tools, tokenize=False, **kwargs)
    if not full.startswith(prompt):
        raise InputError(f"record {request.get('id')}: the chat template renders the assistant's call turn as a "
                         "rewrite of the prompt, not a continuation of it; a target cannot learn to write it")
    answer = full[len(prompt):]
    from ..runtime.families import tokenizer_family

    stops = {tokenizer.eos_token, *tokenizer_family(tokenizer).stops}
    ends = [answer.find(t) + len(t) for t in stops if t and t in answer]
    answer = answer[:min(ends)] if ends else answer
    p_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    ids = tokenizer(prompt + answer, add_special_tokens=False).input_ids
    if ids[:len(p_ids)] != p_ids:
        raise InputError(f"record {request.get('id')}: the prompt's tokens change when the answer follows it (the "
                         "template's generation prompt ends inside a token); the answer cannot be split off")
    return p_ids, ids[len(p_ids):]


def pack_targets(tokenizer, requests: dict[str, dict], chat_template_kwargs: dict | None = None,
                 max_length: int | None = None, progress: bool = False) -> tuple[list[dict], dict]:
    """One sequence per request for the target SFT (`train.mode: target`): its prompt (segment 0, no loss) and its
    gold calls as the target's template writes them (segment 1, the loss). The same sequence form as `pack_rows`,
    one row each, so `PackedCollator` and the trainer take it unchanged."""
    stats = {"requests": 0, "rows_in": len(requests), "rows_kept": 0, "rows_dropped_too_long": 0, "sequences": 0,
             "tokens": 0, "answer_tokens": 0, "unpacked_tokens": 0, "function_copies": 0}
    sequences = []
    items = requests.items()
    if progress:
        from tqdm import tqdm
        items = tqdm(items, desc="render", unit="req")
    for rid, request in items:
        prompt, answer = target_call_ids(tokenizer, request, request["gold"], chat_template_kwargs)
        n = len(prompt) + len(answer)
        if max_length is not None and n > max_length:
            stats["rows_dropped_too_long"] += 1
            continue
        sequences.append({"request_id": rid, "input_ids": prompt + answer, "position_ids": list(range(n)),
                          "segment_ids": [0] * len(prompt) + [1] * len(answer),
                          "labels": [IGNORE] * len(prompt) + answer, "n_rows": 1})
        stats["requests"] += 1
        stats["rows_kept"] += 1
        stats["tokens"] += n
        stats["unpacked_tokens"] += n
        stats["answer_tokens"] += len(answer)
    stats["sequences"] = len(sequences)
    return sequences, stats


def packed_attention_mask(segment_ids):
    """Boolean [b, 1, L, L] mask (True = may attend) from segment ids [b, L]: 0 prefix, j row j, -1 padding.

    q sees k iff k <= q and (k in the prefix or k in q's own segment). A padding query sees the padding before it
    and itself, so no attention row is empty (an all-masked row gives NaN in SDPA, and 0 * NaN poisons the
    backward); real tokens never see padding.
    """
    import torch

    L = segment_ids.shape[-1]
    causal = torch.ones(L, L, dtype=torch.bool, device=segment_ids.device).tril()
    q = segment_ids[:, :, None]
    k = segment_ids[:, None, :]
    allowed = ((k == 0) & (q >= 0)) | (k == q)
    return (allowed & causal)[:, None]


def additive_mask(mask, dtype):
    """A boolean mask as the additive float mask eager attention expects (0 where allowed, dtype min elsewhere)."""
    import torch

    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~mask, torch.finfo(dtype).min)


@dataclass
class PackedCollator:
    """Batches packed requests: right-pads to the longest (optionally to a multiple) and builds the 4-D mask.

    Output: input_ids, position_ids, labels [b, L] and attention_mask [b, 1, L, L] (bool; `additive_mask` turns it
    into the float form for eager attention), or [b, L] (1 = token, 0 = padding) where every sequence has one row.
    Padding: pad_token_id, position 0, label -100, segment -1.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, features: list[dict]) -> dict:
        import torch

        L = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            L = -(-L // self.pad_to_multiple_of) * self.pad_to_multiple_of

        def pad(key, value):
            return torch.tensor([list(f[key]) + [value] * (L - len(f[key])) for f in features], dtype=torch.long)

        segments = pad("segment_ids", PAD_SEGMENT)
        # Sequences of one row (a prefix and one answer: the target SFT) need no packed mask: causal attention with
        # the padding masked is the same, and a 2-D mask lets a model build its own (Gemma 3's sliding window).
        plain = bool((segments <= 1).all())
        mask = (segments >= 0).long() if plain else packed_attention_mask(segments)
        return {"input_ids": pad("input_ids", self.pad_token_id), "attention_mask": mask,
                "position_ids": pad("position_ids", 0), "labels": pad("labels", IGNORE)}


def unpacked_rows(sequence: dict) -> list[dict]:
    """The rows of a packed sequence as independent sequences (prefix + suffix + answer, positions from 0).

    This is what training one row at a time sees; the equivalence tests and the profiler compare the two.
    """
    seg = sequence["segment_ids"]
    P = seg.index(1) if 1 in seg else len(seg)
    out = []
    for j in range(1, sequence["n_rows"] + 1):
        idx = [t for t, s in enumerate(seg) if s == j]
        ids = sequence["input_ids"][:P] + [sequence["input_ids"][t] for t in idx]
        out.append({"request_id": sequence["request_id"], "input_ids": ids, "position_ids": list(range(len(ids))),
                    "segment_ids": [0] * P + [1] * len(idx),
                    "labels": [IGNORE] * P + [sequence["labels"][t] for t in idx], "n_rows": 1})
    return out
