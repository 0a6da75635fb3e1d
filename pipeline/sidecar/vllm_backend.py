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
from .wave import DEFAULT_MAX_VALUE_TOKENS, WavePrediction, answer_texts, finish_prediction, prompt_settings, wave_inputs

LORA_NAME = "sidecar"


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
    """A vLLM engine with the sidecar adapter; `predict` answers one request's wave in one `generate` call."""

    def __init__(self, model: str | Path, adapter: str | Path | None = None, *,
                 max_value_tokens: int = DEFAULT_MAX_VALUE_TOKENS, compact: bool | None = None,
                 chat_template_kwargs: dict | None = None, questions: str | None = None, llm=None, api=None,
                 **llm_kwargs):
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
        self.sampling = SamplingParams(temperature=0.0, max_tokens=int(max_value_tokens),
                                       stop_token_ids=self.stop_ids, skip_special_tokens=False)

    def predict(self, request: dict) -> WavePrediction:
        return self.predict_many([request])[0]

    def predict_many(self, requests: list[dict]) -> list[WavePrediction]:
        """Every prompt of every request in one `generate` call; timings are per call, shared by its requests."""
        t_start = time.perf_counter()
        prompts, spans = [], []
        for request in requests:
            prefix, suffixes, keys = wave_inputs(self.tokenizer, request, self.compact, self.chat_template_kwargs,
                                                 self.questions)
            spans.append((len(prompts), keys, len(prefix), sum(map(len, suffixes))))
            prompts += [{"prompt_token_ids": prefix + s} for s in suffixes]
        t_render = time.perf_counter()
        outputs = self.llm.generate(prompts, self.sampling, use_tqdm=False, lora_request=self.lora)
        t_generate = time.perf_counter()
        token_rows = [list(o.outputs[0].token_ids) for o in outputs]
        preds = []
        for request, (start, keys, n_prefix, n_suffix) in zip(requests, spans):
            rows = token_rows[start:start + len(keys)]
            texts = answer_texts(self.tokenizer, rows, self.stop_ids)
            timings = {"render": t_render - t_start, "generate": t_generate - t_render}
            pred = finish_prediction(request, keys, texts, timings, t_start)
            pred.token_counts = {"prefix": n_prefix, "suffix": n_suffix, "generated": sum(map(len, rows))}
            preds.append(pred)
        return preds
