"""The sidecar wave as the runtime's worker process builds it: `make_wave(...)` -> `request -> payload`.

Used as `Sidecar(factory="pipeline.sidecar.factory:make_wave", factory_kwargs={...}, start_method="spawn")` by the eval
stage, the server and the scripts: the worker pins itself to its cores, loads the model (+ LoRA adapter) once and
answers every request with one wave.
"""

from __future__ import annotations

FACTORY = "pipeline.sidecar.factory:make_wave"


def make_wave(model: str, adapter: str | None = None, dtype: str = "auto", cores: list[int] | None = None,
              max_value_tokens: int | None = None, device: str = "cpu"):
    """Pin the worker, load the wave once, return `predict(request) -> payload`."""
    from ..hardware import pin, resolve_dtype

    if cores:
        pin(cores)
    from .wave import SlotWave

    kw = {"dtype": resolve_dtype(dtype, device)}
    if max_value_tokens:
        kw["max_value_tokens"] = max_value_tokens
    wave = SlotWave(model, adapter, **kw)
    if device != "cpu":
        wave.model.to(device)

    def predict(request: dict):
        return wave.predict(request).payload

    return predict


__all__ = ["make_wave", "FACTORY"]
