"""Flat YAML recipes with `key=value` command-line overrides.

A recipe is a YAML mapping whose top-level keys are stage names (`data:`, `traces:`, `train:` ...) or, for
single-stage recipes, the stage's fields directly. Overrides use dotted keys: `train.learning_rate=2e-4`.
Values in overrides are parsed as YAML scalars (`3` -> int, `true` -> bool, `[a,b]` -> list).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

from .io import InputError


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-4` as a string; recipes mean a float (learning rates), so resolve it as one."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                |\.[0-9_]+(?:[eE][-+][0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise InputError(f"override {text!r}: expected key=value")
    key, value = text.split("=", 1)
    return key.strip().split("."), yaml_load(value) if value != "" else ""


def apply_overrides(config: dict, overrides: list[str]) -> dict:
    config = copy.deepcopy(config)
    for text in overrides:
        keys, value = parse_override(text)
        node = config
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise InputError(f"override {text!r}: {k} is not a mapping")
        node[keys[-1]] = value
    return config


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> dict:
    config: dict = {}
    if path:
        path = Path(path)
        if not path.is_file():
            raise InputError(f"{path}: recipe file not found")
        try:
            config = yaml_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise InputError(f"{path}: invalid YAML ({e})") from e
        if not isinstance(config, dict):
            raise InputError(f"{path}: expected a mapping at the top level")
        config.setdefault("recipe_name", path.stem)
    return apply_overrides(config, list(overrides))


def section(config: dict, name: str, known: set[str] | None = None, where: str = "recipe") -> dict:
    """The `name:` section of a recipe; with `known`, unknown keys raise an error that lists the valid ones."""
    sec = config.get(name, {}) or {}
    if known is not None:
        bad = sorted(set(sec) - known)
        if bad:
            raise InputError(f"{where}: unknown key(s) {bad} in section {name!r}; expected one of {sorted(known)}")
    return sec
