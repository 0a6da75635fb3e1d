"""The sidecar's settings, declared once: `SidecarConfig` (one dataclass, one set of defaults, one `validate()`).

A recipe's `sidecar:` section (eval, serve), sidecar-eval's `Config` (it extends this class), the worker
factory and `SlotWave` all read this class, so a knob has the same name, default and check everywhere:

    sidecar:
      model: checkpoints/base/smollm2-135m-instruct   # the sidecar's base model folder (or hub id)
      adapter: checkpoints/sidecar/smollm2-135m-cpu-v9
      dtype: auto          # bfloat16 where the CPU has native bf16, else float32 (see pipeline.hardware)
      slot_tools: 2        # staged wave: only the slots of the function row's top 2 tools (less wave CPU)
      prepack: true        # oneDNN-reordered linear weights (CPU): a faster wave, the same answers up to rounding
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

DEFAULT_MAX_VALUE_TOKENS = 32  # the longest slot values of the four benchmarks are ~25 tokens in SmolLM2's BPE
QUANTIZE = ("int8",)  # the wave's weight formats besides the model's own dtype


@dataclass
class SidecarConfig:
    model: str | None = None            # the sidecar's base model folder or hub id
    adapter: str | None = None          # a peft LoRA adapter folder (null: the base model alone)
    dtype: str = "auto"                 # auto: bfloat16 on CPUs with native bf16, float32 elsewhere
    device: str = "cpu"                 # the wave's device (a GPU of its own on GPU machines)
    max_value_tokens: int = DEFAULT_MAX_VALUE_TOKENS  # decode cap per slot answer
    merge_adapter: bool = True          # fold the LoRA update into the base weights: the same answers, less work
    required_values: bool = True        # a required parameter's answer cannot be null
    slot_tools: int | None = None       # staged wave: only the slots of the top-N tools of the function row (null: all)
    prefix_cache: int = 0               # tokens of earlier waves' prefixes kept (0: off); costs that much KV memory
    prepack: bool = False               # oneDNN-prepacked linear weights (CPU, bf16/float32): faster, same answers
    quantize: str | None = None         # int8: linears in int8 but down_proj (CPU, float32 activations; answers differ)
    timeout_s: float | None = 60.0      # a wave slower than this is dropped and the request goes on without a hint

    @classmethod
    def keys(cls) -> set[str]:
        return {f.name for f in fields(SidecarConfig)}

    @classmethod
    def from_section(cls, section: dict, where: str = "sidecar") -> SidecarConfig:
        """A checked config from a recipe's sidecar section; unknown keys and bad values name `where`."""
        from ..io import InputError

        bad = sorted(set(section) - cls.keys())
        if bad:
            raise InputError(f"{where}: unknown sidecar key(s) {bad}; expected some of {sorted(cls.keys())}")
        # null means the default (a knob whose default is null keeps it)
        cfg = cls(**{k: v for k, v in section.items() if v is not None or getattr(cls, k) is None})
        try:
            cfg.validate()
        except ValueError as e:
            raise InputError(f"{where}: {e}") from None
        return cfg

    def validate(self) -> None:
        """A ValueError naming the setting unless every value is one the wave can run with."""
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise ValueError(f"sidecar.quantize={self.quantize!r}: expected one of {list(QUANTIZE)} or null "
                             "(the model's own dtype)")
        if int(self.max_value_tokens) < 1:
            raise ValueError(f"sidecar.max_value_tokens={self.max_value_tokens!r}: expected >= 1")
        if self.slot_tools is not None and int(self.slot_tools) < 1:
            raise ValueError(f"sidecar.slot_tools={self.slot_tools!r}: expected a number of tools >= 1, or null for all")
        if int(self.prefix_cache or 0) < 0:
            raise ValueError(f"sidecar.prefix_cache={self.prefix_cache!r}: expected a number of tokens >= 0 "
                             "(0: no prefix cache)")
        if self.quantize is not None:
            if self.prepack:
                raise ValueError("sidecar.quantize and sidecar.prepack both rewrite the wave's linear layers; set "
                                 "prepack: false (or quantize: null)")
            if str(self.dtype) not in ("auto", "float32", "torch.float32"):
                raise ValueError(f"sidecar.quantize={self.quantize} runs on float32 activations; sidecar.dtype is "
                                 f"{self.dtype!r} (use auto or float32)")
            if self.device != "cpu":
                raise ValueError(f"sidecar.quantize={self.quantize} runs on the CPU only (sidecar.device is "
                                 f"{self.device!r})")

    def check_paths(self, where: str = "sidecar") -> None:
        """Before anything loads: a missing model or adapter folder is an error naming it and what builds it."""
        from ..io import InputError, looks_like_hub_id

        if not self.model:
            raise InputError(f"{where}: sidecar.model is required (the sidecar's base model folder)")
        if not Path(self.model).exists() and not looks_like_hub_id(self.model):
            raise InputError(f"{where}: sidecar model folder {self.model} not found: build it with `make models`")
        adapter = self.adapter
        if adapter and not (Path(adapter) / "adapter_config.json").is_file() and not looks_like_hub_id(adapter):
            raise InputError(f"{where}: sidecar adapter {adapter}/adapter_config.json not found: the CPU adapter is "
                             f"committed in git (git checkout -- {adapter}), or train one with `make train` "
                             "(recipes/sidecar/); sidecar.adapter=null runs the base model without one")

    def as_dict(self) -> dict:
        return asdict(self)


__all__ = ["SidecarConfig", "DEFAULT_MAX_VALUE_TOKENS", "QUANTIZE"]
