"""Pipeline stages, one module each (`python -m pipeline.stages.<stage>`), and the contract every one of them keeps.

A stage module (data, traces, labels, train, sidecar_eval, eval, upload, models) has
    Config                                      a dataclass of its resolved settings (a `StageConfig`: it also
                                                carries the loaded recipe, which the stage saves with its output)
    resolve(recipe_path, overrides) -> Config   the recipe file (None: the stage's defaults) with `key=value`
                                                overrides (pipeline.recipes), checked; bad input is an InputError
    run(cfg)                                    the work: writes the outputs and the resolved config, prints a summary
    main(argv)                                  `main(module, argv)` below, the one command line of every stage
and may declare FLAGS, the command-line flags it keeps as shorthands for overrides (`--force` = `data.force=true`),
and ERRORS, exception types besides InputError that the command line reports as `error: ...` (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from types import ModuleType
from typing import Any

from ..io import InputError

STAGES = ("data", "traces", "labels", "train", "sidecar_eval", "eval", "upload", "models")


@dataclass
class StageConfig:
    """The base of every stage's `Config`: `recipe` is the loaded recipe (with overrides), kept for the manifest."""

    recipe: dict = field(default_factory=dict, repr=False, compare=False, kw_only=True)

    @classmethod
    def keys(cls) -> set[str]:
        """The settings a recipe may name (every field but `recipe`)."""
        return {f.name for f in fields(cls)} - {"recipe"}

    def settings(self) -> dict:
        """The resolved settings without the recipe: what manifests record as `resolved`."""
        out = asdict(self)
        out.pop("recipe")
        return out


@dataclass(frozen=True)
class Flag:
    """A command-line flag kept as a shorthand for the override `key=value`."""

    name: str                 # "--force"
    key: str                  # "data.force"
    help: str
    switch: bool = False      # takes no value: given means `key=true`
    repeat: bool = False      # may be given several times: `key=[v1, v2, ...]`
    type: Any = str           # how argparse reads the value


def flag_overrides(flags: Sequence[Flag], values: dict) -> list[str]:
    """`key=value` overrides for the flags given (`values`: argparse's, by destination); the value is written as JSON
    (valid YAML), so a path or message reaches the config as the string it was, never re-read as YAML."""
    out = []
    for f in flags:
        value = values.get(_dest(f))
        if value is None or value is False:
            continue
        out.append(f"{f.key}={json.dumps(value)}")
    return out


def _dest(f: Flag) -> str:
    return f.name.lstrip("-").replace("-", "_")


def parser(stage: ModuleType) -> argparse.ArgumentParser:
    doc = (stage.__doc__ or "").strip().splitlines()
    name = getattr(stage.__spec__, "name", None) or stage.__name__  # run as `python -m`, the module is __main__
    ap = argparse.ArgumentParser(prog=f"python -m {name}", description=doc[0] if doc else None)
    default = getattr(stage, "DEFAULT_RECIPE", None)
    ap.add_argument("--recipe", default=default,
                    help="the stage's recipe YAML" + (f" (default: {default})" if default else ""))
    for f in getattr(stage, "FLAGS", ()):
        if f.switch:
            ap.add_argument(f.name, action="store_true", help=f"{f.help} (= {f.key}=true)")
        else:
            ap.add_argument(f.name, action="append" if f.repeat else "store", type=f.type,
                            help=f"{f.help} (= {f.key}=...)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides (dotted: section.key=value); they win over flags")
    return ap


def main(stage: ModuleType, argv: Sequence[str] | None = None):
    """Parse the command line, resolve the recipe, run the stage; returns what `run` returns. Bad input (InputError,
    or one of the stage's ERRORS) is printed as `error: ...` and exits with status 2."""
    args = parser(stage).parse_args(argv)
    overrides = flag_overrides(getattr(stage, "FLAGS", ()), vars(args)) + list(args.overrides)
    try:
        return stage.run(stage.resolve(args.recipe, overrides))
    except (InputError, *getattr(stage, "ERRORS", ())) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
