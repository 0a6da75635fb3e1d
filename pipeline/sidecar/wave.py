"""The slot-wave predictor (transformers backend): one request -> function choice + every slot -> payload.

One wave answers all of a request's questions (`rows.wave_questions`: the function row and one row per (tool,
parameter)) at once:
  1. prefill: the shared prefix (system + tools + dialogue) in one forward; its KV cache is written once into each
     row's slot of the batch cache (`rows_cache`); the suffixes, left-padded, go through one forward with a 2-D mask
     [ones over the prefix | zeros over the padding | ones over the suffix] and position ids that continue from the
     prefix length, so every row sees exactly `prefix + its suffix` (only the last position's logits are computed);
  2. decode: greedy, all rows in parallel, at most `max_value_tokens` tokens; a row stops at <|im_end|> / eos or as
     soon as its text is a whole answer (a closed JSON value; a tool index no digit can extend) and leaves the batch
     (`batch_select_indices`), so short answers (`null`) do not pay for long ones; each step writes the
     preallocated batch cache in place;
  3. join (`join.py`): answers parsed as JSON (not JSON -> unknown), the chosen tool's valid slots -> the payload's
     top call, every other tool's non-null valid slots -> its `others` (`pipeline.payload`).
Each row's tokens equal those of running `prefix + suffix` alone with greedy decoding (tests check this in
float64 on tiny Llama, Qwen2 and Qwen3 models).

Run as: python -m pipeline.sidecar.wave --model DIR [--adapter DIR] --requests FILE.jsonl [--limit N]
torch / transformers / peft are imported lazily, so `vllm_backend` can reuse the shared parts in an environment
with another transformers version.
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from ..hardware import resolve_dtype
from ..io import looks_like_hub_id
from .config import DEFAULT_MAX_VALUE_TOKENS, SidecarConfig
from .join import answer_json, join_answers, parse_answers
from ..requests import stop_token_ids
from ..schema import tool_params
from .rows import answer_complete, check_question_style, render_prefix_and_suffixes, wave_questions

class Cancelled(Exception):
    """The wave's `cancelled()` check said its request has ended: abandoned between decode steps."""


# Bumped whenever the wave computes differently for the same weights (eval rows of another revision are measured
# again): 2 = the suffix forward's last-position logits by index (was logits_to_keep=1, which copied the output
# embedding once per row); 3 = a required parameter's answer cannot be `null` (`required_values`); 4 = the prefix
# forward without the output layer and the staged wave's first logits by index (`fill_cache`: each copied the output
# embedding once).
WAVE_REVISION = 4


@dataclass
class WavePrediction:
    payload: dict | None  # the payload's JSON form (`Payload.to_json()`), None without a valid function answer
    answers: list[dict]  # [{"kind": function|slot, "tool", "param", "text", "value"}]; value may be rows.UNKNOWN
    timings: dict[str, float]  # seconds: render, prefill, decode, join, total (vLLM: render, generate, join, total)
    payload_bytes: int
    n_prompts: int
    join_report: dict | None = None  # dropped slots, missing required parameters, whole-call errors
    token_counts: dict | None = None  # prefix, suffix (all rows) and generated tokens

    def to_json(self) -> dict:
        return {"payload": self.payload, "answers": [answer_json(a) for a in self.answers], "timings": self.timings,
                "payload_bytes": self.payload_bytes, "n_prompts": self.n_prompts, "join_report": self.join_report,
                "token_counts": self.token_counts}


def wave_inputs(tokenizer, request: dict, compact: bool = True, chat_template_kwargs: dict | None = None,
                questions: str = "long"):
    """(prefix ids, suffix ids per question, question keys) of a request's wave; `questions` is the question style."""
    asked, keys = wave_questions(request, questions)
    prefix, suffixes = render_prefix_and_suffixes(tokenizer, request, asked, compact, chat_template_kwargs)
    return prefix, suffixes, keys


def required_rows(request: dict, keys: list[tuple]) -> list[int]:
    """The wave rows that ask for a parameter its tool's schema requires: their answer may not be `null` (a call of
    that tool writes a value there; a null answer would give the hint nothing for it)."""
    required = [set(r) if isinstance(r := tool_params(t).get("required"), list) else set()
                for t in request.get("tools") or []]
    return [r for r, k in enumerate(keys) if k[0] == "slot" and k[2] in required[k[1]]]


def null_openings(tokenizer, vocab_size: int) -> list[int]:
    """Token ids whose text, leading whitespace aside, starts with "n": the only JSON value that starts with n is
    `null`, so banning these while a row's text is still blank bans exactly a null answer."""
    texts = tokenizer.batch_decode([[i] for i in range(min(vocab_size, len(tokenizer)))], skip_special_tokens=False)
    return [i for i, t in enumerate(texts) if t.lstrip().startswith("n")]


def tool_probs(logits, tool_ids: list[int]):
    """The function row's probability of each tool: its next-token `logits` [V] at the tool index tokens, softmaxed
    over those tokens alone (float32)."""
    return logits[tool_ids].float().softmax(-1)


def top_tools(probs, n: int, mass: float | None = None) -> list[int]:
    """The `n` most probable tools, most probable first; with `mass`, only as many of them as it takes for their
    probability to reach `mass` (a policy scripts/slot_tools_coverage.py weighs: one tool where the function row is
    sure, up to `n` where it hesitates; the staged wave asks the top `n`)."""
    order = probs.sort(descending=True, stable=True).indices
    k = min(int(n), len(order))
    if mass is not None:
        k = min(k, int((probs[order].cumsum(0) < mass).sum()) + 1)
    return order[:k].tolist()


def tools_to_ask(logits, keys: list[tuple], tool_ids: list[int] | None, n: int) -> list[int] | None:
    """The rows of a staged wave: the function row and the slot rows of the `n` tools whose index token ranks highest
    in the function row's next-token `logits` (`top_tools`); None (every row) when the tool indices are not single
    tokens or `n` covers every tool."""
    if tool_ids is None or n >= len(tool_ids):
        return None
    top = set(top_tools(tool_probs(logits, tool_ids), n))
    return [r for r, k in enumerate(keys) if k[0] == "function" or k[1] in top]


def decode(tokenizer, ids: list[int]) -> str:
    """Ids -> text, special tokens kept (the fast backend directly where there is one: the wave decodes every live
    row at every step to see whether its answer is whole)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode(ids, skip_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=False)


def answer_texts(tokenizer, token_rows: list[list[int]], stop_ids) -> list[str]:
    """Decode each row's tokens up to (not including) its first stop token."""
    stop = set(stop_ids)
    texts = []
    for toks in token_rows:
        cut = next((i for i, t in enumerate(toks) if t in stop), len(toks))
        texts.append(tokenizer.decode(toks[:cut], skip_special_tokens=False))
    return texts


def finish_prediction(request: dict, keys: list[tuple], texts: list[str], timings: dict[str, float],
                      t_start: float) -> WavePrediction:
    """Parse the answers, join them into the payload, close the timings."""
    t0 = time.perf_counter()
    answers = parse_answers(keys, texts, len(request["tools"]))
    joined = join_answers(request["tools"], answers)
    timings["join"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - t_start
    payload = joined.payload
    return WavePrediction(payload=payload.to_json() if payload else None, answers=answers, timings=timings,
                          payload_bytes=payload.bytes if payload else 0, n_prompts=len(keys),
                          join_report=joined.report)


class PromptSettings(NamedTuple):
    compact: bool
    chat_template_kwargs: dict
    questions: str


def prompt_settings(adapter: str | Path | None, compact: bool | None = None,
                    chat_template_kwargs: dict | None = None, questions: str | None = None) -> PromptSettings:
    """How the wave must render its prompts: given values win, else those the adapter was trained with
    (`train.compact`, `train.chat_template_kwargs`, `train.questions` of <adapter>/recipe.yaml), else (True, {},
    "long")."""
    trained: dict = {}
    recipe = Path(adapter) / "recipe.yaml" if adapter is not None else None
    if recipe is not None and recipe.is_file():
        import yaml

        trained = (yaml.safe_load(recipe.read_text()) or {}).get("train") or {}
    if compact is None:
        compact = bool(trained.get("compact", True))
    if chat_template_kwargs is None:
        chat_template_kwargs = dict(trained.get("chat_template_kwargs") or {})
    if questions is None:
        questions = str(trained.get("questions", "long"))
    return PromptSettings(compact, dict(chat_template_kwargs), check_question_style(questions))


def load_sidecar(model: str | Path, adapter: str | Path | None = None, dtype="float32", merge_adapter: bool = False):
    """(model, tokenizer): the base model, with the peft adapter on top when given; the adapter's tokenizer wins.

    `merge_adapter`: the LoRA update is folded into the base weights (W + BA, computed in float32 and only then cast
    to `dtype`, so a bf16 model is rounded once, not twice): a plain model without the adapter's extra matmuls, adds
    and dropout modules per projection (scripts/bench_wave.py --methods wave wave-merged measures the difference)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for path, what in ((model, "model"), (adapter, "adapter")):
        if path is not None and not Path(path).exists() and not looks_like_hub_id(path):
            raise FileNotFoundError(f"{what} folder {path} does not exist")
    if adapter is not None and Path(adapter).exists() and not (Path(adapter) / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{adapter}: no adapter_config.json (expected a peft adapter folder)")
    tok_dir = model
    if adapter is not None and (looks_like_hub_id(adapter) or (Path(adapter) / "tokenizer_config.json").is_file()):
        tok_dir = adapter
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    from ..hardware import torch_dtype

    merge = adapter is not None and merge_adapter
    # merged at least in float32 (in float64 for a float64 model), cast to `dtype` afterwards
    load_dtype = "float32" if merge and torch_dtype(dtype) != torch_dtype("float64") else dtype
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype(load_dtype))
    if adapter is not None:
        from peft import PeftModel

        lm = PeftModel.from_pretrained(lm, str(adapter))
        if merge:
            lm = lm.merge_and_unload().to(torch_dtype(dtype))
    lm.eval()
    return lm, tokenizer


def prepack_linears(model) -> int:
    """Swap every `nn.Linear` of a CPU model in bfloat16 or float32 for one whose weight oneDNN reordered once into
    its blocked layout (the output layer included: a copy of a tied embedding); returns how many. A plain bf16
    `F.linear` packs its weight again on every call: on the sidecar's decode (one thread, AVX-512 BF16) 150 cold
    `[3, 576] x [576, 1536]` products read their weights at 7.5 GB/s plain and 11.3 GB/s prepacked (the core streams
    26 GB/s), and a whole wave (16 requests) takes 16% less time with the same payloads. 0 where this torch has no
    oneDNN linear (the model is left as it is), for other dtypes (float64: the tests' exact models) and off the CPU."""
    import torch

    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return 0

    class Prepacked(torch.nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.in_features, self.out_features = linear.in_features, linear.out_features
            self.packed = ops._reorder_linear_weight(linear.weight.detach(), 4)  # 4: the batch it is tuned for
            self.bias = None if linear.bias is None else linear.bias.detach()

        def forward(self, x):
            return ops._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    n = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if (type(child) is torch.nn.Linear and child.weight.device.type == "cpu"
                    and child.weight.dtype in (torch.bfloat16, torch.float32)):
                setattr(module, name, Prepacked(child))
                n += 1
    return n


INT8_KEEP = ("down_proj",)  # linears `quantize_linears` leaves out of int8 (by the last part of their name)


def quantize_linears(model, keep: tuple[str, ...] = INT8_KEEP) -> int:
    """Swap the `nn.Linear`s of a float32 CPU model for torch's dynamically quantized ones: int8 weights per output
    channel, activations quantized per call, products in int8 (fbgemm / oneDNN, VNNI where the CPU has it), the output
    layer included; returns how many. The layers named in `keep` (default: the MLP's `down_proj`, whose input, the
    gated activation, carries the outliers one scale per call flattens) multiply in bf16 where the CPU has native bf16
    (oneDNN-prepacked, `prepack_linears`), float32 elsewhere: keeping `down_proj` out keeps most answers equal to
    the float model's for a few percent of the speed (docs/experiments.md, "int8 wave"). torch's
    `quantize_dynamic` is deprecated in favour of torchao, which ran slower than bf16 here without torch.compile,
    so this keeps torch's; its deprecation warning is silenced here. Raises where this torch
    has no quantized CPU engine or a linear is not float32 on the CPU (load the model in float32)."""
    import warnings

    import torch
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    from ..hardware import native_bf16

    if not set(torch.backends.quantized.supported_engines) - {"none"}:
        raise RuntimeError("quantize=int8: this torch has no quantized CPU engine (fbgemm, x86, onednn or qnnpack)")
    linears = {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    bad = [m for m in linears.values() if m.weight.dtype != torch.float32 or m.weight.device.type != "cpu"]
    if bad:
        raise ValueError(f"quantize=int8: {len(bad)} linear layer(s) are {bad[0].weight.dtype} on "
                         f"{bad[0].weight.device}; expected float32 on the CPU (load the sidecar with dtype float32)")
    kept = [name for name in linears if name.rsplit(".", 1)[-1] in keep]
    if kept and native_bf16():
        class Bf16Linear(torch.nn.Module):
            """A linear in bf16 (prepacked where oneDNN can) inside a float32 model: casts in and out."""

            def __init__(self, linear):
                super().__init__()
                self.inner = torch.nn.Sequential(torch.nn.Linear(linear.in_features, linear.out_features,
                                                                 bias=linear.bias is not None, dtype=torch.bfloat16))
                with torch.no_grad():
                    self.inner[0].weight.copy_(linear.weight)
                    if linear.bias is not None:
                        self.inner[0].bias.copy_(linear.bias)
                prepack_linears(self.inner)

            def forward(self, x):
                return self.inner(x.to(torch.bfloat16)).to(x.dtype)

        for name in kept:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, Bf16Linear(linears[name]))
    spec = {name: per_channel_dynamic_qconfig for name in linears if name not in kept}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_dynamic(model, spec, dtype=torch.qint8, inplace=True)
    return len(spec)


class SlotWave:
    """A sidecar model answering one request's wave per `predict` call (state: the model and tokenizer).

    `model`: a folder / hub id, or a loaded model (then pass `tokenizer=`). `adapter`: a peft adapter folder; its
    recipe.yaml supplies `compact`, `chat_template_kwargs` and `questions` unless given. `stop_ids` overrides the stop tokens.
    `early_stop`: a row leaves the batch as soon as its text is a whole answer (`rows.answer_complete`), without
    waiting for its stop token (false: only at the stop token or the cap). `prealloc`: the batch cache is
    preallocated and written in place (false: transformers' DynamicCache repeated per row, which copies the whole
    cache at every step; kept for scripts/bench_wave.py's before/after).
    The wave's settings are `SidecarConfig`'s fields (pipeline/sidecar/config.py: one set of defaults for the worker,
    eval, serve and sidecar-eval), given as `config=` and/or by name. What they do here: `required_values`: a row that
    asks for a parameter its tool requires cannot answer `null` (`required_rows`). `slot_tools`: a staged wave; the
    function row's suffix runs first and only the slots of the `slot_tools` tools its first token ranks highest are
    decoded (`tools_to_ask`). `prefix_cache`: keep the prefix KV of recent waves, up to this many tokens in all, and
    start a wave from the longest prefix another request shared with it (never a request's own earlier wave, and
    only within the request's `cache_salt`: `PrefixCache`). `prepack`: the linear weights reordered once for oneDNN
    (`prepack_linears`); the model can no longer be trained or moved. `quantize="int8"`: the linears but `down_proj`
    in int8 (`quantize_linears`; loaded and merged in float32): answers can differ from the float model's (judge
    them with `make sidecar-eval`).
    """

    def __init__(self, model, adapter: str | Path | None = None, *, tokenizer=None, config: SidecarConfig | None = None,
                 compact: bool | None = None, chat_template_kwargs: dict | None = None, prune_finished: bool = True,
                 stop_ids: list[int] | None = None, early_stop: bool = True, prealloc: bool = True,
                 questions: str | None = None, **settings):
        try:  # the wave's settings: `config` (default SidecarConfig()) with `settings` (its field names) on top
            cfg = replace(config or SidecarConfig(), **settings)
        except TypeError:
            raise ValueError(f"SlotWave: unknown setting(s) {sorted(set(settings) - SidecarConfig.keys())}; expected "
                             f"SidecarConfig's fields {sorted(SidecarConfig.keys())}") from None
        cfg.validate()
        if cfg.quantize is not None and adapter is not None and not cfg.merge_adapter:
            raise ValueError("sidecar.quantize needs the adapter folded into the base weights (merge_adapter: true)")
        self.config = cfg
        dtype = "float32" if cfg.quantize else resolve_dtype(cfg.dtype, cfg.device)
        merge_adapter, max_value_tokens, prepack = cfg.merge_adapter, cfg.max_value_tokens, cfg.prepack
        required_values, slot_tools, prefix_cache, quantize = (cfg.required_values, cfg.slot_tools, cfg.prefix_cache,
                                                                cfg.quantize)
        if isinstance(model, (str, Path)):
            self.model, self.tokenizer = load_sidecar(model, adapter, dtype, merge_adapter)
        else:
            if tokenizer is None:
                raise ValueError("SlotWave(model object): pass tokenizer= as well")
            if adapter is not None:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, str(adapter))
                model = model.merge_and_unload() if merge_adapter else model
            self.model, self.tokenizer = model.eval(), tokenizer
        if tokenizer is not None:
            self.tokenizer = tokenizer
        self.max_value_tokens = int(max_value_tokens)
        self.compact, self.chat_template_kwargs, self.questions = prompt_settings(adapter, compact, chat_template_kwargs,
                                                                                  questions)
        self.prune_finished, self.early_stop, self.prealloc = prune_finished, early_stop, prealloc
        if cfg.device != "cpu":
            self.model.to(cfg.device)
        self.prepacked = prepack_linears(self.model) if prepack and cfg.device == "cpu" else 0
        self.quantized = quantize_linears(self.model) if quantize else 0
        self.required_values = bool(required_values)
        self.slot_tools = None if slot_tools is None else int(slot_tools)
        from ..runtime.target import PrefixCache

        self.prefixes = PrefixCache(max_tokens=int(prefix_cache)) if prefix_cache else None
        self.cached_tokens = 0  # of the last wave's prefix, from the prefix cache
        self._null_ids = None  # null_openings, computed on first use
        self.stop_ids = list(stop_ids) if stop_ids is not None else stop_token_ids(
            self.tokenizer, getattr(self.model, "generation_config", None))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]

    def predict(self, request: dict, cancelled=None) -> WavePrediction:
        """The wave on `request`; `cancelled()`, checked before every forward, abandons it (raises `Cancelled`)."""
        t_start = time.perf_counter()
        prefix, suffixes, keys = wave_inputs(self.tokenizer, request, self.compact, self.chat_template_kwargs,
                                             self.questions)
        timings = {"render": time.perf_counter() - t_start}
        n_tools = len(request.get("tools") or [])
        rows_of = None
        if self.slot_tools is not None and self.slot_tools < n_tools:
            rows_of = lambda logits: tools_to_ask(logits, keys, self._tool_ids(n_tools), self.slot_tools)  # noqa: E731
        token_rows, run_timings = self.run(prefix, suffixes, (lambda r, text: answer_complete(text, keys[r][0], n_tools))
                                           if self.early_stop else None, cancelled,
                                           required_rows(request, keys) if self.required_values else None, rows_of,
                                           key=request.get("id"), salt=request.get("cache_salt"))
        timings.update(run_timings)
        texts = answer_texts(self.tokenizer, token_rows, self.stop_ids)
        pred = finish_prediction(request, keys, texts, timings, t_start)
        pred.token_counts = {"prefix": len(prefix), "suffix": sum(map(len, suffixes)),
                             "generated": sum(map(len, token_rows)),
                             "rows": sum(1 for t in token_rows if t), "cached": self.cached_tokens}
        return pred

    def _tool_ids(self, n_tools: int) -> list[int] | None:
        """The token of each tool index's answer ("0", "1", ...), or None where one is not a single token (then its
        first token does not say which tool)."""
        ids = [self.tokenizer(str(i), add_special_tokens=False)["input_ids"] for i in range(n_tools)]
        return [t[0] for t in ids] if all(len(t) == 1 for t in ids) and len({t[0] for t in ids}) == n_tools else None

    def run(self, prefix: list[int], suffixes: list[list[int]], complete=None,
            cancelled=None, not_null=None, rows_of=None, key: str | None = None,
            salt: str | None = None) -> tuple[list[list[int]], dict]:
        """Greedy tokens of every row `prefix + suffixes[b]`: each ends at its stop token, at the cap, or as soon as
        `complete(b, text)` says its text so far is a whole answer (the row then leaves the batch). `cancelled()` is
        checked before every forward: true raises `Cancelled`. Rows in `not_null` cannot open a `null` (greedy
        over the other tokens while their text is blank). `rows_of(logits)`: a staged wave; row 0's suffix runs
        alone first, and `rows_of` gets its next-token logits [V] and returns the rows to decode (row 0 always
        among them) or None for all; rows left out get no tokens. `key`: the request's id (the prefix cache never
        offers a request its own prefix); `salt`: its partition of the prefix cache (the request's `cache_salt`)."""
        import torch

        with torch.inference_mode():
            if rows_of is None or len(suffixes) == 1:
                return self._run(prefix, suffixes, complete, cancelled, not_null, key=key, salt=salt)
            t0 = time.perf_counter()
            cache = self._prefix_cache(prefix, key, salt)
            chosen = rows_of(self._first_logits(cache, len(prefix), suffixes[0]))
            if chosen is None:
                tokens, timings = self._run(prefix, suffixes, complete, cancelled, not_null, cache=cache)
            else:
                sub = sorted(set(chosen) | {0})
                at = {r: i for i, r in enumerate(sub)}
                tokens_sub, timings = self._run(
                    prefix, [suffixes[r] for r in sub],
                    (lambda i, text: complete(sub[i], text)) if complete is not None else None, cancelled,
                    [at[r] for r in (not_null or ()) if r in at], cache=cache)
                tokens = [[] for _ in suffixes]
                for i, r in enumerate(sub):
                    tokens[r] = tokens_sub[i]
            timings["prefill"] = time.perf_counter() - t0 - timings["decode"]
            return tokens, timings

    def _prefix_cache(self, prefix: list[int], key: str | None = None, salt: str | None = None):
        """The prefix's KV in a DynamicCache: the longest prefix the prefix cache shares with it (another request's),
        then one forward over the rest; stored for the waves after it."""
        import torch
        from transformers import DynamicCache

        from ..runtime.target import fill_cache

        dev = self.model.device
        cache = DynamicCache(config=self.model.config)
        done, layers = self.prefixes.lookup(prefix, key, salt) if self.prefixes is not None else (0, None)
        if layers is not None:
            done = min(done, len(prefix))
            for i, (k, v) in enumerate(layers):  # views of the stored tensors: the cache only grows by concatenation
                cache.update(k[..., :done, :], v[..., :done, :], i)
        if done < len(prefix):
            fill_cache(self.model, input_ids=torch.tensor([prefix[done:]], device=dev),
                       position_ids=torch.arange(done, len(prefix), device=dev)[None], cache=cache)
        self.cached_tokens = done
        if self.prefixes is not None:
            self.prefixes.store(prefix, key, cache, salt)
        return cache

    def _first_logits(self, prefix_cache, n_prefix: int, suffix: list[int]):
        """Next-token logits [V] of one row `prefix + suffix`, from the prefix's cache (left as it was)."""
        import torch

        dev = self.model.device
        cache = rows_cache(copy.copy(prefix_cache), 1, n_prefix + len(suffix))  # rows_cache rebinds .layers
        out = self.model(input_ids=torch.tensor([suffix], device=dev),
                         attention_mask=torch.ones((1, n_prefix + len(suffix)), dtype=torch.long, device=dev),
                         position_ids=torch.arange(n_prefix, n_prefix + len(suffix), device=dev)[None],
                         cache=cache, use_cache=True, logits_to_keep=torch.tensor([len(suffix) - 1], device=dev))
        return out.logits[0, -1]

    def _null_mask(self, vocab_size: int):
        import torch

        if self._null_ids is None or self._null_ids.numel() != vocab_size:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=self.model.device)
            mask[null_openings(self.tokenizer, vocab_size)] = True
            self._null_ids = mask
        return self._null_ids

    def _ban_null(self, logits, live_rows: list[int], blank: set[int]):
        """Greedy next tokens of `logits` [B, V]; rows of the live batch whose wave row is in `blank` skip null."""
        ban = [i for i, r in enumerate(live_rows) if r in blank]
        if ban:
            logits[ban] = logits[ban].masked_fill(self._null_mask(logits.shape[-1]), float("-inf"))
        return logits.argmax(-1)

    def _run(self, prefix, suffixes, complete=None, cancelled=None, not_null=None, cache=None, key=None, salt=None):
        import torch

        if not prefix or not suffixes or any(not s for s in suffixes):
            raise ValueError("a wave needs a non-empty prefix and non-empty suffixes")
        dev = self.model.device
        t0 = time.perf_counter()
        n_rows, n_prefix, width = len(suffixes), len(prefix), max(len(s) for s in suffixes)

        # Prefix once: [1, P] -> cache (or the staged wave's), written once into each row's slot of a preallocated
        # batch cache.
        if cache is None:
            cache = self._prefix_cache(prefix, key, salt)
        if self.prealloc:
            cache = rows_cache(cache, n_rows, n_prefix + width + self.max_value_tokens)
        else:
            cache.batch_repeat_interleave(n_rows)

        # Suffixes left-padded to [B, W]; mask [B, P + W]; positions continue from P (pad positions are unused).
        ids = torch.full((n_rows, width), self.pad_id, dtype=torch.long, device=dev)
        mask = torch.zeros((n_rows, n_prefix + width), dtype=torch.long, device=dev)
        mask[:, :n_prefix] = 1
        positions = torch.full((n_rows, width), n_prefix, dtype=torch.long, device=dev)
        for b, suffix in enumerate(suffixes):
            ids[b, width - len(suffix):] = torch.tensor(suffix, device=dev)
            mask[b, n_prefix + width - len(suffix):] = 1
            positions[b, width - len(suffix):] = torch.arange(n_prefix, n_prefix + len(suffix), device=dev)
        if cancelled is not None and cancelled():
            raise Cancelled
        # the last position's logits by index, not by `logits_to_keep=1`: that slice [B, 1, H] is not contiguous, so
        # torch's matmul expands the output embedding to [B, H, vocab] and copies it (1.5 GB and ~3 s for 27 rows)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                         logits_to_keep=torch.tensor([width - 1], device=dev))
        blank = set(not_null or ())  # rows that may not answer null and have written nothing but whitespace yet
        next_tok = self._ban_null(out.logits[:, -1], list(range(n_rows)), blank)  # [B]
        next_pos = positions[:, -1] + 1  # [B]
        t1 = time.perf_counter()

        # Greedy decode; `rows` maps the live batch back to the wave's rows.
        stop = torch.tensor(self.stop_ids, device=dev)
        tokens: list[list[int]] = [[] for _ in range(n_rows)]
        rows = torch.arange(n_rows, device=dev)
        done = torch.zeros(n_rows, dtype=torch.bool, device=dev)  # per live row: it has emitted its stop token
        stop_set = set(self.stop_ids)
        for step in range(self.max_value_tokens):
            finished = []  # live rows whose answer is whole without a stop token
            for i, (r, t, d) in enumerate(zip(rows.tolist(), next_tok.tolist(), done.tolist())):
                if not d:
                    tokens[r].append(t)
                    if r in blank and decode(self.tokenizer, tokens[r]).strip():
                        blank.discard(r)
                    if complete is not None and t not in stop_set and complete(r, decode(self.tokenizer, tokens[r])):
                        finished.append(i)
            done = done | torch.isin(next_tok, stop)
            if finished:
                done[finished] = True
            if step == self.max_value_tokens - 1 or done.all():
                break
            if self.prune_finished and done.any():
                keep = (~done).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                rows, next_tok, next_pos = rows[keep], next_tok[keep], next_pos[keep]
                mask, done = mask[keep], done[keep]
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            if cancelled is not None and cancelled():
                raise Cancelled
            out = self.model(input_ids=next_tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                             cache=cache, use_cache=True)
            next_tok = self._ban_null(out.logits[:, -1], rows.tolist(), blank) if blank else out.logits[:, -1].argmax(-1)
            next_pos = next_pos + 1
        t2 = time.perf_counter()
        return tokens, {"prefill": t1 - t0, "decode": t2 - t1}


def rows_cache(prefix_cache, n_rows: int, capacity: int):
    """The wave's batch cache: the prefix's KV [1, H, P, D] written once into a preallocated [n_rows, H, capacity, D]
    buffer per layer; every later forward writes its new entries in place (a DynamicLayer concatenates, copying the
    whole batch's cache - prefix included - at every decode step)."""
    from transformers.cache_utils import DynamicLayer

    class RowsLayer(DynamicLayer):
        def __init__(self, keys, values):
            super().__init__()
            b, h, p, d = keys.shape
            self.k = keys.new_empty((n_rows, h, max(capacity, p), d))
            self.v = values.new_empty((n_rows, h, max(capacity, p), d))
            self.k[:, :, :p] = keys  # broadcast over the rows: the only copy of the prefix
            self.v[:, :, :p] = values
            self.length, self.device, self.is_initialized = p, keys.device, True
            self.keys, self.values = self.k[:, :, :p], self.v[:, :, :p]

        def update(self, key_states, value_states, *args, **kwargs):
            end = self.length + key_states.shape[-2]
            if end > self.k.shape[2]:  # past the planned capacity: grow once by doubling
                grow = max(end, 2 * self.k.shape[2]) - self.k.shape[2]
                self.k = torch.cat([self.k, self.k.new_empty(self.k.shape[:2] + (grow, self.k.shape[3]))], dim=2)
                self.v = torch.cat([self.v, self.v.new_empty(self.v.shape[:2] + (grow, self.v.shape[3]))], dim=2)
            self.k[:, :, self.length:end] = key_states
            self.v[:, :, self.length:end] = value_states
            self.length = end
            self.keys, self.values = self.k[:, :, :end], self.v[:, :, :end]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length

        def batch_select_indices(self, indices) -> None:
            self.k, self.v = self.k[indices], self.v[indices]
            self.keys, self.values = self.k[:, :, :self.length], self.v[:, :, :self.length]

    import torch

    prefix_cache.layers = [RowsLayer(layer.keys, layer.values) for layer in prefix_cache.layers]
    return prefix_cache


def main(argv: list[str] | None = None) -> None:
    from ..io import iter_jsonl

    ap = argparse.ArgumentParser(description="Run the slot wave on requests and print each payload with timings.")
    ap.add_argument("--model", required=True, help="base model folder")
    ap.add_argument("--adapter", help="peft adapter folder (checkpoints/sidecar/<recipe>/)")
    ap.add_argument("--requests", required=True, help="canonical requests JSONL")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-value-tokens", type=int, default=DEFAULT_MAX_VALUE_TOKENS)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    wave = SlotWave(args.model, args.adapter, max_value_tokens=args.max_value_tokens, dtype=args.dtype)
    for n, (_, request) in enumerate(iter_jsonl(args.requests)):
        if args.limit is not None and n >= args.limit:
            break
        pred = wave.predict(request)
        t = pred.timings
        print(f"{request['id']}: {pred.n_prompts} prompts, prefill {t['prefill']:.3f}s decode {t['decode']:.3f}s "
              f"total {t['total']:.3f}s, {pred.payload_bytes} B  {pred.payload}")


if __name__ == "__main__":
    main()

