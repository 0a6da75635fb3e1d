"""Converters from raw benchmark files to canonical requests (docs/architecture.md, "Requests").

Each source module exposes `BENCHMARK` (its name) and `load(root: Path) -> SourceResult`. A converter turns its
source's parameter dialect into valid JSON Schema and parses gold calls, but never "fixes" data: records it cannot
convert are returned as counted rejects naming the file and record; gold calls that do not satisfy their schema are
kept and counted by the `data` stage, which also assigns splits and runs the contamination filter.
The raw files sit in one folder per source under the raw-data root, `raw_data_root()`.
"""

from __future__ import annotations

import importlib
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SOURCE_MODULES = ("api_bank", "toolalpaca", "bfcl", "seal_tools")
RAW_DATA_ENV = "OOO_RAW_DATA"
RAW_DATA_DEFAULT = "../shared/data"  # relative to the repository root, where make, the stages and pytest run


def raw_data_root() -> Path:
    """The raw benchmark folder (one folder per source, each with a README): $OOO_RAW_DATA, else ../shared/data.
    The data stage's default `raw_root`, `make smoke` and the converter tests all read it here."""
    return Path(os.environ.get(RAW_DATA_ENV) or RAW_DATA_DEFAULT)


@dataclass
class SourceResult:
    # canonical requests without "split"; each has "id", "benchmark", "subset" (e.g. "level-1", "simple_java"),
    # "messages", "tools", "gold" and optionally "gold_accept"
    requests: list[dict] = field(default_factory=list)
    # records that could not become a request: {"file", "record", "reason" (short key), "detail"}
    rejects: list[dict] = field(default_factory=list)
    # free counters worth reporting, e.g. {"action_input_not_json": 36, "placeholders": 12}
    notes: Counter = field(default_factory=Counter)

    def reject(self, file, record, reason: str, detail: str = "") -> None:
        self.rejects.append({"file": str(file), "record": str(record), "reason": reason, "detail": detail})


def load_source(name: str):
    if name not in SOURCE_MODULES:
        raise ValueError(f"unknown source {name!r}; expected one of {SOURCE_MODULES}")
    return importlib.import_module(f"pipeline.sources.{name}")
