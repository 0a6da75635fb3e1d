"""The `ooo` method as a vLLM speculative proposer (`method: custom_class`).

    LLM(model=target, enable_prefix_caching=False,
        speculative_config={"method": "custom_class", "model": "pipeline.vllm_spec.proposer.OooProposer",
                            "num_speculative_tokens": 16},
        additional_config={"ooo_spec": {"board": "/dev/shm/ooo-board-x", "min_p": 0.05}})

vLLM builds the class with its `VllmConfig`, calls `load_model(model)`, then `propose(...)` once per step with the
batch's token ids; it verifies each row's chain greedily. The proposer is a thin adapter: the rows go to a
`Speculator` (speculator.py), which finds each row's request on the hint board the front end writes (board.py). The
board's folder comes from `additional_config["ooo_spec"]["board"]`, else `$OOO_VLLM_BOARD`. Nothing here is
CPU-specific. The speculator's time per step is written to `<board>/proposer-<pid>.json` every `FIGURES_EVERY` steps.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from .board import ENV, HintBoard
from .speculator import Speculator

log = logging.getLogger("pipeline.vllm_spec")
FIGURES_EVERY = 50  # steps between two writes of the proposer's figures (a small JSON file: ~0.1 ms)


def options(vllm_config) -> dict:
    extra = getattr(vllm_config, "additional_config", None) or {}
    return dict(extra.get("ooo_spec") or {})


class OooProposer:
    """vLLM's custom_class proposer over the `Speculator` (see the module docstring)."""

    def __init__(self, vllm_config):
        from transformers import AutoTokenizer, GenerationConfig

        from ..requests import stop_token_ids

        opts = options(vllm_config)
        board = opts.get("board") or os.environ.get(ENV)
        if not board:
            raise ValueError("OooProposer: no hint board: set additional_config={'ooo_spec': {'board': <folder>}} "
                             f"or ${ENV} (pipeline.vllm_spec.board.HintBoard makes one)")
        model_config = vllm_config.model_config
        path = model_config.tokenizer or model_config.model
        tokenizer = AutoTokenizer.from_pretrained(path)
        try:
            generation = GenerationConfig.from_pretrained(model_config.model)
        except (OSError, ValueError):
            generation = None
        k = vllm_config.speculative_config.num_speculative_tokens
        self.speculator = Speculator(tokenizer, HintBoard(board), k, stop_ids=stop_token_ids(tokenizer, generation),
                                     chat_template_kwargs=opts.get("chat_template_kwargs"),
                                     min_p=float(opts.get("min_p", 0.05)), max_len=model_config.max_model_len)
        self.figures_path = Path(board) / f"proposer-{os.getpid()}.json"
        log.info("OooProposer: board %s, k=%d, tokenizer %s", board, k, path)

    def load_model(self, *args, **kwargs) -> None:
        """No weights: the drafts come from the board and the runtime's drafters."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **kwargs):
        rows = [(token_ids_cpu[i], int(num_tokens_no_spec[i])) if len(sampled) else None
                for i, sampled in enumerate(sampled_token_ids)]
        try:
            drafts = self.speculator.speculate(rows)
        except Exception:  # noqa: BLE001 - a drafting bug must cost speed, never the engine
            log.exception("OooProposer: drafting failed this step; no drafts")
            drafts = [[] for _ in rows]
        if self.speculator.step % FIGURES_EVERY == 0:
            self.write_figures()
        return drafts

    def write_figures(self) -> None:
        tmp = self.figures_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self.speculator.figures(), "written": time.time()}))
        os.replace(tmp, self.figures_path)


__all__ = ["OooProposer"]
