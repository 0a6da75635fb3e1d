"""Model families: what a chat template cannot tell about how a target writes a tool call, one table entry each.

`hint.call_formats` learns the rest from the template itself (rendered with the request's `chat_template_kwargs`):
the call's opening and closing, the JSON style, and the key the arguments go under (`parameters` for Llama 3.x).
What the template does not say, and only a family's documentation or its outputs do, is a row of `FAMILIES`:
- `stops`: the end-of-turn tokens a call's closing ends before (Llama 3.1 ends a tool call with `<|eom_id|>` as
  well as `<|eot_id|>`);
- `think`: the reasoning block a target may write before its call (Qwen3 with `enable_thinking`), skipped when the
  output is aligned with a call opening;
- `openers`: openings the target writes that the template never renders (Llama 3.1's `<|python_tag|>`).
A family is recognised by text its template contains (`markers`, all of them, the first row that fits); a template
that fits no row is `GENERIC`, which stops at every row's end-of-turn tokens. Adding a family is adding a row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    markers: tuple[str, ...]                 # text the chat template contains (all of it)
    stops: tuple[str, ...]                   # end-of-turn tokens: the call's closing ends before them
    think: tuple[str, str] | None = None     # (open, close) of a reasoning block written before the call
    openers: tuple[str, ...] = ()            # call openings the target writes that the template does not render
    call_format: str = "template"            # how the family's calls look, for the eval report


FAMILIES = (
    Family("qwen3", ("<|im_start|>", "<think>"), ("<|im_end|>", "<|endoftext|>"), think=("<think>", "</think>"),
           call_format="<think>...</think> <tool_call>{json}</tool_call>"),
    Family("smollm2", ("<|im_start|>", "<tool_call>["), ("<|im_end|>", "<|endoftext|>"),
           call_format="<tool_call>[{json}, ...]</tool_call> (APIGen list)"),
    Family("qwen2.5", ("<|im_start|>", "<tool_call>"), ("<|im_end|>", "<|endoftext|>"),
           call_format="<tool_call>{json}</tool_call> (Coder: ```json fence)"),
    Family("chatml", ("<|im_start|>",), ("<|im_end|>", "<|endoftext|>"), call_format="no template format"),
    Family("llama3", ("<|start_header_id|>",), ("<|eot_id|>", "<|eom_id|>"), openers=("<|python_tag|>",),
           call_format='bare {"name", "parameters"} (or <|python_tag|>)'),
    Family("mistral", ("[TOOL_CALLS]",), ("</s>",), call_format="[TOOL_CALLS][{json}]"),
    Family("gemma-tools", ("<start_of_turn>", '"parameters"'), ("<end_of_turn>",),
           call_format='bare {"name", "parameters"} (the Gemma docs\' function-calling prompt)'),
    Family("gemma", ("<start_of_turn>",), ("<end_of_turn>",), call_format="no template format (```json fence)"),
)
GENERIC = Family("generic", (), tuple(dict.fromkeys(s for f in FAMILIES for s in f.stops)),
                 call_format="no template format")


def family_of(template: str | None) -> Family:
    """The first row of `FAMILIES` whose markers the chat template contains; `GENERIC` where none does."""
    if not isinstance(template, str):
        return GENERIC
    return next((f for f in FAMILIES if all(m in template for m in f.markers)), GENERIC)


def tokenizer_family(tokenizer) -> Family:
    template = getattr(tokenizer, "chat_template", None)
    return family_of(template if isinstance(template, str) else None)


__all__ = ["Family", "FAMILIES", "GENERIC", "family_of", "tokenizer_family"]
