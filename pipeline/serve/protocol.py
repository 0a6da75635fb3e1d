"""OpenAI chat-completions wire format: request checks -> the project's canonical request, and the response shapes.

`parse_chat(body, model)` turns a request body into a `Chat` (the canonical request {"id", "messages", "tools"} of
docs/architecture.md, "Requests", plus the serving options) or raises `ApiError` with OpenAI's error shape and a
message that names the
field. The server decodes greedily at batch 1, so sampling that would change the output is refused (400) rather
than ignored: temperature > 0, top_p < 1, n > 1, penalties, logit_bias, logprobs, stop sequences, a response format
other than text. `completion`, `chunk` and `usage` build the response objects.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field

from pipeline.schema import schema_errors

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("auto", "none", "required")
# field: (value that means "off", what to say); any other value is refused because decoding is greedy
UNSUPPORTED = {
    "n": (1, "n > 1 (one greedy answer per request)"),
    "top_p": (1, "top_p < 1 (decoding is greedy)"),
    "presence_penalty": (0, "presence_penalty (decoding is greedy)"),
    "frequency_penalty": (0, "frequency_penalty (decoding is greedy)"),
    "logit_bias": ({}, "logit_bias (decoding is greedy)"),
    "logprobs": (False, "logprobs"),
    "top_logprobs": (0, "top_logprobs"),
    "stop": ([], "stop sequences (the target stops at its own end of turn)"),
}


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Chat:
    """One chat-completions request, checked: the canonical request plus what the server does with it."""

    request: dict                      # {"id", "messages", "tools"}: what the runtime sees (tools [] for "none")
    model: str
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    tool_choice: str | dict = "auto"   # "auto" | "none" | "required" | a function name (dict {"name": ...})
    parallel_tool_calls: bool = True
    tenant: str = "anonymous"          # whose history drafts for this request: the API key's digest, else `user`
    cache_salt: str | None = None      # the body's `cache_salt` (vLLM's): its own partition of the prefix caches
    chat_template_kwargs: dict | None = None  # the body's (vLLM's): variables of the target's chat template, over
                                              # the recipe's (e.g. {"enable_thinking": false} for Qwen3)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return self.request["id"]

    @property
    def forced_name(self) -> str | None:
        return self.tool_choice["name"] if isinstance(self.tool_choice, dict) else None

    @property
    def find_calls(self) -> bool:
        """Whether the answer may hold tool calls (the request has tools)."""
        return bool(self.request["tools"])


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


MAX_BODY_BYTES = 8 * 2**20  # a request body larger than this is refused with 413 before it is read in full


async def read_body(request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request's body, read as it arrives; ApiError 413 as soon as it passes `limit` bytes (by its
    Content-Length, or while a chunked upload streams in), so an oversized body is never held in memory."""
    def too_large(size: str) -> ApiError:
        return ApiError(413, f"request body is {size} bytes; this server accepts at most {limit} "
                             "(serve.max_body_bytes)", code="request_too_large")

    declared = request.headers.get("content-length", "").strip()  # the ASGI server has checked it is a number
    if declared.isdigit() and int(declared) > limit:
        raise too_large(declared)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large(f"more than {limit}")
        parts.append(part)
    return b"".join(parts)


def load_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _content(value, where: str) -> str:
    """Message content: a string, or a list of text parts (joined); other parts are refused."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}[{i}]: only text content parts are supported", param=where)
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where}: expected a string or a list of text parts, got {type(value).__name__}", param=where)


def _message(msg, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise bad(f"{where}: expected an object with `role` and `content`", param=where)
    role = msg.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role: {role!r}; expected one of {list(ROLES)}", param=f"{where}.role")
    out = {"role": "system" if role == "developer" else role, "content": _content(msg.get("content"), f"{where}.content")}
    if role == "tool" and msg.get("tool_call_id") is not None:
        out["tool_call_id"] = str(msg["tool_call_id"])
    if role == "assistant" and msg.get("tool_calls"):
        calls = msg["tool_calls"]
        if not isinstance(calls, list):
            raise bad(f"{where}.tool_calls: expected a list", param=f"{where}.tool_calls")
        out["tool_calls"] = [_past_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    return out


def _past_call(call, where: str) -> dict:
    """An earlier assistant tool call; its JSON-string arguments become an object (what chat templates render)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"{where}: expected {{'type': 'function', 'function': {{'name', 'arguments'}}}}", param=where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError as e:
            raise bad(f"{where}.function.arguments is not valid JSON: {e}", param=where) from None
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if call.get("id") is not None:
        out["id"] = str(call["id"])
    return out


def _tools(tools) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("tools: expected a list of {'type': 'function', 'function': {...}}", param="tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad(f"{where}: expected {{'type': 'function', 'function': {{'name', 'parameters'}}}}", param=where)
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad(f"{where}.function.name: expected a non-empty string", param=f"{where}.function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad(f"{where}.function.parameters of {name!r}: expected a JSON Schema object",
                      param=f"{where}.function.parameters", code="invalid_tool_schema")
        errors = schema_errors(params)
        if errors:
            raise bad(f"{where}.function.parameters of {name!r} is not a valid JSON Schema: {'; '.join(errors[:3])}",
                      param=f"{where}.function.parameters", code="invalid_tool_schema")
        # the client's key order is kept: chat templates render the tool with `tojson`, order included
        entry = {k: v for k, v in fn.items() if k in ("name", "description", "parameters")}
        entry.setdefault("parameters", params)
        out.append({"type": "function", "function": entry})
    return out


def _tool_choice(choice, tools: list[dict]):
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise bad(f"tool_choice: {choice!r}; expected one of {list(TOOL_CHOICES)} or a function",
                      param="tool_choice")
        if choice == "required" and not tools:
            raise bad("tool_choice 'required' needs a non-empty tools list", param="tool_choice")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise bad("tool_choice: expected a string or {'type': 'function', 'function': {'name': ...}}",
                  param="tool_choice")
    if name not in [t["function"]["name"] for t in tools]:
        raise bad(f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
    return {"name": name}


def _sampling(body: dict) -> None:
    temperature = body.get("temperature")
    if temperature is not None and (not isinstance(temperature, (int, float)) or temperature != 0):
        raise bad(f"temperature={temperature!r} is not supported: this server decodes greedily (temperature 0); "
                  "leave it out or send 0", param="temperature", code="unsupported_sampling")
    for key, (off, what) in UNSUPPORTED.items():
        value = body.get(key)
        if value is not None and value != off and not (key == "stop" and value in ("", [])):
            raise bad(f"{key}={value!r}: {what} is not supported by this server", param=key,
                      code="unsupported_sampling")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad(f"response_format={fmt!r} is not supported (plain text and tool calls only)",
                  param="response_format", code="unsupported_sampling")


def tenant_of(api_key: str | None, user) -> str:
    """Who a request belongs to, for the history drafter: the API key (only its digest is kept), else the body's
    `user` field, else "anonymous"."""
    if api_key:
        return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:16]
    return f"user:{user}" if user else "anonymous"


# apply_chat_template's own arguments: a body may not set them through chat_template_kwargs (tokenize=true would
# return ids, tools would replace the checked tools)
TEMPLATE_RESERVED = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                               "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                               "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _template_kwargs(value) -> dict | None:
    """The body's `chat_template_kwargs`: an object of at most 32 template variables (identifiers, not one of
    apply_chat_template's own arguments) with JSON values."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > 32:
        raise bad(f"chat_template_kwargs: expected an object of at most 32 template variables, got "
                  f"{type(value).__name__}{f' of {len(value)}' if isinstance(value, dict) else ''}",
                  param="chat_template_kwargs")
    for key in value:
        if not isinstance(key, str) or not key.isidentifier() or key in TEMPLATE_RESERVED:
            raise bad(f"chat_template_kwargs: {key!r} is not a template variable a request may set (identifiers "
                      f"other than {sorted(TEMPLATE_RESERVED)})", param="chat_template_kwargs")
    return dict(value) or None


def parse_chat(body: dict, served_model: str, api_key: str | None = None) -> Chat:
    """A checked `Chat`, or ApiError: 404 for another model, 400 naming the field for anything else."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model: required (a string); see GET /v1/models", param="model")
    if model != served_model:
        raise ApiError(404, f"model {model!r} does not exist; this server serves {served_model!r}", param="model",
                       code="model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages: required, a non-empty list of {'role', 'content'} objects", param="messages")
    _sampling(body)
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise bad(f"max_tokens={max_tokens!r}: expected a positive integer", param="max_tokens")
    stream = body.get("stream") or False
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise bad("stream must be a boolean and stream_options an object", param="stream")
    parallel = body.get("parallel_tool_calls")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad(f"user={user!r}: expected a string", param="user")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > 256):
        raise bad(f"cache_salt={salt!r}: expected a non-empty string of at most 256 characters", param="cache_salt")
    template_kwargs = _template_kwargs(body.get("chat_template_kwargs"))
    request = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
               "messages": [_message(m, i) for i, m in enumerate(messages)],
               "tools": [] if choice == "none" else tools}
    return Chat(request, model, stream=stream, include_usage=bool(options.get("include_usage")),
                max_tokens=max_tokens, tool_choice=choice, parallel_tool_calls=parallel is not False,
                tenant=tenant_of(api_key, user), cache_salt=salt, chat_template_kwargs=template_kwargs)


# --- responses ----------------------------------------------------------------------------------------------------

def usage(prompt_tokens: int, stats) -> dict:
    """OpenAI usage plus `speculative`: how the runtime got there (the output is ar's either way)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": prompt_tokens + stats.new_tokens,
            "speculative": {"method": stats.method, "forwards": stats.forwards,
                            "tokens_per_forward": round(stats.mean_accepted, 3), "hint_tokens": stats.hint_tokens,
                            "hint_ready_s": None if stats.hint_ready_s is None else round(stats.hint_ready_s, 4),
                            "hint_error": stats.hint_error, "prefill_s": round(stats.prefill_s, 4),
                            "decode_s": round(stats.decode_s, 4)}}


def tool_calls(calls, ids: list[str]) -> list[dict]:
    return [{"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c, i in zip(calls, ids)]


def finish_reason(calls, stop: str) -> str:
    return "length" if stop == "length" else "tool_calls" if calls else "stop"


def completion(chat: Chat, view, ids: list[str], stop: str, use: dict) -> dict:
    message = {"role": "assistant", "content": view.content or None}
    if view.calls:
        message["tool_calls"] = tool_calls(view.calls, ids)
    return {"id": chat.id, "object": "chat.completion", "created": chat.created, "model": chat.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(view.calls, stop),
                         "logprobs": None}],
            "usage": use}


def chunk(chat: Chat, delta: dict | None = None, finish: str | None = None, use: dict | None = None) -> dict:
    """One `chat.completion.chunk`; with `use` and no delta, the usage chunk (choices empty) of stream_options."""
    out = {"id": chat.id, "object": "chat.completion.chunk", "created": chat.created, "model": chat.model,
           "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish,
                                                 "logprobs": None}]}
    if use is not None:
        out["usage"] = use
    return out


__all__ = ["ApiError", "Chat", "parse_chat", "load_body", "usage", "completion", "chunk", "finish_reason",
           "tool_calls", "bad"]
