"""The operator's set of tools. Only what is registered here can ever run: a model naming any other
tool gets an error result from the runner; no name from model output is ever imported."""
from __future__ import annotations

import dataclasses
import importlib
import json
import pathlib
import threading
import tomllib
from dataclasses import dataclass
from typing import Any, Mapping

from segue.tools.builtin import BUILTINS, ToolFunction
from segue.tools.spec import ToolKind, ToolSpec, ToolSpecError

# Config keys that map straight onto ToolSpec fields (for builtins: overrides of their defaults).
_SPEC_KEYS = ("name", "description", "timeout_s", "expected_seconds", "max_concurrency", "max_result_chars")
_CUSTOM_KEYS = frozenset(_SPEC_KEYS) | {"parameters", "python", "url"}
# Builtin options naming paths are resolved against the config file's folder, like most tools do.
_PATH_OPTIONS = frozenset({"corpus_dir"})


@dataclass(frozen=True)
class RegisteredTool:
    spec: ToolSpec
    fn: ToolFunction | None  # None for HTTP tools


def resolve_target(target: str) -> ToolFunction:
    """Import "pkg.mod:attr[.attr]" and return the callable, or raise ToolSpecError."""
    module_name, _, attr_path = target.partition(":")
    if not module_name or not attr_path:
        raise ToolSpecError(f"python target {target!r} must look like 'pkg.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or anything the module raises while importing
        raise ToolSpecError(f"cannot import module {module_name!r} for target {target!r}: "
                            f"{type(exc).__name__}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ToolSpecError(f"target {target!r}: {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise ToolSpecError(f"target {target!r} is not callable ({type(obj).__name__})")
    return obj


class ToolRegistry:
    """Name -> (spec, callable). Safe to read from several threads while another registers."""

    def __init__(self) -> None:
        self._tools: dict[str, RegisteredTool] = {}
        self._lock = threading.Lock()

    def register(self, spec: ToolSpec, fn: ToolFunction | None = None, *, replace: bool = False) -> None:
        if not isinstance(spec, ToolSpec):
            raise TypeError(f"register() needs a ToolSpec, got {type(spec).__name__}")
        if spec.kind is ToolKind.PYTHON:
            if fn is None:
                if not spec.target:
                    raise ToolSpecError(f"tool {spec.name!r}: a python tool needs a target or a callable")
                fn = resolve_target(spec.target)
            elif not callable(fn):
                raise ToolSpecError(f"tool {spec.name!r}: fn is not callable ({type(fn).__name__})")
        elif fn is not None:
            raise ToolSpecError(f"tool {spec.name!r}: an HTTP tool takes no callable (its target is a URL)")
        with self._lock:
            if spec.name in self._tools and not replace:
                raise ToolSpecError(f"tool {spec.name!r} is already registered")
            self._tools[spec.name] = RegisteredTool(spec, fn)

    def unregister(self, name: str) -> None:
        with self._lock:
            self._tools.pop(name, None)

    def get(self, name: str) -> ToolSpec | None:
        entry = self._tools.get(name)
        return entry.spec if entry else None

    def entry(self, name: str) -> RegisteredTool | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return list(self._tools)

    def specs(self) -> list[ToolSpec]:
        return [e.spec for e in list(self._tools.values())]

    def openai_tools(self) -> list[dict[str, Any]]:
        """Every tool as an OpenAI `tools` entry, in registration order (for chat templates)."""
        return [s.to_openai() for s in self.specs()]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    # ---- config --------------------------------------------------------------------------
    @classmethod
    def from_config(cls, source: str | pathlib.Path | Mapping[str, Any]) -> "ToolRegistry":
        """Build a registry from {"tools": [...]}: a dict, or a .json / .toml file holding one."""
        base_dir: pathlib.Path | None = None
        if isinstance(source, Mapping):
            config: Any = source
        else:
            path = pathlib.Path(source)
            base_dir = path.resolve().parent
            try:
                raw = path.read_bytes()
            except OSError as exc:
                raise ToolSpecError(f"cannot read tool config {str(path)!r}: {exc}") from None
            try:
                config = tomllib.loads(raw.decode("utf-8")) if path.suffix.lower() == ".toml" else json.loads(raw)
            except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ToolSpecError(f"cannot parse tool config {str(path)!r}: {exc}") from None
        tools = config.get("tools") if isinstance(config, Mapping) else None
        if not isinstance(tools, list):
            raise ToolSpecError('tool config must be an object with a "tools" list')
        registry = cls()
        for i, entry in enumerate(tools):
            if not isinstance(entry, Mapping):
                raise ToolSpecError(f"tools[{i}] must be an object, got {type(entry).__name__}")
            try:
                spec, fn = _entry_to_tool(dict(entry), base_dir)
                registry.register(spec, fn)
            except ToolSpecError as exc:
                raise ToolSpecError(f"tools[{i}]: {exc}") from None
        return registry


def _entry_to_tool(entry: dict[str, Any], base_dir: pathlib.Path | None) -> tuple[ToolSpec, ToolFunction | None]:
    if "builtin" in entry:
        builtin = entry.pop("builtin")
        factory = BUILTINS.get(builtin)
        if factory is None:
            raise ToolSpecError(f"unknown builtin {builtin!r}; available: {sorted(BUILTINS)}")
        overrides = {k: entry.pop(k) for k in _SPEC_KEYS if k in entry}
        options = {k: (_resolve_path(v, base_dir) if k in _PATH_OPTIONS else v) for k, v in entry.items()}
        try:
            spec, fn = factory(options)
            return (dataclasses.replace(spec, **overrides) if overrides else spec), fn
        except (TypeError, ValueError) as exc:
            raise ToolSpecError(f"builtin {builtin!r}: {exc}") from None

    unknown = set(entry) - _CUSTOM_KEYS
    if unknown:
        raise ToolSpecError(f"unknown key(s) {sorted(unknown)}; allowed: {sorted(_CUSTOM_KEYS | {'builtin'})}")
    for key in ("name", "parameters"):
        if key not in entry:
            raise ToolSpecError(f"missing {key!r}")
    if ("python" in entry) == ("url" in entry):
        raise ToolSpecError(f"tool {entry['name']!r} needs exactly one of 'python' (pkg.mod:fn) or 'url'")
    kind, target = (ToolKind.PYTHON, entry["python"]) if "python" in entry else (ToolKind.HTTP, entry["url"])
    fields = {k: entry[k] for k in _SPEC_KEYS if k in entry}
    fields.setdefault("description", "")
    try:
        spec = ToolSpec(parameters=entry["parameters"], kind=kind, target=target, **fields)
    except TypeError as exc:
        raise ToolSpecError(str(exc)) from None
    return spec, None  # register() resolves python targets


def _resolve_path(value: Any, base_dir: pathlib.Path | None) -> Any:
    if isinstance(value, str) and base_dir is not None and not pathlib.Path(value).is_absolute():
        return str(base_dir / value)
    return value
