"""The import rules of docs/architecture.md, checked on the source: each package imports only the layers below it."""

from __future__ import annotations

import ast
from pathlib import Path

import inferd

ROOT = Path(inferd.__file__).parent

# package (or module) -> the inferd packages it must never import, at any indentation
FORBIDDEN = {
    "inferd.errors": {"inferd."},
    "inferd.sampling": {"inferd.engine", "inferd.models", "inferd.server", "inferd.bench", "inferd.request"},
    "inferd.outputs": {"inferd."},
    "inferd.prefix_hash": {"inferd."},
    "inferd.procs": {"inferd."},
    "inferd.cpu": {"inferd."},
    "inferd.measure": {"inferd."},  # the measuring library sits below everything that reports a number
    "inferd.strict_json": {"inferd.engine", "inferd.models", "inferd.server", "inferd.gateway", "inferd.bench"},
    "inferd.yaml_config": {"inferd.engine", "inferd.models", "inferd.server", "inferd.gateway", "inferd.bench"},
    "inferd.fleet.spec": {"inferd.engine", "inferd.models", "inferd.server", "inferd.bench", "inferd.request"},
    "inferd.fleet.up": {"inferd.engine", "inferd.models", "inferd.server", "inferd.bench", "inferd.request"},
    # processes and list files only, and the handoff's settings (no torch)
    "inferd.fleet.disagg": {"inferd.engine", "inferd.models", "inferd.server", "inferd.bench", "inferd.request"},
    "inferd.request": {"inferd.engine", "inferd.models", "inferd.server", "inferd.bench"},
    "inferd.config": {"inferd.engine", "inferd.models", "inferd.server", "inferd.bench"},
    "inferd.chat": {"inferd.engine", "inferd.models", "inferd.server", "inferd.bench"},
    "inferd.models": {"inferd.engine", "inferd.server", "inferd.bench", "inferd.request"},
    "inferd.engine": {"inferd.server", "inferd.bench"},
    "inferd.engine.runner": {"inferd.engine.scheduler", "inferd.engine.kv_cache", "inferd.request"},
    "inferd.engine.step": {"inferd.engine.", "inferd.request", "inferd.models"},
    "inferd.server": {"inferd.bench"},
    "inferd.bench": {"inferd.engine", "inferd.models", "inferd.server", "inferd.request"},
    # the handoff's pieces sit below the engine (which puts them together in inferd.engine.kv_connector)
    "inferd.disagg.params": {"inferd.engine", "inferd.models", "inferd.server", "inferd.bench", "inferd.request"},
    "inferd.disagg.leases": {"inferd."},
    "inferd.disagg.transport": {"inferd.engine", "inferd.models", "inferd.server", "inferd.bench", "inferd.request"},
    "inferd.disagg.metrics": {"inferd."},
    "inferd.autoscale": {"inferd.engine", "inferd.models", "inferd.server", "inferd.request"},
    "inferd.gateway": {"inferd.engine", "inferd.models", "inferd.server", "inferd.bench", "inferd.request"},
    "inferd.deploy": {"inferd.bench", "inferd.request"},
    "inferd.deploy.k8s": {"inferd.engine", "inferd.models", "inferd.server"},
    "inferd.deploy.keda": {"inferd.engine", "inferd.models", "inferd.server"},
    "inferd.deploy.extras": {"inferd.engine", "inferd.models", "inferd.server"},
    "inferd.deploy.validate": {"inferd.engine", "inferd.models", "inferd.server", "inferd.gateway"},
    "inferd.labs": {"inferd.server", "inferd.gateway"},  # it runs them as processes and talks HTTP
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n.startswith("inferd")}


def _applies(rule: str, module: str) -> bool:
    return module == rule or module.startswith(rule + ".")


def test_every_module_keeps_to_its_layer():
    broken = []
    for path in ROOT.rglob("*.py"):
        module = _module_name(path)
        for rule, banned in FORBIDDEN.items():
            if not _applies(rule, module):
                continue
            for name in _imports(path):
                if any(name.startswith(b) or name == b.rstrip(".") for b in banned) and not _applies(module, name):
                    broken.append(f"{module} imports {name}")
    assert not broken, "\n".join(broken)


def test_the_rules_name_real_modules():
    modules = {_module_name(p) for p in ROOT.rglob("*.py")}
    assert all(rule in modules for rule in FORBIDDEN), set(FORBIDDEN) - modules
