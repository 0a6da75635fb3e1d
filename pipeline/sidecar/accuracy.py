"""Sidecar accuracy metrics (pure): score a wave's answers against a reference call, aggregate by benchmark, tabulate.

The reference call of a request is the target's own call where the labels stage has one (its label: the call the
hint must match), else the request's first gold call (with BFCL's `gold_accept` where present); a request with
neither (gold `[]`, or a gold tool that is not offered) is skipped and counted. Every comparison follows
`pipeline.scoring` (strict JSON equality; BFCL acceptable values where the reference has them).

Per benchmark:
  function acc        the function answer names the reference tool; `multi fn acc` the same over requests that offer
                      more than one tool (where the choice is a choice);
  value EM            over the reference tool's parameters that the reference call sets: the slot answer matches;
  null P / null R     `null` as the positive class over the reference tool's parameters: an answer `null` is right
                      where the reference omits the parameter (or its options allow omission); a reference omission
                      is missed by a non-null answer that its options do not accept;
  call EM             the payload's top call names the reference tool and every parameter matches;
  payload / bytes     share of requests with a payload, mean payload bytes (compact JSON, `others` included);
  others              mean number of other tools the payload drafts (their non-null, schema-valid slots);
  wave s / prompts    mean wave latency (p50, p95: nearest rank), its CPU seconds (every thread; waves run one at a
                      time in the stage's process) and prompts per wave; skipped, and which reference the rows were
                      judged by.
The stage that runs the wave and writes the table is `pipeline.stages.sidecar_eval`.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from ..io import InputError, iter_jsonl, where
from ..recipes import load_recipe, section
from ..schema import find_tool, param_names
from ..scoring import slot_match
from .join import join_answers, parse_answers
from .rows import UNKNOWN, Unknown

# (summary key, column, kind): % = a share shown in percent, f = a number, s = text
METRICS = [("function_accuracy", "function acc", "%"), ("slot_exact", "value EM", "%"),
           ("function_accuracy_multi", "multi fn acc", "%"), ("requests_multi", "multi", "n"),
           ("null_precision", "null P", "%"), ("null_recall", "null R", "%"), ("whole_call", "call EM", "%"),
           ("payload_rate", "payload", "%"), ("mean_payload_bytes", "bytes", "f"), ("mean_others", "others", "f"),
           ("mean_latency_s", "wave s", "f"), ("p50_latency_s", "wave p50", "f"), ("p95_latency_s", "wave p95", "f"),
           ("mean_cpu_s", "wave CPU-s", "f"), ("mean_prompts", "prompts", "f"), ("skipped", "skipped", "n"),
           ("reference", "judged against", "s")]


def reference_call(request: dict, label: dict | None = None) -> dict | None:
    """{"tool_index", "arguments", "accept", "source"} of the call to score against, or None (nothing to judge by).

    A label (the target's own call, from the labels stage) wins over gold; its arguments have no options."""
    tools = request["tools"]
    if label is not None:
        return {"tool_index": label["tool_index"], "arguments": label.get("arguments") or {}, "accept": None,
                "source": "labels"}
    gold = request.get("gold") or []
    if not gold or find_tool(tools, gold[0]["name"]) is None:
        return None
    call = gold[0]
    accepts = [a for a in request.get("gold_accept") or [] if a.get("name") == call["name"]]
    return {"tool_index": find_tool(tools, call["name"]), "arguments": call.get("arguments") or {},
            "accept": accepts[0]["arguments"] if accepts else None, "source": "gold"}


def score_request(request: dict, pred: dict, ref: dict) -> dict:
    """One request's counts. `pred`: {"function", "slots": {(tool, param): value}, "payload", "payload_bytes"}."""
    tools, gi = request["tools"], ref["tool_index"]
    accept = ref["accept"] or {}
    s = {"function_correct": pred["function"] == gi, "multi_tool": len(tools) > 1, "value_slots": 0,
         "value_correct": 0, "null_tp": 0, "null_fp": 0, "null_fn": 0, "unknown": 0, "source": ref["source"]}
    for p in param_names(tools[gi]):
        value, gold = pred["slots"].get((gi, p)), ref["arguments"].get(p)
        options = accept.get(p)
        s["unknown"] += isinstance(value, Unknown)
        right = slot_match(value, gold, options)
        if gold is not None:
            s["value_slots"] += 1
            s["value_correct"] += right
        null_right = slot_match(None, gold, options)
        s["null_tp"] += value is None and null_right
        s["null_fp"] += value is None and not null_right
        s["null_fn"] += value is not None and null_right and not right
    payload = pred.get("payload")
    s["has_payload"] = payload is not None
    s["whole_call"] = bool(payload) and payload["tool_index"] == gi and all(
        slot_match(payload["arguments"].get(p), ref["arguments"].get(p), accept.get(p)) for p in param_names(tools[gi]))
    s["payload_bytes"] = pred.get("payload_bytes", 0) if payload is not None else 0
    s["others"] = len(payload.get("others") or {}) if payload is not None else 0
    return s


# ---------------------------------------------------------------- where the misses are

# (category, what it means), in the order the misses table lists them
MISS_KINDS = [
    ("function", "the function answer names another tool (its slots are not judged further)"),
    ("null", "answered null where the reference sets the parameter"),
    ("unparsed", "the answer is not JSON"),
    ("extra", "set a value where the reference omits the parameter"),
    ("type", "a value of another JSON type (e.g. \"5\" for 5, a string for a list)"),
    ("case/space", "a string equal to the reference's but for case, spaces or punctuation"),
    ("partial", "a string inside the reference's, or the reference's inside it (a span cut short or run on)"),
    ("string", "another string"),
    ("number", "another number"),
    ("list/object", "a list or object that differs"),
    ("other", "none of the above (e.g. another boolean)"),
]
_LOOSE = re.compile(r"[\W_]+")


def _json_kind(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(v), "null" if v is None else "other")


def miss_kind(value: Any, reference: Any) -> str:
    """The category of a wrong slot answer `value` (None = null) against the reference's value (None = omitted)."""
    if isinstance(value, Unknown):
        return "unparsed"
    if value is None:
        return "null"
    if reference is None:
        return "extra"
    kind, ref_kind = _json_kind(value), _json_kind(reference)
    if kind != ref_kind:
        return "type"
    if kind == "string":
        a, b = _LOOSE.sub("", value).lower(), _LOOSE.sub("", reference).lower()
        if a == b:
            return "case/space"
        return "partial" if a and b and (a in b or b in a) else "string"
    return {"number": "number", "list": "list/object", "object": "list/object"}.get(kind, "other")


def conversation_text(request: dict) -> str:
    """The text of a request's messages (what a value could be copied from), lower case."""
    parts = []
    for m in request.get("messages") or []:
        content = m.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [c.get("text", "") for c in content if isinstance(c, dict)]
    return "\n".join(parts).lower()


def in_conversation(value: Any, text: str) -> bool:
    """A reference value written out in the conversation: a string verbatim (any case), a number as written."""
    if isinstance(value, str):
        return bool(value.strip()) and value.strip().lower() in text
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        forms = {str(value), json.dumps(value)} | ({str(int(value))} if float(value).is_integer() else set())
        return any(re.search(rf"(?<![\d.]){re.escape(f)}(?![\d])", text) for f in forms)
    return False


def request_misses(request: dict, pred: dict, ref: dict) -> list[dict]:
    """One record per wrong answer of a request: the function when it names another tool, else each wrong slot of
    the reference tool ({"param", "kind", "value", "reference", "in_conversation"})."""
    tools, gi = request["tools"], ref["tool_index"]
    if pred["function"] != gi:
        chosen = pred["function"]
        name = tools[chosen]["function"]["name"] if isinstance(chosen, int) and 0 <= chosen < len(tools) else chosen
        return [{"param": None, "kind": "function", "value": name, "reference": tools[gi]["function"]["name"],
                 "in_conversation": None}]
    accept, text, out = ref["accept"] or {}, conversation_text(request), []
    for p in param_names(tools[gi]):
        value, reference = pred["slots"].get((gi, p)), ref["arguments"].get(p)
        if slot_match(value, reference, accept.get(p)):
            continue
        out.append({"param": p, "kind": miss_kind(value, reference),
                    "value": "UNKNOWN" if isinstance(value, Unknown) else value, "reference": reference,
                    "in_conversation": None if reference is None else in_conversation(reference, text)})
    return out


def misses_table(misses: list[dict]) -> str:
    """Counts of each kind of miss per benchmark (rows: kinds; the last row: the share of wrong set values whose
    reference value is written out in the conversation, i.e. could have been copied)."""
    groups = sorted({m["group"] for m in misses}) + ["all"]
    count = {(g, k): 0 for g in groups for k, _ in MISS_KINDS}
    for m in misses:
        for g in (m["group"], "all"):
            count[(g, m["kind"])] += 1
    lines = ["| miss | " + " | ".join(groups) + " | what it means |", "|" + "---|" * (len(groups) + 2)]
    for k, meaning in MISS_KINDS:
        lines.append(f"| {k} | " + " | ".join(str(count[(g, k)]) for g in groups) + f" | {meaning} |")
    cells = []
    for g in groups:
        vals = [m for m in misses if (g == "all" or m["group"] == g) and m["in_conversation"] is not None]
        cells.append(f"{sum(m['in_conversation'] for m in vals)}/{len(vals)}")
    lines.append("| copyable | " + " | ".join(cells) + " | wrong set values whose reference value is written out in "
                 "the conversation |")
    return "\n".join(lines) + "\n"


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank q-th percentile (None without values): the smallest value with q% of them at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def aggregate(scores: list[dict], skipped: int = 0) -> dict:
    """Summary metrics of scored requests (each may carry "latency_s" and "n_prompts")."""
    n = len(scores)
    tot = {k: sum(s[k] for s in scores) for k in ("value_slots", "value_correct", "null_tp", "null_fp", "null_fn")}
    multi = [s for s in scores if s["multi_tool"]]
    with_payload = [s for s in scores if s["has_payload"]]
    lat = [s["latency_s"] for s in scores if s.get("latency_s") is not None]
    cpu = [s["cpu_s"] for s in scores if s.get("cpu_s") is not None]
    prompts = [s["n_prompts"] for s in scores if s.get("n_prompts") is not None]
    sources = {src: sum(s["source"] == src for s in scores) for src in ("labels", "gold")}
    reference = " + ".join(f"{src} {k}" if all(sources.values()) else src for src, k in sources.items() if k)
    return {
        "requests": n,
        "function_accuracy": _ratio(sum(s["function_correct"] for s in scores), n),
        "requests_multi": len(multi),
        "function_accuracy_multi": _ratio(sum(s["function_correct"] for s in multi), len(multi)),
        "slot_exact": _ratio(tot["value_correct"], tot["value_slots"]),
        "value_slots": tot["value_slots"],
        "null_precision": _ratio(tot["null_tp"], tot["null_tp"] + tot["null_fp"]),
        "null_recall": _ratio(tot["null_tp"], tot["null_tp"] + tot["null_fn"]),
        "unknown": sum(s["unknown"] for s in scores),
        "whole_call": _ratio(sum(s["whole_call"] for s in scores), n),
        "payload_rate": _ratio(len(with_payload), n),
        "mean_payload_bytes": _ratio(sum(s["payload_bytes"] for s in with_payload), len(with_payload)),
        "mean_others": _ratio(sum(s["others"] for s in with_payload), len(with_payload)),
        "mean_latency_s": _ratio(sum(lat), len(lat)),
        "p50_latency_s": percentile(lat, 50),
        "p95_latency_s": percentile(lat, 95),
        "mean_cpu_s": _ratio(sum(cpu), len(cpu)),
        "mean_prompts": _ratio(sum(prompts), len(prompts)),
        "skipped": skipped,
        "reference": reference or "-",
    }


def summarize(scores: list[dict], skipped: dict[str, int] | None = None) -> dict:
    """{"<benchmark>/<split>": ..., "all": ...}; each score carries "group", `skipped` counts per group."""
    skipped = skipped or {}
    groups: dict[str, list[dict]] = {g: [] for g in skipped}
    for s in scores:
        groups.setdefault(s["group"], []).append(s)
    out = {g: aggregate(v, skipped.get(g, 0)) for g, v in sorted(groups.items())}
    out["all"] = aggregate(scores, sum(skipped.values()))
    return out


def _cell(value, kind: str) -> str:
    if value is None:
        return "–"
    if kind == "%":
        return f"{100 * value:.1f}"
    if kind in ("n", "s"):
        return str(value)
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def markdown_table(summary: dict) -> str:
    head = "| benchmark | requests | " + " | ".join(label for _, label, _ in METRICS) + " |"
    lines = [head, "|" + "---|" * (2 + len(METRICS))]
    for group, m in summary.items():
        cells = [_cell(m.get(key), kind) for key, _, kind in METRICS]
        lines.append(f"| {group} | {m['requests']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- prediction rows and labels

def prediction_row(request: dict, pred, fingerprint: str) -> dict:
    """A WavePrediction as one JSON line of the predictions file."""
    slots = [[a["tool"], a["param"], None if isinstance(a["value"], Unknown) else a["value"],
              isinstance(a["value"], Unknown)] for a in pred.answers if a["kind"] == "slot"]
    function = next((a["value"] for a in pred.answers if a["kind"] == "function"), None)
    return {"id": request["id"], "fingerprint": fingerprint, "function": function, "slots": slots,
            "payload": pred.payload, "payload_bytes": pred.payload_bytes, "n_prompts": pred.n_prompts,
            "timings": pred.timings, "answers": [a["text"] for a in pred.answers]}


def reparse_row(request: dict, row: dict) -> dict:
    """The row with its function, slots and payload parsed and joined again from its answer texts by today's
    `join.parse_answers` and `join.join_answers` (the wave's texts do not change with the parse rules, so a stored
    prediction is judged as the runtime would read it today); a row without texts for every question is kept as is."""
    texts = row.get("answers")
    keys = [("function",)] + [("slot", t, p) for t, p, *_ in row["slots"]]
    if not isinstance(texts, list) or len(texts) != len(keys):
        return row
    tools = request.get("tools") or []
    answers = parse_answers(keys, texts, len(tools))
    payload = join_answers(tools, answers).payload
    return {**row, "function": answers[0]["value"], "payload": payload.to_json() if payload else None,
            "payload_bytes": payload.bytes if payload else 0,
            "slots": [[a["tool"], a["param"], None if isinstance(a["value"], Unknown) else a["value"],
                       isinstance(a["value"], Unknown)] for a in answers[1:]]}


def row_prediction(row: dict) -> dict:
    return {"function": row["function"], "payload": row["payload"], "payload_bytes": row["payload_bytes"],
            "slots": {(t, p): UNKNOWN if unknown else v for t, p, v, unknown in row["slots"]}}


def load_labels(paths: list[str | Path]) -> dict[str, dict]:
    """{request id: label} of label JSONL files (the labels stage's `<split>.jsonl`)."""
    labels = {}
    for path in paths:
        for line, lab in iter_jsonl(path):
            if not isinstance(lab.get("id"), str) or not isinstance(lab.get("tool_index"), int):
                raise InputError(f"{where(path, line, lab.get('id'))}: expected a label with a string 'id' and an "
                                 "integer 'tool_index' (a labels stage <split>.jsonl)")
            labels[lab["id"]] = lab
    return labels


def adapter_from_recipe(recipe_path: str) -> Path:
    """checkpoints/sidecar/<recipe>/ of a sidecar recipe (its `sft.output_dir` when the recipe sets one)."""
    return adapter_of(load_recipe(recipe_path))


def adapter_of(recipe: dict) -> Path:
    out = section(recipe, "sft").get("output_dir")
    return Path(out) if out else Path("checkpoints/sidecar") / recipe["recipe_name"]


def base_model_of(adapter: str | Path) -> str:
    path = Path(adapter) / "adapter_config.json"
    if not path.is_file():
        raise InputError(f"{adapter}: no adapter_config.json (expected a peft adapter folder)")
    base = json.loads(path.read_text()).get("base_model_name_or_path")
    if not base:
        raise InputError(f"{path}: no base_model_name_or_path; set sidecar_eval.model")
    return base


__all__ = ["METRICS", "reference_call", "score_request", "aggregate", "summarize", "markdown_table", "prediction_row",
           "reparse_row", "row_prediction", "load_labels", "adapter_from_recipe", "adapter_of", "base_model_of"]
