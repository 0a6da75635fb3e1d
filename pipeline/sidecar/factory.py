"""The sidecar wave as the runtime's worker process builds it: `make_wave(...)` -> `request -> payload`.

Used as `Sidecar(factory="pipeline.sidecar.factory:make_wave", factory_kwargs={...}, start_method="spawn")` by the eval
stage, the server and the scripts: the worker pins itself to its cores, loads the model (+ LoRA adapter) once and
answers every request with one wave.
"""

from __future__ import annotations

from pathlib import Path

FACTORY = "pipeline.sidecar.factory:make_wave"
SIDECAR_KEYS = {"model", "adapter", "dtype", "max_value_tokens", "device", "timeout_s", "merge_adapter", "required_values",
                "slot_tools", "prefix_cache", "prepack", "quantize"}


def sidecar_kwargs(sc: dict, where: str = "sidecar") -> dict:
    """`make_wave`'s kwargs from a recipe's sidecar section (eval and serve alike), checked before anything loads:
    a missing model or adapter folder is an error that names it and the command that builds it."""
    from ..io import InputError, looks_like_hub_id

    def exists(path) -> bool:
        return Path(path).exists() or looks_like_hub_id(path)

    bad = sorted(set(sc) - SIDECAR_KEYS)
    if bad:
        raise InputError(f"{where}: unknown sidecar key(s) {bad}; expected some of {sorted(SIDECAR_KEYS)}")
    model, adapter = sc.get("model"), sc.get("adapter")
    if not model:
        raise InputError(f"{where}: sidecar.model is required (the sidecar's base model folder)")
    if not exists(model):
        raise InputError(f"{where}: sidecar model folder {model} not found: build it with `make models`")
    if adapter and not (Path(adapter) / "adapter_config.json").is_file() and not looks_like_hub_id(adapter):
        raise InputError(f"{where}: sidecar adapter {adapter}/adapter_config.json not found: the CPU adapter is "
                         f"committed in git (git checkout -- {adapter}), or train one with `make train` "
                         "(recipes/sidecar/); sidecar.adapter=null runs the base model without one")
    quantize = sc.get("quantize")
    if quantize is not None:
        from .wave import check_quantize

        try:
            check_quantize(quantize, "sidecar.quantize")
        except ValueError as e:
            raise InputError(f"{where}: {e}") from None
        if sc.get("prepack"):
            raise InputError(f"{where}: sidecar.quantize and sidecar.prepack both rewrite the wave's linear layers; "
                             "set prepack: false (or quantize: null)")
        if sc.get("dtype", "auto") not in ("auto", "float32"):
            raise InputError(f"{where}: sidecar.quantize={quantize} runs on float32 activations; sidecar.dtype is "
                             f"{sc['dtype']!r} (use auto or float32)")
        if sc.get("device", "cpu") != "cpu":
            raise InputError(f"{where}: sidecar.quantize={quantize} runs on the CPU only (sidecar.device is "
                             f"{sc['device']!r})")
    return {"model": str(model), "adapter": str(adapter) if adapter else None, "dtype": sc.get("dtype", "auto"),
            "max_value_tokens": sc.get("max_value_tokens"), "device": sc.get("device", "cpu"),
            "merge_adapter": bool(sc.get("merge_adapter", True)), "required_values": bool(sc.get("required_values", True)),
            "slot_tools": sc.get("slot_tools"), "prefix_cache": int(sc.get("prefix_cache") or 0),
            "prepack": bool(sc.get("prepack", False)), "quantize": quantize}


def make_wave(model: str, adapter: str | None = None, dtype: str = "auto", cores: list[int] | None = None,
              max_value_tokens: int | None = None, device: str = "cpu", merge_adapter: bool = True,
              required_values: bool = True, slot_tools: int | None = None, prefix_cache: int = 0,
              prepack: bool = False, quantize: str | None = None):
    """Pin the worker, load the wave once, return `predict(request) -> payload`. The adapter is folded into the
    base weights unless `merge_adapter` is false (a recipe's `sidecar.merge_adapter`): the same answers up to
    rounding, without the adapter's extra work per projection. `required_values` (a recipe's
    `sidecar.required_values`, default true): a required parameter's answer cannot be `null`; `slot_tools` (null:
    every tool): a staged wave that decodes only the slots of the tools the function row ranks highest (`SlotWave`);
    `prefix_cache` (tokens, 0: off): waves start from the longest prefix an earlier request shared (`SlotWave`);
    `prepack` (CPU only): the linear layers' weights reordered once for oneDNN (`wave.prepack_linears`);
    `quantize` ("int8", CPU only): the linear layers in int8, the rest in float32 (`wave.quantize_linears`)."""
    from ..hardware import pin, resolve_dtype

    if cores:
        pin(cores)
    from .wave import SlotWave

    kw = {"dtype": "float32" if quantize else resolve_dtype(dtype, device), "merge_adapter": merge_adapter,
          "required_values": required_values, "slot_tools": slot_tools, "prefix_cache": prefix_cache,
          "prepack": bool(prepack) and device == "cpu", "quantize": quantize}
    if max_value_tokens:
        kw["max_value_tokens"] = max_value_tokens
    wave = SlotWave(model, adapter, **kw)
    if device != "cpu":
        wave.model.to(device)

    def predict(request: dict, cancelled=None):
        from ..runtime.sidecar_client import WaveCancelled
        from .wave import Cancelled

        try:
            return wave.predict(request, cancelled).payload
        except Cancelled:
            raise WaveCancelled from None

    return predict


__all__ = ["make_wave", "sidecar_kwargs", "FACTORY", "SIDECAR_KEYS"]
