"""The `sidecar_eval` stage: run the sidecar's wave on requests and score it by benchmark (`make sidecar-eval`).

Run as: python -m pipeline.stages.sidecar_eval --recipe recipes/sidecar/smollm2-135m-cpu-v9.yaml [sidecar_eval.limit=25]

Reads the `sidecar_eval:` section of a sidecar recipe; the adapter is the one the recipe trains (`sft.output_dir`,
else checkpoints/sidecar/<recipe>) unless `sidecar_eval.adapter` names another (a recipe without `train:` runs the
bare model), the model is the adapter's base model unless `sidecar_eval.model` names one. Requests: `limit` evenly spaced requests per file (every subset represented). Reference
calls: with `teacher`, the labels in `<data_dir>/labels/<teacher>/` (the target's own calls, what a hint must
match) where a request has one, gold otherwise; the table says which. Metrics: `pipeline.sidecar.accuracy`.
Writes into `<out>` (default `<adapter>/sidecar_eval/`):
    predictions.jsonl   one row per request (function answer, every slot answer, payload, timings); a rerun with the
                        same model, adapter weights and settings resumes from it, other settings start it afresh;
                        its answers are parsed and joined again from the stored texts by today's rules (a change of
                        the parse re-judges the waves without running them; the file is rewritten where a row changed)
    accuracy.json       summary by benchmark + all, skipped requests, config; with labels also `summary_gold`, the
                        same predictions judged against gold only, and `summary_calls`, without the requests whose
                        target trace answers with text (`text_answers`: gold was their reference, though the
                        target calls nothing there); accuracy.md the table(s); manifest.json
    misses.jsonl        every wrong answer (the function, or a slot: its kind, value, reference value and whether the
                        reference value is written out in the conversation), counted by kind in accuracy.md
"""

from __future__ import annotations

import glob
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..artifacts import seal
from ..hardware import cpu_sample, cpu_usage, machine
from ..io import InputError, ResumableJsonl, atomic_open, dumps, iter_jsonl, sha256_file, write_json, write_manifest
from ..recipes import load_recipe, section
from ..eval.report import BUSY_FOREIGN_CORES as BUSY_CORES
from ..requests import load_requests
from ..sidecar.config import SidecarConfig
from . import StageConfig
from . import main as stage_main
from ..sidecar.accuracy import (adapter_of, base_model_of, load_labels, markdown_table, misses_table, prediction_row,
                                reference_call, reparse_row, request_misses, row_prediction, score_request, summarize)

BACKENDS = ("transformers", "vllm")


@dataclass
class Config(StageConfig, SidecarConfig):
    """The wave's settings (`SidecarConfig`: model, adapter, dtype, merge_adapter, slot_tools, quantize, ...; the
    same names and defaults as a recipe's `sidecar:` section) and what to judge it on."""
    requests: list[str] = field(default_factory=list)  # request JSONL files (globs allowed); required
    limit: int | None = None                # evenly spaced requests per file (None: all)
    teacher: str | None = None              # judge by <data_dir>/labels/<teacher>/ where a request has a label
    data_dir: str = "data"
    out: str | None = None                  # default: <adapter>/sidecar_eval
    backend: str = "transformers"           # or vllm (all of a batch's waves in one generate call)
    tool_block: str | None = None           # compact | full; default: as the adapter was trained
    chat_template_kwargs: dict | None = None  # default: as the adapter was trained
    batch: int = 64                         # requests per generate call (vllm)
    threads: int | None = None              # torch CPU threads
    fresh: bool = False                     # ignore earlier predictions


KEYS = Config.keys()  # every field but `recipe` (StageConfig.keys)
FINGERPRINT_KEYS = ("model", "adapter", "backend", "max_value_tokens", "dtype", "merge_adapter", "tool_block",
                    "chat_template_kwargs", "required_values", "slot_tools")


def resolve(recipe_path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """The sidecar recipe's `sidecar_eval:` section with overrides, checked (`from_recipe`)."""
    if recipe_path is None:
        raise InputError("sidecar_eval: --recipe is required (a recipes/sidecar/*.yaml file with a sidecar_eval: "
                         "section)")
    return from_recipe(load_recipe(recipe_path, overrides), str(recipe_path))


def from_recipe(recipe: dict, where_: str = "recipe") -> Config:
    sec = dict(section(recipe, "sidecar_eval", KEYS, where_))
    if not sec.get("requests"):
        raise InputError(f"{where_}: sidecar_eval.requests is required (request JSONL files, globs allowed)")
    cfg = Config(**sec, recipe=recipe)
    if isinstance(cfg.requests, str):
        cfg.requests = [cfg.requests]
    if cfg.backend not in BACKENDS:
        raise InputError(f"{where_}: sidecar_eval.backend={cfg.backend!r}; expected one of {BACKENDS}")
    if cfg.tool_block not in (None, "compact", "full"):
        raise InputError(f"{where_}: sidecar_eval.tool_block={cfg.tool_block!r}; expected compact or full")
    if "timeout_s" in sec:
        raise InputError(f"{where_}: sidecar_eval.timeout_s: sidecar-eval waits for every wave (a server's setting)")
    try:
        cfg.validate()
    except ValueError as err:
        raise InputError(f"{where_}: {err}".replace("sidecar.", "sidecar_eval.")) from None
    if cfg.quantize is not None:
        if cfg.backend != "transformers":
            raise InputError(f"{where_}: sidecar_eval.quantize runs on the transformers backend only (backend is "
                             f"{cfg.backend!r})")
    if cfg.adapter is None and "train" in recipe:  # a recipe that trains an adapter evaluates it
        cfg.adapter = str(adapter_of(recipe))
    if cfg.model is None:
        if cfg.adapter is None:
            raise InputError(f"{where_}: set sidecar_eval.model, sidecar_eval.adapter, or both")
        cfg.model = base_model_of(cfg.adapter)
    return cfg


def request_paths(cfg: Config) -> list[str]:
    paths = []
    for pattern in cfg.requests:
        found = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        if not found:
            raise InputError(f"sidecar_eval.requests: {pattern!r} matches no file (run `make data` first)")
        paths += found
    return paths


def label_paths(cfg: Config) -> list[Path]:
    if not cfg.teacher:
        return []
    folder = Path(cfg.data_dir) / "labels" / cfg.teacher
    if not folder.is_dir():  # no target traces labelled yet: every request is judged by gold, and the table says so
        print(f"note: {folder}: no labels for teacher {cfg.teacher!r} yet (`make traces && make labels` with its "
              "recipe); every request is judged against its gold call", file=sys.stderr)
        return []
    return sorted(p for p in folder.glob("*.jsonl") if p.name != "rejected.jsonl")


def rejected_file(labels_files: list[Path]) -> Path | None:
    """The labels stage's `rejected.jsonl` beside the label files, where there is one."""
    path = labels_files[0].parent / "rejected.jsonl" if labels_files else None
    return path if path is not None and path.is_file() else None


def text_answers(labels_files: list[Path]) -> set[str]:
    """Ids of the requests whose target trace answers with text, not a call: the labels stage rejected them as
    "unparsed" with no tool call found (`rejected_file`). They have no label, so gold is their reference, though the
    target makes no call there for a hint to draft."""
    from .labels import NO_CALL

    path = rejected_file(labels_files)
    if path is None:
        return set()  # labels made before rejections were kept, or none: every request stays
    return {r["id"] for _, r in iter_jsonl(path) if r.get("reason") == "unparsed" and r.get("detail") == NO_CALL}


def out_dir(cfg: Config) -> Path:
    if cfg.out:
        return Path(cfg.out)
    return (Path(cfg.adapter) if cfg.adapter else Path("eval/sidecar") / Path(cfg.model).name) / "sidecar_eval"


def fingerprint(cfg: Config) -> str:
    """What the predictions depend on: a change starts them afresh."""
    fields = {k: getattr(cfg, k) for k in FINGERPRINT_KEYS}
    for key in ("quantize", "prepack"):  # only when set: predictions made before the key existed keep their fingerprint
        if getattr(cfg, key):
            fields[key] = getattr(cfg, key)
    text = json.dumps(fields, sort_keys=True)
    weights = [p for p in (Path(cfg.adapter or "-") / n for n in ("adapter_model.safetensors", "adapter_model.bin"))
               if p.is_file()]
    return text + (sha256_file(weights[0]) if weights else "")


def make_wave(cfg: Config):
    kwargs = dict(max_value_tokens=cfg.max_value_tokens, chat_template_kwargs=cfg.chat_template_kwargs,
                  compact=None if cfg.tool_block is None else cfg.tool_block == "compact",
                  required_values=cfg.required_values)
    if cfg.backend == "vllm":
        from ..sidecar.vllm_backend import VllmWave

        if cfg.slot_tools is not None:
            raise InputError("sidecar_eval.slot_tools (a staged wave) runs on the transformers backend only; "
                             "set backend: transformers or slot_tools: null")

        return VllmWave(cfg.model, cfg.adapter, **kwargs)
    from ..sidecar.wave import SlotWave

    settings = {k: getattr(cfg, k) for k in SidecarConfig.keys()}
    settings["merge_adapter"] = bool(cfg.merge_adapter and cfg.adapter)
    return SlotWave(cfg.model, cfg.adapter, config=SidecarConfig(**settings), **kwargs)


def predict(cfg: Config, requests: list[dict], preds_path: Path) -> dict[str, dict]:
    """Prediction rows of `requests`, resumed from `preds_path` when it holds the same fingerprint."""
    fp = fingerprint(cfg)
    for path in (preds_path, preds_path.with_name(preds_path.name + ".partial")):
        if path.exists() and (cfg.fresh or _stale(path, fp)):
            path.unlink()  # predictions of another model, adapter or setting
    store = ResumableJsonl(preds_path)
    todo = [r for r in requests if r["id"] not in store.done_ids()]
    if todo:
        from tqdm import tqdm

        if cfg.threads:
            import torch

            torch.set_num_threads(cfg.threads)
        wave = make_wave(cfg)
        step = cfg.batch if cfg.backend == "vllm" else 1
        with tqdm(total=len(todo), desc="sidecar_eval", unit="req") as bar:
            for k in range(0, len(todo), step):
                chunk = todo[k:k + step]
                before = cpu_sample() if step == 1 else None
                preds = wave.predict_many(chunk) if step > 1 else [wave.predict(chunk[0])]
                if step == 1:  # one wave: its CPU seconds, and the CPU other processes used meanwhile
                    used = cpu_usage(before, cpu_sample())
                    preds[0].timings["cpu_s"] = used["cpu_s"]
                    if used["machine_cpu_s"] is not None:
                        preds[0].timings["others_cpu_s"] = max(0.0, used["machine_cpu_s"] - used["cpu_s"])
                for req, pred in zip(chunk, preds):
                    store.write(prediction_row(req, pred, fp))
                bar.update(len(chunk))
    store.finish()
    # parsed again from the stored answer texts: a change of the parse or join rules re-judges the waves without
    # running them again (the file is rewritten where a row changed, so it says what was scored)
    by_id = {r["id"]: r for r in requests}
    rows = [(r, reparse_row(by_id[r["id"]], r) if r["id"] in by_id else r)
            for _, r in iter_jsonl(preds_path)]
    if any(new != old for old, new in rows):
        with atomic_open(preds_path) as f:
            f.writelines(dumps(new) + "\n" for _, new in rows)
    return {new["id"]: new for _, new in rows}


def _stale(path: Path, fp: str) -> bool:
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    try:
        return json.loads(first).get("fingerprint") != fp
    except json.JSONDecodeError:
        return True


def score(requests: list[dict], rows: dict[str, dict], labels: dict[str, dict],
          misses: list[dict] | None = None) -> dict:
    """The summary of `rows` judged by each request's label where `labels` has one, else by its gold call; each wrong
    answer is appended to `misses` when given (`request_misses`, with the request's id and group)."""
    scores, skipped = [], {}
    for req in requests:
        group = f"{req.get('benchmark', '?')}/{req.get('split', '?')}"
        ref = reference_call(req, labels.get(req["id"]))
        if ref is None:
            skipped[group] = skipped.get(group, 0) + 1
            continue
        skipped.setdefault(group, 0)
        row = rows[req["id"]]
        pred = row_prediction(row)
        s = score_request(req, pred, ref)
        if misses is not None:
            misses += [{"id": req["id"], "group": group, "source": ref["source"], **m}
                       for m in request_misses(req, pred, ref)]
        s.update(group=group, latency_s=row["timings"].get("total"), n_prompts=row["n_prompts"],
                 cpu_s=row["timings"].get("cpu_s"))
        scores.append(s)
    return summarize(scores, skipped)


def machine_line(cfg: Config, rows: dict[str, dict]) -> str:
    """The machine the waves ran on and whether anything else ran beside them (busy: other processes used more than
    BUSY_CORES cores on average during a wave; waves predicted before cpu_s was recorded are not counted)."""
    m = machine("float32" if cfg.quantize else cfg.dtype, cfg.threads)
    if cfg.quantize:
        m["dtype"] = f"{cfg.quantize} linear layers (down_proj kept out), float32 elsewhere"
    timed = [r["timings"] for r in rows.values() if "others_cpu_s" in r["timings"]]
    busy = sum(t["others_cpu_s"] > BUSY_CORES * t["total"] for t in timed)
    return (f"Machine: {m['cpu'].get('model')}, {m['cpu'].get('cores')} cores, flags {' '.join(m['cpu'].get('flags', []))}"
            f", torch {m.get('torch')}; dtype {m.get('dtype')}, {m.get('threads')} threads. Busy waves: {busy} of "
            f"{len(timed)} timed (other processes used more than {BUSY_CORES} cores during the wave).")


def run(cfg: Config) -> dict:
    """Predict, score, write; returns what accuracy.json holds."""
    paths, labels_files = request_paths(cfg), label_paths(cfg)
    requests = load_requests(paths, cfg.limit, how="even")
    labels = load_labels(labels_files)
    out = out_dir(cfg)
    rows = predict(cfg, requests, out / "predictions.jsonl")

    misses: list[dict] = []
    summary = score(requests, rows, labels, misses)
    # the same predictions against the benchmarks' gold calls alone: how far the target's calls (what a hint must
    # match) and gold differ, and a figure comparable with runs that had no labels
    summary_gold = score(requests, rows, {}) if labels else None
    # and without the requests the target answered with text (judged by gold above, where the target calls nothing)
    text = sorted(text_answers(labels_files) & {r["id"] for r in requests})
    summary_calls = score([r for r in requests if r["id"] not in text], rows, labels) if text else None
    config = {k: v for k, v in cfg.settings().items() if k not in ("fresh", "threads", "batch")}
    rejected = rejected_file(labels_files)
    inputs = [*paths, *map(str, labels_files), *([str(rejected)] if rejected else [])]
    result = {"summary": summary, "reference": summary["all"]["reference"], "summary_gold": summary_gold,
              "summary_calls": summary_calls, "text_answers": text,
              "config": config, "inputs": {p: sha256_file(p) for p in inputs},
              "predictions": str(out / "predictions.jsonl")}
    write_json(out / "accuracy.json", result)
    with atomic_open(out / "misses.jsonl") as f:
        f.writelines(json.dumps(m, ensure_ascii=False) + "\n" for m in misses)
    table = machine_line(cfg, rows) + "\n\n" + markdown_table(summary)
    if summary_gold:
        table += "\nThe same predictions judged against gold only:\n\n" + markdown_table(summary_gold)
    if summary_calls:
        table += (f"\nThe same predictions without the {len(text)} requests whose target trace answers with text "
                  f"(no call to draft; judged against gold above): {', '.join(text)}\n\n"
                  + markdown_table(summary_calls))
    table += (f"\nWhere the misses are ({summary['all']['reference']}; each in misses.jsonl):\n\n"
              + misses_table(misses))
    with atomic_open(out / "accuracy.md") as f:
        f.write(table)
    write_manifest(out, "sidecar_eval", {"recipe": cfg.recipe, "resolved": config}, inputs)
    seal(out)
    print(table + f"\nwrote {out} ({summary['all']['requests']} scored, {summary['all']['skipped']} skipped without a "
                  "reference call)")
    return result


def main(argv: list[str] | None = None) -> dict:
    """The command line (the stage contract: pipeline/stages/__init__.py)."""
    return stage_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
