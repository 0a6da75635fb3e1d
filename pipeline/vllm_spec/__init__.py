"""OoO-Spec inside vLLM: the `ooo` method (and `toolspec`, `ooo-oracle`) as a vLLM speculative proposer.

A room of its own with a small public API over the runtime's drafters (`pipeline/runtime/drafting.py`):
- front end: `Frontend.start_request(request, prompt_ids, method)` / `stop_request(rid, output_ids)`, and
  `engine_kwargs(k)` for `vllm.LLM` / the engine (frontend.py); the sidecar's wave runs in its own process
  (wave_service.py) and posts its payload on the hint board (board.py);
- engine side: `OooProposer` (proposer.py), vLLM's `custom_class`, a thin adapter over `Speculator.speculate(rows)`
  (speculator.py), which drafts one chain per row from token ids alone.
Nothing here imports vLLM: the proposer receives vLLM's config object and numpy arrays.
"""

from .board import HintBoard
from .frontend import PROPOSER, Frontend
from .speculator import Speculator

__all__ = ["Frontend", "HintBoard", "Speculator", "PROPOSER"]
