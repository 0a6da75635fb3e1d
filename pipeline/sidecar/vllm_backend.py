"""The slot wave on vLLM: base model + LoRA adapter, all of a wave's prompts in one batched `generate` call.

The prompts are the same token ids as the transformers wave (`wave.wave_inputs`: shared prefix + each row's
suffix), passed as token prompts so vLLM's prefix caching computes the shared prefix once per wave; the outputs are
decoded with the same tokenizer and joined by the same `join.py`. `predict_many` puts several requests' waves into
a single call (the way `accuracy` runs it on a GPU).

vllm is imported lazily (and only here): the rest of the package works where it is not installed. Where vLLM pins an
older transformers than the project's, run it from its own environment (`scripts/vllm_setup.sh`).

    wave = VllmWave("Qwen/Qwen3-0.6B", "checkpoints/sidecar/qwen3-0.6b", gpu_memory_utilization=0.3)
    wave.predict(request).payload
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..requests import stop_token_ids
from .wave import (DEFAULT_MAX_VALUE_TOKENS, WavePrediction, answer_texts, decode, finish_prediction, null_openings,
                   prompt_settings, required_rows, wave_inputs)

LORA_NAME = "sidecar"
NULL_LOGPROBS = 20  # next-token candidates asked for where a required parameter's row opened a null


def vllm_api():
    """(LLM, SamplingParams, LoRARequest) from vllm, or ImportError saying how to get it."""
    try:
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
    except ImportError as e:
        raise ImportError(f"the vllm backend needs vllm ({e}); install it with `pip install 'ooo-spec[vllm]'` "
                          "or use the separate environment of scripts/vllm_setup.sh") from e
    return LLM, SamplingParams, LoRARequest


def adapter_rank(adapter: str | Path) -> int:
    """LoRA rank of an adapter folder (vLLM's max_lora_rank must be at least this)."""
    path = Path(adapter) / "adapter_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{adapter}: no adapter_config.json (expected a peft adapter folder)")
    config = json.loads(path.read_text())
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    return int(max(ranks))


class VllmWave:
    """A vLLM engine with the sidecar adapter; `predict` answers one request's wave in one `generate` call.

    `required_values` (as `SlotWave`'s): a row asking for a required parameter cannot answer `null`. vLLM has no
    per-row, per-step token ban that holds across its versions, so rows whose greedy answer opened a null are
    answered again: the next token's top `NULL_LOGPROBS` candidates are asked for, the best one that does not open
    a null is taken, and greedy decoding continues from there (two more `generate` calls, only for those rows)."""

    def __init__(self, model: str | Path, adapter: str | Path | None = None, *,
                 max_value_tokens: int = DEFAULT_MAX_VALUE_TOKENS, compact: bool | None = None,
                 chat_template_kwargs: dict | None = None, questions: str | None = None, llm=None, api=None,
                 required_values: bool = True, **llm_kwargs):
        LLM, SamplingParams, LoRARequest = api or vllm_api()
        self.compact, self.chat_template_kwargs, self.questions = prompt_settings(adapter, compact, chat_template_kwargs,
                                                                                  questions)
        self.lora = None
        if adapter is not None:
            rank = adapter_rank(adapter)
            self.lora = LoRARequest(LORA_NAME, 1, str(Path(adapter).resolve()))
            llm_kwargs.setdefault("max_lora_rank", max(8, rank))
            llm_kwargs.setdefault("max_loras", 1)
        if llm is None:
            llm = LLM(model=str(model), enable_lora=adapter is not None, enable_prefix_caching=True, **llm_kwargs)
        self.llm = llm
        self.tokenizer = llm.get_tokenizer()
        self.stop_ids = stop_token_ids(self.tokenizer)
        self.max_value_tokens, self.required_values = int(max_value_tokens), bool(required_values)
        self.sampling = SamplingParams(temperature=0.0, max_tokens=self.max_value_tokens,
                                       stop_token_ids=self.stop_ids, skip_special_tokens=False)
        self.next_token = SamplingParams(temperature=0.0, max_tokens=1, logprobs=NULL_LOGPROBS,
                                         stop_token_ids=self.stop_ids, skip_special_tokens=False)
        self._sampling_params = SamplingParams
        self._null_ids: set[int] | None = None

    def predict(self, request: dict) -> WavePrediction:
        return self.predict_many([request])[0]

    def predict_many(self, requests: list[dict]) -> list[WavePrediction]:
        """Every prompt of every request in one `generate` call; timings are per call, shared by its requests."""
        t_start = time.perf_counter()
        prompts, spans, not_null = [], [], []
        for request in requests:
            prefix, suffixes, keys = wave_inputs(self.tokenizer, request, self.compact, self.chat_template_kwargs,
                                                 self.questions)
            if self.required_values:
                not_null += [len(prompts) + r for r in required_rows(request, keys)]
            spans.append((len(prompts), keys, len(prefix), sum(map(len, suffixes))))
            prompts += [{"prompt_token_ids": prefix + s} for s in suffixes]
        t_render = time.perf_counter()
        outputs = self.llm.generate(prompts, self.sampling, use_tqdm=False, lora_request=self.lora)
        token_rows = [list(o.outputs[0].token_ids) for o in outputs]
        if not_null:
            self._answer_again(prompts, token_rows, not_null)
        t_generate = time.perf_counter()
        preds = []
        for request, (start, keys, n_prefix, n_suffix) in zip(requests, spans):
            rows = token_rows[start:start + len(keys)]
            texts = answer_texts(self.tokenizer, rows, self.stop_ids)
            timings = {"render": t_render - t_start, "generate": t_generate - t_render}
            pred = finish_prediction(request, keys, texts, timings, t_start)
            pred.token_counts = {"prefix": n_prefix, "suffix": n_suffix, "generated": sum(map(len, rows))}
            preds.append(pred)
        return preds

    def _opens_null(self, tokens: list[int]) -> int | None:
        """Where a row's tokens open a null (the first token that is not blank, when it starts with n), else None."""
        if self._null_ids is None:
            self._null_ids = set(null_openings(self.tokenizer, len(self.tokenizer)))
        for j in range(len(tokens)):
            if tokens[j] in self.stop_ids or decode(self.tokenizer, tokens[:j + 1]).strip():
                return j if tokens[j] in self._null_ids else None
        return None

    def _answer_again(self, prompts: list[dict], token_rows: list[list[int]], rows: list[int]) -> None:
        """Rows (of `rows`) whose greedy answer opened a null, decoded again without it (in place): the best
        non-null next token from the top candidates, then greedy on; as the transformers wave's ban does."""
        heads = {}  # row -> the tokens it keeps (blank ones before the null)
        for r in rows:
            j = self._opens_null(token_rows[r])
            if j is not None:
                heads[r] = token_rows[r][:j]
        for _ in range(4):  # rounds: a row whose new token is blank again asks once more
            if not heads:
                return
            order = sorted(heads)
            outs = self.llm.generate([{"prompt_token_ids": prompts[r]["prompt_token_ids"] + heads[r]} for r in order],
                                     self.next_token, use_tqdm=False, lora_request=self.lora)
            go_on = {}
            for r, o in zip(order, outs):
                ranked = sorted(o.outputs[0].logprobs[0].items(), key=lambda kv: -_logprob(kv[1]))
                pick = next((t for t, _ in ranked if t not in self._null_ids), None)
                if pick is None:  # every candidate opens a null: keep the null answer
                    continue
                head = heads[r] + [pick]
                token_rows[r] = head
                if pick not in self.stop_ids and len(head) < self.max_value_tokens:
                    go_on[r] = head
            heads = {r: h for r, h in go_on.items() if not decode(self.tokenizer, h).strip()}
            rest = sorted(set(go_on) - set(heads))
            if rest:
                outs = self.llm.generate(
                    [{"prompt_token_ids": prompts[r]["prompt_token_ids"] + go_on[r]} for r in rest],
                    [self._sampling_params(temperature=0.0, max_tokens=self.max_value_tokens - len(go_on[r]),
                                           stop_token_ids=self.stop_ids, skip_special_tokens=False) for r in rest],
                    use_tqdm=False, lora_request=self.lora)
                for r, o in zip(rest, outs):
                    token_rows[r] = go_on[r] + list(o.outputs[0].token_ids)


def _logprob(entry) -> float:
    """A vLLM logprob entry (a `Logprob` object, or a float) as a float."""
    return float(getattr(entry, "logprob", entry))
