"""The registry both families of output parsers share (api/tool_parsers, api/reasoning_parsers):
parsers by name, vLLM's `register_module` class decorator, and plugin files (`--tool-parser-plugin
PATH`, `--reasoning-parser-plugin PATH`: a Python file whose decorated classes register when it is
imported). Every error is a ValueError (a TypeError for a class of the wrong kind) that names the
command-line flag, so the server's start-up reports it as a bad flag."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

__all__ = ["ParserRegistry"]

T = TypeVar("T")
C = TypeVar("C", bound=type[Any])


class ParserRegistry(Generic[T]):
    """Parsers of kind `base` by name; `flag` and `plugin_flag` are the CLI flags errors name."""

    def __init__(self, base: type[Any], flag: str, plugin_flag: str) -> None:
        self.base = base
        self.flag = flag
        self.plugin_flag = plugin_flag
        self.parsers: dict[str, type[T]] = {}

    def decorator(self, name: str | list[str] | None = None, *, force: bool = True) -> Callable[[C], C]:
        """Register the decorated class under `name` (each of a list; by default its `name`
        attribute). A taken name is replaced, or (`force=False`) a ValueError."""

        def register(parser: C) -> C:
            if not (isinstance(parser, type) and issubclass(parser, self.base)):
                raise TypeError(f"register_module: expected a {self.base.__name__} subclass, got {parser!r}")
            names = (
                [name] if isinstance(name, str) else list(name) if name is not None else [getattr(parser, "name", "")]
            )
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"register_module: names must be non-empty strings, got {name!r}")
            for n in names:
                if not force and n in self.parsers:
                    raise ValueError(f"{self.flag}: {n!r} is already registered to {self.parsers[n].__name__}")
                self.parsers[n] = parser
            return parser

        return register

    def get(self, name: str) -> type[T]:
        try:
            return self.parsers[name]
        except KeyError:
            raise ValueError(f"{self.flag}: unknown parser {name!r}; known: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self.parsers)

    def import_plugin(self, path: str | Path) -> None:
        """Import the Python file at `path`, so that the classes it decorates register."""
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"{self.plugin_flag}: no such file: {str(file)!r}")
        # A prefixed module name: a plugin called json.py cannot shadow the real module.
        module_name = f"triollm_plugin_{self.plugin_flag.strip('-').replace('-', '_')}_{file.stem}"
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise ValueError(f"{self.plugin_flag}: cannot load {str(file)!r} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[module_name]
            raise ValueError(
                f"{self.plugin_flag}: importing {str(file)!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
