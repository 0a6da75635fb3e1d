"""The sidecar wave as the runtime's worker process builds it: `make_wave(...)` -> `request -> payload`.

Used as `Sidecar(factory="pipeline.sidecar.factory:make_wave", factory_kwargs={...}, start_method="spawn")` by the eval
stage, the server and the scripts: the worker pins itself to its cores, loads the model (+ LoRA adapter) once and
answers every request with one wave.
"""

from __future__ import annotations

from .config import SidecarConfig

FACTORY = "pipeline.sidecar.factory:make_wave"
SIDECAR_KEYS = SidecarConfig.keys()
WORKER_KEYS = SIDECAR_KEYS - {"timeout_s"}  # the worker's kwargs; timeout_s is the client's (runtime.Sidecar)


def sidecar_kwargs(sc: dict, where: str = "sidecar") -> dict:
    """`make_wave`'s kwargs from a recipe's sidecar section (eval and serve alike), checked before anything loads:
    a bad setting or a missing model or adapter folder is an error that names it (`SidecarConfig`)."""
    cfg = SidecarConfig.from_section(sc, where)
    cfg.check_paths(where)
    return {k: v for k, v in cfg.as_dict().items() if k in WORKER_KEYS}


def make_wave(*, cores: list[int] | None = None, **settings):
    """Pin the worker to `cores`, load the wave once (`SlotWave` with the `SidecarConfig` fields in `settings`),
    return `predict(request) -> payload`."""
    from ..hardware import pin

    if cores:
        pin(cores)
    from .wave import SlotWave

    wave = SlotWave(settings.pop("model"), settings.pop("adapter", None), **settings)

    def predict(request: dict, cancelled=None):
        from ..runtime.sidecar_client import WaveCancelled
        from .wave import Cancelled

        try:
            return wave.predict(request, cancelled).payload
        except Cancelled:
            raise WaveCancelled from None

    return predict


__all__ = ["make_wave", "sidecar_kwargs", "FACTORY", "SIDECAR_KEYS", "WORKER_KEYS"]
