"""Loading user hooks by dotted path or file path, and a registry that injects functions in tests."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class HookLoadError(ValueError):
    """A hook path names a module, file or attribute that cannot be loaded."""


class FunctionRegistry:
    """Named functions that `load_function` returns before looking at modules or files (tests only)."""

    def __init__(self) -> None:
        self._functions: dict[str, Callable[..., Any]] = {}

    def register(self, name: str, fn: Callable[..., Any]) -> None:
        self._functions[name] = fn

    def unregister(self, name: str) -> None:
        self._functions.pop(name, None)

    def get(self, name: str) -> Callable[..., Any] | None:
        return self._functions.get(name)

    @contextmanager
    def temporary(self, name: str, fn: Callable[..., Any]) -> Iterator[str]:
        """Register `fn` under `name` for the duration of a `with` block."""
        self.register(name, fn)
        try:
            yield name
        finally:
            self.unregister(name)


function_registry = FunctionRegistry()


def _load_from_file(file_path: str, attr: str, spec_text: str) -> Callable[..., Any]:
    if not os.path.isfile(file_path):
        raise HookLoadError(f"hook {spec_text!r}: file {file_path!r} does not exist")
    module_name = f"miles_user_hook_{abs(hash(os.path.abspath(file_path)))}"
    if module_name in sys.modules:  # hooks from one file share one module (and its state)
        return _get_attr(sys.modules[module_name], attr, spec_text, file_path)
    spec = importlib.util.spec_from_file_location(module_name, file_path)
    if spec is None or spec.loader is None:
        raise HookLoadError(f"hook {spec_text!r}: cannot import {file_path!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise HookLoadError(f"hook {spec_text!r}: importing {file_path!r} failed: {type(exc).__name__}: {exc}") from exc
    return _get_attr(module, attr, spec_text, file_path)


def _get_attr(module: Any, attr: str, spec_text: str, where: str) -> Callable[..., Any]:
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise HookLoadError(f"hook {spec_text!r}: {where!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise HookLoadError(f"hook {spec_text!r}: {attr!r} in {where!r} is not callable")
    return obj


def load_function(path: str) -> Callable[..., Any]:
    """Load `pkg.mod.fn` or `path/to/file.py:fn`; errors name the missing module, file or attribute."""
    if not path or not isinstance(path, str):
        raise HookLoadError(f"hook path must be a non-empty string, got {path!r}")
    registered = function_registry.get(path)
    if registered is not None:
        return registered
    if ":" in path and (path.rsplit(":", 1)[0].endswith(".py") or os.sep in path.rsplit(":", 1)[0]):
        file_path, attr = path.rsplit(":", 1)
        if not attr:
            raise HookLoadError(f"hook {path!r}: name the function after ':' (path/to/file.py:fn)")
        return _load_from_file(file_path, attr, path)
    if path.endswith(".py"):
        raise HookLoadError(f"hook {path!r}: name the function in the file as path/to/file.py:fn")
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise HookLoadError(f"hook {path!r}: expected 'pkg.module.fn' or 'path/to/file.py:fn'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise HookLoadError(f"hook {path!r}: module {module_name!r} not found ({exc})") from exc
    return _get_attr(module, attr, path, module_name)


def load_module(path: str) -> Any:
    """Import `pkg.module` or `path/to/file.py` (once per process: a second call returns the same module)."""
    if path.endswith(".py") or os.sep in path:
        if not os.path.isfile(path):
            raise HookLoadError(f"module {path!r}: file does not exist")
        module_name = f"miles_user_module_{abs(hash(os.path.abspath(path)))}"
        if module_name in sys.modules:
            return sys.modules[module_name]
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise HookLoadError(f"module {path!r}: cannot import it as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(module_name, None)
            raise HookLoadError(f"module {path!r}: importing it failed: {type(exc).__name__}: {exc}") from exc
        return module
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as exc:
        raise HookLoadError(f"module {path!r} not found ({exc})") from exc


def split_contiguous(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) ranges of `parts` contiguous chunks of sizes differing by at most one (the first ones larger)."""
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for part in range(parts):
        end = start + base + (1 if part < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
