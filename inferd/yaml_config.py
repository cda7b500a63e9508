"""YAML files validated by pydantic models, with errors that name `file:line: field: message`.

The text is parsed twice: once into plain data for pydantic, once into YAML nodes to map each field's
location (`pools.0.replicas.1`) back to the line it was written on. The gateway config and the fleet
spec both read their files through `parse_yaml_model`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from inferd.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


class RefError(ValueError):
    """A cross-reference error that knows where in the file it is (pydantic reports it at the top level)."""

    def __init__(self, loc: tuple, message: str):
        super().__init__(message)
        self.loc = loc


def _line_map(text: str) -> dict[tuple, int]:
    """Each field's location (keys and list indexes) -> its 1-based line in the YAML text."""
    lines: dict[tuple, int] = {}

    def walk(node: yaml.Node, path: tuple) -> None:
        lines[path] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                walk(v, (*path, k.value))
                lines[(*path, k.value)] = k.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, (*path, i))

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        walk(root, ())
    return lines


def _line_of(lines: dict[tuple, int], loc: tuple) -> int | None:
    for n in range(len(loc), -1, -1):
        if tuple(loc[:n]) in lines:
            return lines[tuple(loc[:n])]
    return None


def parse_yaml_model(text: str, model: type[M], source: str = "<config>", what: str = "config") -> M:
    """Validate YAML text against `model`; every error names `source:line`."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        raise ConfigError(f"{where}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}:1: the {what} must be a mapping of settings")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        lines = _line_map(text)
        msgs = []
        for err in e.errors():
            cause = (err.get("ctx") or {}).get("error")
            loc = tuple(err["loc"]) + (cause.loc if isinstance(cause, RefError) else ())
            line = _line_of(lines, loc)
            field = ".".join(str(x) for x in loc) or "(top level)"
            msgs.append(f"{source}:{line or 1}: {field}: {err['msg']}")
        raise ConfigError(f"invalid {what}:\n  " + "\n  ".join(msgs)) from None


def read_text(path: str | Path, what: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read the {what} {path}: {e.strerror}") from None
