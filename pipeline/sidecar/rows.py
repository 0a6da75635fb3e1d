"""Sidecar rows: one function row and one slot row per (tool, parameter), all sharing one prefix.

This module is the single contract between `labels` (which writes SFT rows), `train` (which packs them) and the
wave predictor (which answers them at inference). A row is a chat: a system message carrying the instructions and
the numbered tool block, and a user message carrying the dialogue followed by the row's question. Everything up to
the question is identical across a request's rows, so one KV cache of that prefix serves the whole wave; training packs
the rows the same way (prefix once, then each question + answer).

A slot question is conditional: "if tool [i] is called, the value of p" (`null` when such a call would omit p). The
wave asks it for every (tool, parameter), so it drafts a call for every tool and a wrong function answer no longer
costs the slots; training has an answer only for the called tool, so only its slots become rows.

Label (one per request, from the teacher's call):
    {"id", "tool_index", "name", "arguments", "slots": [{"tool": i, "param": p, "value": v or None}, ...]}
with a slot for every parameter of the called tool `i` (`None` where the call omits it); the other tools' slots have
no label (what they would be called with is unknown) and are not trained.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..schema import param_names, tool_name, tool_params

SYSTEM = ("You predict the tool call an assistant is about to make. The tools are numbered below. "
          "Answer each question with JSON only.")
FUNCTION_QUESTION = "Which tool is called? Answer with its number."
# How a row asks its question (`train.questions` of a sidecar recipe; the wave asks as the adapter was trained).
# `long` spells it out (~30 tokens a slot row); `short` names only the tool and parameter (`[0] get_weather.unit`,
# ~9 tokens with the end of turn): suffixes are most of a wave's prompt tokens, so `short` cuts its prefill.
QUESTION_STYLES = ("long", "short")
SHORT_FUNCTION_QUESTION = "tool"
QUESTION_MARK = "\u2063Q\u2063"  # invisible sentinel used to split the rendered chat into prefix and suffix


class Unknown:
    """An answer that is not valid JSON: the slot is treated as unknown (no hint)."""

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN = Unknown()


def check_question_style(style: str) -> str:
    if style not in QUESTION_STYLES:
        raise ValueError(f"questions={style!r}: expected one of {', '.join(QUESTION_STYLES)}")
    return style


def function_question(style: str = "long") -> str:
    return FUNCTION_QUESTION if check_question_style(style) == "long" else SHORT_FUNCTION_QUESTION


def slot_question(tools: list[dict], tool_index: int, param: str, style: str = "long") -> str:
    if check_question_style(style) == "short":
        return f"[{tool_index}] {tool_name(tools[tool_index])}.{param}"
    return (f"If tool [{tool_index}] {tool_name(tools[tool_index])} is called, the value of {param}? JSON, or null if "
            "such a call would omit it.")


def slot_keys(tools: list[dict]) -> list[tuple[int, str]]:
    """Every (tool index, parameter) of a request, tools in order, parameters in schema order."""
    return [(i, p) for i, t in enumerate(tools) for p in param_names(t)]


def _short(text: str | None, limit: int) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _type_str(schema: dict) -> str:
    if "enum" in schema:
        return "enum{" + "|".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"]) + "}"
    t = schema.get("type", "any")
    if isinstance(t, list):
        t = "|".join(t)
    if t == "array" and isinstance(schema.get("items"), dict):
        return f"array<{_type_str(schema['items'])}>"
    if t == "object" and isinstance(schema.get("properties"), dict) and schema["properties"]:
        return "object{" + ", ".join(f"{k}: {_type_str(v)}" for k, v in schema["properties"].items()) + "}"
    return str(t)


def tool_block(tools: list[dict], compact: bool = True, desc_chars: int = 160, param_desc_chars: int = 80) -> str:
    """The numbered tool list. Compact: one line per tool and per parameter; full: each tool's JSON definition."""
    lines = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if not compact:
            lines.append(f"[{i}] " + json.dumps(fn, ensure_ascii=False))
            continue
        lines.append(f"[{i}] {fn['name']}: {_short(fn.get('description'), desc_chars)}")
        params = tool_params(tool)
        required = set(params.get("required", []))
        for p, s in params.get("properties", {}).items():
            flag = "required" if p in required else "optional"
            default = f", default {json.dumps(s['default'], ensure_ascii=False)}" if "default" in s else ""
            desc = _short(s.get("description"), param_desc_chars) if isinstance(s, dict) else ""
            head = f"  - {p} ({_type_str(s) if isinstance(s, dict) else 'any'}, {flag}{default})"
            lines.append(f"{head}: {desc}" if desc else head)
    return "\n".join(lines)


def dialogue_text(messages: list[dict]) -> str:
    out = []
    for m in messages:
        role = m.get("role", "user")
        content = m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [c.get("function", c) for c in m["tool_calls"]]
            content = (content + " " if content else "") + json.dumps(calls, ensure_ascii=False)
        out.append(f"{role.capitalize()}: {content}")
    return "\n".join(out)


def user_content(request: dict, question: str) -> str:
    """The user message of a row: the dialogue, then the row's question."""
    return "Dialogue:\n" + dialogue_text(request["messages"]) + "\n\nQuestion: " + question


def row_messages(request: dict, question: str, compact: bool = True) -> list[dict]:
    """The prompt of one row in chat form (shared system + dialogue first, the row's question last)."""
    return [
        {"role": "system", "content": SYSTEM + "\n\nTools:\n" + tool_block(request["tools"], compact)},
        {"role": "user", "content": user_content(request, question)},
    ]


def answer_text(value: Any) -> str:
    """Compact JSON of a slot value (`null` for an absent slot)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def parse_answer(text: str) -> Any:
    """A decoded answer as a JSON value, or UNKNOWN when it is not valid JSON."""
    try:
        return json.loads(text.strip())
    except (json.JSONDecodeError, ValueError):
        return UNKNOWN


# A slot answer that is not JSON but one bare word: an identifier, a dotted or file name (`snapshotRequest`,
# `System.out`, `report.pdf`): no spaces, quotes, backslashes, brackets or commas, starting with a letter, `_` or `$`.
# A code model asked for an untyped parameter of a Java or JavaScript tool answers such a word where the call writes the
# string it spells ("snapshotRequest"); anything else that is not JSON stays unknown, and so do a JSON literal cut
# short (`nul`) and Python's literals (`None`, `True`, `False`: a value, not a word).
BARE_WORD = re.compile(r"[A-Za-z_$][^\s\"'\\{}\[\],]*")
NOT_WORDS = {lit[:k] for lit in ("null", "true", "false") for k in range(1, len(lit))} | {"None", "True", "False"}


def parse_slot_answer(text: str) -> Any:
    """A slot answer as a JSON value, a bare word as the string it spells (`BARE_WORD`), else UNKNOWN. The join still
    checks the value against the parameter's schema (a word answered for an integer parameter is dropped there)."""
    value = parse_answer(text)
    if value is UNKNOWN and BARE_WORD.fullmatch(word := text.strip()) and word not in NOT_WORDS:
        return word
    return value


def parse_function_answer(text: str, n_tools: int) -> int | None:
    value = parse_answer(text)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n_tools:
        return None
    return value


def answer_complete(text: str, kind: str, n_tools: int) -> bool:
    """Is `text` already a whole answer, so that the wave can stop the row before its stop token?

    A slot answer is whole once it parses as a JSON value that no further text could extend: a closed string, object
    or array, `null`, `true`, `false` (a number may still grow a digit: it waits for its stop token). A function
    answer is whole once it is a tool index that no further digit could keep in range."""
    text = text.strip()
    if not text:
        return False
    if kind == "function":
        return text.isdigit() and int(text) * 10 >= n_tools
    if text[-1] not in '"]}el':  # a closed string / array / object, or the end of null, true, false
        return False
    value = parse_answer(text)
    if value is UNKNOWN:
        return False
    return isinstance(value, bool) or not isinstance(value, (int, float))


def label_from_call(request: dict, call: dict) -> dict:
    """Function index + a value (or None) for every parameter of the called tool."""
    tools = request["tools"]
    names = [tool_name(t) for t in tools]
    if call["name"] not in names:
        raise ValueError(f"request {request['id']}: call names {call['name']!r}, not one of the offered tools {names}")
    chosen = names.index(call["name"])
    args = call.get("arguments") or {}
    slots = [{"tool": chosen, "param": p, "value": args.get(p)} for p in param_names(tools[chosen])]
    return {"id": request["id"], "tool_index": chosen, "name": call["name"], "arguments": args, "slots": slots}


def build_rows(request: dict, label: dict, compact: bool = True, questions: str = "long") -> list[dict]:
    """SFT rows in trl's conversational prompt-completion format, plus metadata for packing and subsampling.

    Each row: {"prompt": [system, user], "completion": [assistant], "request_id", "kind": function|slot, "tool",
    "param", "chosen" (slot of the called tool: always, for rows built here), "null" (answer is null)}.
    `questions` is the question style (QUESTION_STYLES); packing rebuilds each row's question in the training style
    from the metadata, so rows written in one style train in either.
    """
    tools = request["tools"]
    rows = [{"prompt": row_messages(request, function_question(questions), compact),
             "completion": [{"role": "assistant", "content": str(label["tool_index"])}],
             "request_id": request["id"], "kind": "function", "tool": None, "param": None, "chosen": True,
             "null": False}]
    for slot in label["slots"]:
        i, p, v = slot["tool"], slot["param"], slot["value"]
        if i != label["tool_index"]:
            continue  # a label written before slot rows were conditional: the other tools' answers are unknown
        rows.append({"prompt": row_messages(request, slot_question(tools, i, p, questions), compact),
                     "completion": [{"role": "assistant", "content": answer_text(v)}],
                     "request_id": request["id"], "kind": "slot", "tool": i, "param": p, "chosen": True,
                     "null": v is None})
    return rows


def render_prefix_and_suffixes(tokenizer, request: dict, questions: list[str], compact: bool = True,
                               chat_template_kwargs: dict | None = None) -> tuple[list[int], list[list[int]]]:
    """Token ids of the shared prefix and of each row's suffix (question + end of turn + generation prompt).

    The chat is rendered once with a sentinel in place of the question; the text before it is the prefix, the text
    after it (with each question substituted) the suffixes. Prefix and suffixes are tokenized separately, the same way
    in training and at inference, so the packed training sequence and the wave see identical tokens.
    """
    kw = dict(chat_template_kwargs or {})
    text = tokenizer.apply_chat_template(row_messages(request, QUESTION_MARK, compact), tokenize=False,
                                         add_generation_prompt=True, **kw)
    if text.count(QUESTION_MARK) != 1:
        raise ValueError(f"request {request.get('id')}: the chat template did not render the row question exactly once")
    head, tail = text.split(QUESTION_MARK)
    prefix = tokenizer(head, add_special_tokens=False)["input_ids"]
    suffixes = [tokenizer(q + tail, add_special_tokens=False)["input_ids"] for q in questions]
    return prefix, suffixes


def wave_questions(request: dict, style: str = "long") -> tuple[list[str], list[tuple]]:
    """The questions of one wave and what each asks: ("function",) and ("slot", tool, param) for every tool."""
    tools = request["tools"]
    questions, keys = [function_question(style)], [("function",)]
    for i, p in slot_keys(tools):
        questions.append(slot_question(tools, i, p, style))
        keys.append(("slot", i, p))
    return questions, keys


def answer_ids(tokenizer, content: str) -> list[int]:
    """Completion tokens as training sees them: the answer text then the end-of-turn token."""
    ids = tokenizer(content, add_special_tokens=False)["input_ids"]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if eos is None or eos == tokenizer.unk_token_id:
        eos = tokenizer.eos_token_id
    return ids + [eos]
