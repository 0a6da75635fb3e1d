"""Sidecar accuracy: run the wave on requests and score it against gold calls (or teacher labels), by benchmark.

Metrics (the reference call is a request's first gold call, or its label with `--labels`):
  function accuracy   the function answer names the reference tool;
  slot exact match    over the reference tool's parameters: the slot answer equals the reference value (`null` for an
                      absent parameter); with BFCL's `gold_accept` a value matches if it is one of the acceptable
                      values ("" in the list: omission is acceptable; a dict of lists is matched key by key); an
                      answer that is not JSON never matches; equality is strict JSON (1 == 1.0, true != 1);
  null precision/recall   `null` as the positive class over the same slots (gold null = parameter absent);
  other-tool null rate    share of the other tools' slots answered `null` (what training teaches there);
  whole-call exact    the payload names the reference tool and its arguments match on every parameter;
  payload rate / mean payload bytes (over requests with a payload), mean wave latency and prompts per wave.

Run as: python -m pipeline.sidecar.accuracy --adapter checkpoints/sidecar/<recipe> \
            --requests data/requests/bfcl/test.jsonl data/requests/api_bank/test.jsonl [--labels ...] [--limit N]
(`--model` defaults to the adapter's base model; `--recipe R` stands for the adapter that R trains).
Writes <out>.json (summary + config + input checksums), <out>.md (the table) and <out>.predictions.jsonl (one row
per request; a rerun with the same settings resumes from it, other settings or adapter weights start it afresh).
Default <out>: <adapter>/accuracy.json, where `upload` finds it for the model card.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..io import InputError, ResumableJsonl, atomic_open, iter_jsonl, sha256_file, where, write_json
from ..recipes import load_recipe, section
from ..requests import load_requests
from ..schema import find_tool, param_names
from .rows import Unknown

METRICS = [("function_accuracy", "function acc", "%"), ("slot_exact", "slot EM", "%"),
           ("null_precision", "null P", "%"), ("null_recall", "null R", "%"), ("whole_call", "call EM", "%"),
           ("payload_rate", "payload", "%"), ("mean_payload_bytes", "bytes", "f"), ("mean_latency_s", "wave s", "f"),
           ("mean_prompts", "prompts", "f")]


# ---------------------------------------------------------------- matching rules (pure)

def values_equal(a: Any, b: Any) -> bool:
    """Strict JSON equality: numbers compare by value (1 == 1.0), booleans only with booleans."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _is_accept_dict(alt: Any) -> bool:
    return isinstance(alt, dict) and bool(alt) and all(isinstance(v, list) for v in alt.values())


def _omission_ok(options: list) -> bool:
    return any(o is None or (isinstance(o, str) and o == "") for o in options)


def accept_match(pred: Any, acceptable: list) -> bool:
    """`pred` (None = omitted) is one of BFCL's acceptable values."""
    if isinstance(pred, Unknown):
        return False
    for alt in acceptable:
        if isinstance(alt, str) and alt == "" and pred is None:
            return True
        if _is_accept_dict(alt) and isinstance(pred, dict):
            if set(pred) <= set(alt) and all(accept_match(pred[k], opts) if k in pred else _omission_ok(opts)
                                             for k, opts in alt.items()):
                return True
            continue
        if isinstance(alt, list) and isinstance(pred, list) and len(alt) == len(pred):
            if all(accept_match(p, [a]) for p, a in zip(pred, alt)):
                return True
            continue
        if values_equal(pred, alt):
            return True
    return False


def slot_match(pred: Any, gold: Any, acceptable: list | None = None) -> bool:
    if isinstance(pred, Unknown):
        return False
    if acceptable is not None:
        return accept_match(pred, acceptable)
    return values_equal(pred, gold)


def reference_call(request: dict, label: dict | None = None) -> dict | None:
    """{"tool_index", "arguments", "accept"} of the call to score against, or None (no gold, tool not offered)."""
    tools = request["tools"]
    if label is not None:
        return {"tool_index": label["tool_index"], "arguments": label.get("arguments") or {}, "accept": None}
    gold = request.get("gold") or []
    if not gold or find_tool(tools, gold[0]["name"]) is None:
        return None
    call = gold[0]
    accepts = [a for a in request.get("gold_accept") or [] if a.get("name") == call["name"]]
    return {"tool_index": find_tool(tools, call["name"]), "arguments": call.get("arguments") or {},
            "accept": accepts[0]["arguments"] if accepts else None}


def score_request(request: dict, pred: dict, ref: dict) -> dict:
    """One request's counts. `pred`: {"function", "slots": {(tool, param): value}, "payload", "payload_bytes"}."""
    tools, gi = request["tools"], ref["tool_index"]
    accept = ref["accept"] or {}
    s = {"function_correct": pred["function"] == gi, "slots": 0, "slots_correct": 0, "null_tp": 0, "null_fp": 0,
         "null_fn": 0, "other_slots": 0, "other_null": 0, "unknown": 0}
    for i, tool in enumerate(tools):
        for p in param_names(tool):
            value = pred["slots"].get((i, p))
            s["unknown"] += isinstance(value, Unknown)
            if i != gi:
                s["other_slots"] += 1
                s["other_null"] += value is None
                continue
            gold_value = ref["arguments"].get(p)
            s["slots"] += 1
            s["slots_correct"] += slot_match(value, gold_value, accept.get(p) if p in accept else None)
            s["null_tp"] += value is None and gold_value is None
            s["null_fp"] += value is None and gold_value is not None
            s["null_fn"] += value is not None and gold_value is None
    payload = pred.get("payload")
    s["has_payload"] = payload is not None
    s["whole_call"] = bool(payload) and payload["tool_index"] == gi and all(
        slot_match(payload["arguments"].get(p), ref["arguments"].get(p), accept.get(p) if p in accept else None)
        for p in param_names(tools[gi]))
    s["payload_bytes"] = pred.get("payload_bytes", 0) if payload is not None else 0
    return s


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def aggregate(scores: list[dict]) -> dict:
    """Summary metrics of scored requests (each may carry "latency_s" and "n_prompts")."""
    n = len(scores)
    tot = {k: sum(s[k] for s in scores) for k in ("slots", "slots_correct", "null_tp", "null_fp", "null_fn",
                                                   "other_slots", "other_null", "unknown")}
    with_payload = [s for s in scores if s["has_payload"]]
    lat = [s["latency_s"] for s in scores if s.get("latency_s") is not None]
    prompts = [s["n_prompts"] for s in scores if s.get("n_prompts") is not None]
    return {
        "requests": n,
        "function_accuracy": _ratio(sum(s["function_correct"] for s in scores), n),
        "slot_exact": _ratio(tot["slots_correct"], tot["slots"]),
        "null_precision": _ratio(tot["null_tp"], tot["null_tp"] + tot["null_fp"]),
        "null_recall": _ratio(tot["null_tp"], tot["null_tp"] + tot["null_fn"]),
        "other_tool_null_rate": _ratio(tot["other_null"], tot["other_slots"]),
        "unknown_rate": _ratio(tot["unknown"], tot["slots"] + tot["other_slots"]),
        "whole_call": _ratio(sum(s["whole_call"] for s in scores), n),
        "payload_rate": _ratio(len(with_payload), n),
        "mean_payload_bytes": _ratio(sum(s["payload_bytes"] for s in with_payload), len(with_payload)),
        "mean_latency_s": _ratio(sum(lat), len(lat)),
        "mean_prompts": _ratio(sum(prompts), len(prompts)),
        "slots": tot["slots"],
    }


def summarize(scores: list[dict]) -> dict:
    """{"all": ..., "<benchmark>/<split>": ...} (each score carries "group")."""
    groups: dict[str, list[dict]] = {}
    for s in scores:
        groups.setdefault(s["group"], []).append(s)
    out = {g: aggregate(v) for g, v in sorted(groups.items())}
    out["all"] = aggregate(scores)
    return out


def markdown_table(summary: dict) -> str:
    head = "| benchmark | requests | " + " | ".join(label for _, label, _ in METRICS) + " |"
    lines = [head, "|" + "---|" * (2 + len(METRICS))]
    for group, m in summary.items():
        cells = []
        for key, _, kind in METRICS:
            v = m.get(key)
            cells.append("–" if v is None else f"{100 * v:.1f}" if kind == "%" else f"{v:.2f}" if v < 10 else
                         f"{v:.1f}")
        lines.append(f"| {group} | {m['requests']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- running the wave

def prediction_row(request: dict, pred, fingerprint: str) -> dict:
    """A WavePrediction as one JSON line of the predictions file."""
    slots = [[a["tool"], a["param"], None if isinstance(a["value"], Unknown) else a["value"],
              isinstance(a["value"], Unknown)] for a in pred.answers if a["kind"] == "slot"]
    function = next((a["value"] for a in pred.answers if a["kind"] == "function"), None)
    return {"id": request["id"], "fingerprint": fingerprint, "function": function, "slots": slots,
            "payload": pred.payload, "payload_bytes": pred.payload_bytes, "n_prompts": pred.n_prompts,
            "timings": pred.timings, "answers": [a["text"] for a in pred.answers]}


def row_prediction(row: dict) -> dict:
    from .rows import UNKNOWN

    return {"function": row["function"], "payload": row["payload"], "payload_bytes": row["payload_bytes"],
            "slots": {(t, p): UNKNOWN if unknown else v for t, p, v, unknown in row["slots"]}}


def load_labels(paths: list[str]) -> dict[str, dict]:
    labels = {}
    for path in paths:
        for line, lab in iter_jsonl(path):
            if "id" not in lab or "tool_index" not in lab:
                raise InputError(f"{where(path, line, lab.get('id'))}: expected a label with 'id' and 'tool_index'")
            labels[lab["id"]] = lab
    return labels


def adapter_from_recipe(recipe_path: str) -> Path:
    """checkpoints/sidecar/<recipe>/ of a sidecar recipe (its `sft.output_dir` when the recipe sets one)."""
    recipe = load_recipe(recipe_path)
    out = section(recipe, "sft").get("output_dir")
    return Path(out) if out else Path("checkpoints/sidecar") / recipe["recipe_name"]


def base_model_of(adapter: str | Path) -> str:
    path = Path(adapter) / "adapter_config.json"
    if not path.is_file():
        raise InputError(f"{adapter}: no adapter_config.json (expected a peft adapter folder)")
    base = json.loads(path.read_text()).get("base_model_name_or_path")
    if not base:
        raise InputError(f"{path}: no base_model_name_or_path; pass --model")
    return base


def make_wave(args):
    kwargs = dict(max_value_tokens=args.max_value_tokens, compact=args.compact,
                  chat_template_kwargs=json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else None)
    if args.backend == "vllm":
        from .vllm_backend import VllmWave

        return VllmWave(args.model, args.adapter, **kwargs)
    from .wave import SlotWave

    return SlotWave(args.model, args.adapter, dtype=args.dtype, **kwargs)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description="Sidecar accuracy by benchmark (function, slots, nulls, whole call).")
    ap.add_argument("--model", help="base model folder or hub id (default: the adapter's base model)")
    ap.add_argument("--adapter", help="peft adapter folder, e.g. checkpoints/sidecar/<recipe>")
    ap.add_argument("--recipe", help="sidecar recipe: the adapter is its output folder (instead of --adapter)")
    ap.add_argument("--requests", nargs="+", required=True, help="canonical request JSONL file(s)")
    ap.add_argument("--labels", nargs="*", default=[], help="label JSONL file(s): score against these, not gold")
    ap.add_argument("--limit", type=int, default=None, help="first N requests of each file")
    ap.add_argument("--out", help="summary JSON path (default <adapter>/accuracy.json)")
    ap.add_argument("--backend", choices=("transformers", "vllm"), default="transformers")
    ap.add_argument("--max-value-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tool-block", choices=("compact", "full"), help="default: as the adapter was trained")
    ap.add_argument("--chat-template-kwargs", help='JSON, e.g. \'{"enable_thinking": false}\' (default: as trained)')
    ap.add_argument("--batch", type=int, default=64, help="requests per generate call (vllm backend)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--fresh", action="store_true", help="ignore earlier predictions")
    args = ap.parse_args(argv)
    args.compact = None if args.tool_block is None else args.tool_block == "compact"
    if args.recipe and not args.adapter:
        args.adapter = str(adapter_from_recipe(args.recipe))
    if args.model is None:
        if args.adapter is None:
            ap.error("pass --model, --adapter (or --recipe), or both")
        args.model = base_model_of(args.adapter)
    out = Path(args.out) if args.out else (Path(args.adapter) if args.adapter else
                                           Path("eval/sidecar") / Path(args.model).name) / "accuracy.json"
    requests = load_requests(args.requests, args.limit, how="even")
    labels = load_labels(args.labels)

    config = {k: v for k, v in vars(args).items() if k not in ("fresh", "threads", "batch", "out", "compact")}
    weights = [p for p in (Path(args.adapter or "-") / n for n in ("adapter_model.safetensors", "adapter_model.bin"))
               if p.is_file()]
    fingerprint = json.dumps({k: config[k] for k in ("model", "adapter", "backend", "max_value_tokens", "dtype",
                                                     "tool_block", "chat_template_kwargs")}, sort_keys=True)
    fingerprint += sha256_file(weights[0]) if weights else ""
    preds_path = out.with_name(out.stem + ".predictions.jsonl")
    for path in (preds_path, preds_path.with_name(preds_path.name + ".partial")):
        if path.exists() and (args.fresh or _stale(path, fingerprint)):
            path.unlink()  # predictions of another model, adapter or setting
    store = ResumableJsonl(preds_path)
    todo = [r for r in requests if r["id"] not in store.done_ids()]
    if todo:
        from tqdm import tqdm

        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        wave = make_wave(args)
        step = args.batch if args.backend == "vllm" else 1
        with tqdm(total=len(todo), desc="sidecar-eval", unit="req") as bar:
            for k in range(0, len(todo), step):
                chunk = todo[k:k + step]
                preds = wave.predict_many(chunk) if step > 1 else [wave.predict(chunk[0])]
                for req, pred in zip(chunk, preds):
                    store.write(prediction_row(req, pred, fingerprint))
                bar.update(len(chunk))
    store.finish()
    rows = {r["id"]: r for _, r in iter_jsonl(preds_path)}

    scores, skipped = [], 0
    for req in requests:
        ref = reference_call(req, labels.get(req["id"]) if labels else None)
        if ref is None or (labels and req["id"] not in labels):
            skipped += 1
            continue
        s = score_request(req, row_prediction(rows[req["id"]]), ref)
        s.update(group=f"{req.get('benchmark', '?')}/{req.get('split', '?')}", latency_s=rows[req["id"]]
                 ["timings"].get("total"), n_prompts=rows[req["id"]]["n_prompts"])
        scores.append(s)
    summary = summarize(scores)
    result = {"summary": summary, "skipped_without_reference": skipped, "reference": "labels" if labels else "gold",
              "config": config, "inputs": {p: sha256_file(p) for p in args.requests + args.labels},
              "predictions": str(preds_path)}
    write_json(out, result)
    table = markdown_table(summary)
    with atomic_open(out.with_suffix(".md")) as f:
        f.write(table)
    print(table + f"\nwrote {out} ({len(scores)} scored, {skipped} without a reference call)")
    return result


def _stale(path: Path, fingerprint: str) -> bool:
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    try:
        return json.loads(first).get("fingerprint") != fingerprint
    except json.JSONDecodeError:
        return True


if __name__ == "__main__":
    main()
