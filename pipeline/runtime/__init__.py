"""The speculative runtime: one greedy verify loop over a target with a KV cache, ToolSpec drafters and the
out-of-order sidecar hint; every method's output equals autoregressive decoding's (docs/architecture.md, "The
speculative runtime" and "Losslessness").

    from pipeline.runtime import Target, generate, Sidecar
    target = Target.load("checkpoints/base/qwen2.5-coder-1.5b-instruct", dtype="bfloat16")
    with Sidecar(wave) as sidecar:                       # wave(request) -> {"tool_index", "arguments"}
        result = generate(target, request, "ooo", sidecar=sidecar, max_new_tokens=256)
    result.text, result.token_ids, result.stats.mean_accepted
"""

from .loop import METHODS, Result, Stats, generate, oracle_payload, warm_up
from .sidecar_client import Ready, Sidecar
from .target import Target

__all__ = ["generate", "Result", "Stats", "METHODS", "Target", "Sidecar", "Ready", "oracle_payload", "warm_up"]
