"""`--config file.yaml`: a mapping of flag -> value applied as the parser's defaults (the command line wins), each
value through what the command line applies (the flag's type, choices and range); unknown keys fail with a
"did you mean"."""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Callable, Mapping
from typing import Any, cast

import yaml

from miles.utils.ranges import Range, range_violation


class ArgumentError(ValueError):
    """A flag combination or config file that cannot run; the message names the flags (or the file and key)."""


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def dest_of(key: Any) -> str:
    """A config key (dashes or underscores, leading dashes allowed) as an args dest."""
    return str(key).lstrip("-").replace("-", "_")


def read_config(path: str) -> dict[str, Any]:
    """The YAML mapping of `path`, as written; errors name the file."""
    if not os.path.isfile(path):
        raise ArgumentError(f"--config {path}: file not found")
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as exc:
            raise ArgumentError(f"--config {path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ArgumentError(f"--config {path}: expected a mapping of flag names to values")
    return data


def config_defaults(
    parser: argparse.ArgumentParser, data: Mapping[Any, Any], path: str, ranges: Mapping[str, Range]
) -> dict[str, Any]:
    """dest -> converted value of every key of `data`; a key that names no flag of `parser` is an error."""
    known = {action.dest: action for action in parser._actions if action.dest not in ("help", "config")}
    defaults = {}
    for key, value in data.items():
        dest = dest_of(key)
        if dest not in known:
            close = difflib.get_close_matches(dest, known, n=1)
            hint = f"; did you mean {flag(close[0])}?" if close else ""
            raise ArgumentError(f"--config {path}: unknown key {key!r}{hint}")
        defaults[dest] = _config_value(known[dest], value, f"--config {path}: key {key!r}", ranges)
    return defaults


def _config_value(action: argparse.Action, value: Any, where: str, ranges: Mapping[str, Range]) -> Any:
    if value is None:
        return None
    if action.nargs == 0:  # store_true / store_false
        if not isinstance(value, bool):
            raise ArgumentError(f"{where} ({flag(action.dest)}) takes true or false, got {value!r}")
        return value
    if isinstance(value, bool) and action.nargs == "?" and action.const is True:  # an on/off/auto flag
        value = "on" if value else "off"
    if isinstance(value, (bool, list, dict)):
        raise ArgumentError(f"{where} ({flag(action.dest)}) takes one value, got {value!r}")
    converted: Any = str(value)
    if action.type is not None:
        convert = cast(Callable[[str], Any], action.type)  # argparse also types it as a registry name: none are used
        try:
            converted = convert(converted)
        except argparse.ArgumentTypeError as exc:  # a type that says what it takes
            raise ArgumentError(f"{where} ({flag(action.dest)}): {exc}") from None
        except (TypeError, ValueError):
            name = getattr(action.type, "__name__", "value")
            raise ArgumentError(f"{where} ({flag(action.dest)}): invalid {name} value {value!r}") from None
    if action.choices is not None and converted not in action.choices:
        raise ArgumentError(f"{where} ({flag(action.dest)}): {value!r} is not one of {list(action.choices)}")
    problem = range_violation(action.dest, converted, ranges)
    if problem is not None:
        raise ArgumentError(f"{where}: {problem}")
    return converted
