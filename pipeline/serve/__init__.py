"""An OpenAI-compatible HTTP server over the speculative runtime (`make serve`).

    from pipeline.serve import Engine, create_app
    engine = Engine(target, "ooo", sidecar, queue_size=8)      # one worker thread, batch 1, greedy
    app = create_app(engine)                                   # POST /v1/chat/completions, GET /v1/models, /health

Modules: `protocol` (request checks -> canonical request, response shapes, OpenAI errors), `calls` (a target's text
-> content + tool_calls, decided incrementally for streaming), `engine` (worker, bounded queue, forced tool_choice
prefix), `app` (Starlette routes, server-sent events), `cli` (recipe -> engine -> uvicorn).
"""

from .app import create_app
from .engine import Engine
from .protocol import ApiError

__all__ = ["create_app", "Engine", "ApiError"]
