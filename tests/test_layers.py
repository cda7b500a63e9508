"""The import rules of docs/architecture.md, checked on the source: each package imports only the layers below it,
no two packages import each other (directly or around a loop), and no module imports another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import inferd

ROOT = Path(inferd.__file__).parent

# package -> the inferd packages it must never import, at any indentation. A rule names a package (or a
# top-level module); the few that name a module inside a package state a layering within it, said beside each.
FORBIDDEN = {
    "inferd.errors": {"inferd."},
    "inferd.sampling": {"inferd.engine", "inferd.models", "inferd.server", "inferd.bench", "inferd.request"},
    "inferd.outputs": {"inferd."},
    "inferd.prefix_hash": {"inferd."},
    "inferd.kv_events": {"inferd.engine", "inferd.models", "inferd.server", "inferd.gateway", "inferd.bench"},
    "inferd.procs": {"inferd."},
    "inferd.cpu": {"inferd."},
    "inferd.measure": {"inferd."},  # the measuring library sits below everything that reports a number
    "inferd.strict_json": {"inferd.engine", "inferd.models", "inferd.server", "inferd.gateway", "inferd.bench"},
    "inferd.yaml_config": {"inferd.engine", "inferd.models", "inferd.server", "inferd.gateway", "inferd.bench"},
    "inferd.tracing": {"inferd.engine", "inferd.models", "inferd.server", "inferd.gateway", "inferd.bench"},
    "inferd.fleet": {
        "inferd.engine",
        "inferd.models",
        "inferd.server",
        "inferd.bench",
        "inferd.request",
        "inferd.autoscale",
        "inferd.runtime",
    },
    # what starts and runs a fleet: above the spec, the renderers and the policy it runs, never the benchmark
    "inferd.runtime": {"inferd.models", "inferd.bench", "inferd.request", "inferd.labs"},
    # within it, `inferd up` runs the engine and the server as processes (processes, list files and the
    # handoff's settings: no torch); only the Ray app (`inferd.runtime.ray`) runs them inside its replicas
    "inferd.runtime.up": {"inferd.engine", "inferd.server"},
    "inferd.runtime.disagg": {"inferd.engine", "inferd.server"},
    "inferd.runtime.cli": {"inferd.engine", "inferd.server"},
    "inferd.request": {"inferd.engine", "inferd.models", "inferd.server", "inferd.bench"},
    "inferd.config": {"inferd.engine", "inferd.models", "inferd.server", "inferd.bench"},
    "inferd.chat": {"inferd.engine", "inferd.models", "inferd.server", "inferd.bench"},
    "inferd.models": {"inferd.engine", "inferd.server", "inferd.bench", "inferd.request"},
    "inferd.engine": {"inferd.server", "inferd.bench"},
    # within the engine: the runner (the model on a step) and the scheduler (requests and KV blocks) meet only
    # in `inferd.engine.engine`; the step they pass is a leaf of its own
    "inferd.engine.runner": {"inferd.engine.scheduler", "inferd.engine.kv_cache", "inferd.request"},
    "inferd.engine.step": {"inferd.engine.", "inferd.request", "inferd.models"},
    "inferd.server": {"inferd.bench"},
    "inferd.bench": {"inferd.engine", "inferd.models", "inferd.server", "inferd.request"},
    # the handoff's pieces sit below the engine (which puts them together in inferd.engine.kv_connector)
    "inferd.disagg": {"inferd.engine", "inferd.models", "inferd.server", "inferd.bench", "inferd.request"},
    # within it, the prefill side's lease table and the handoff's metrics are its bottom: nothing of inferd
    "inferd.disagg.leases": {"inferd."},
    "inferd.disagg.metrics": {"inferd."},
    "inferd.autoscale": {"inferd.engine", "inferd.models", "inferd.server", "inferd.request"},
    "inferd.gateway": {"inferd.engine", "inferd.models", "inferd.server", "inferd.bench", "inferd.request"},
    # pure renderers: the fleet spec in, Kubernetes objects and Serve's config out (what runs is inferd.runtime)
    "inferd.deploy": {
        "inferd.engine",
        "inferd.models",
        "inferd.server",
        "inferd.bench",
        "inferd.request",
        "inferd.gateway",
        "inferd.disagg",
        "inferd.autoscale",
        "inferd.runtime",
        "inferd.labs",
    },
    "inferd.labs": {"inferd.server", "inferd.gateway"},  # it runs them as processes and talks HTTP
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _typing_only(tree: ast.AST) -> set[ast.AST]:
    """The imports under `if TYPE_CHECKING:`, which never run."""
    blocks = [n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]
    return {node for block in blocks for stmt in block.body for node in ast.walk(stmt)}


def _imported(path: Path, typing: bool = True) -> list[tuple[str, str | None]]:
    """(module, name) for every inferd import in the file, at any depth: `import inferd.x` is ("inferd.x", None),
    `from inferd.x import y` is ("inferd.x", "y"). `typing=False` leaves out those only type checkers see."""
    out: list[tuple[str, str | None]] = []
    tree = ast.parse(path.read_text())
    skip = set() if typing else _typing_only(tree)
    for node in ast.walk(tree):
        if node in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.module, a.name) for a in node.names]
    return [(m, n) for m, n in out if m == "inferd" or m.startswith("inferd.")]


def _imports(path: Path) -> set[str]:
    return {module for module, _ in _imported(path)}


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


# -- packages, not only layers ----------------------------------------------------------------------------
def _node(module: str) -> str:
    """The package a module belongs to (`inferd.deploy.k8s` -> `inferd.deploy`); a top-level module is its own."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (ROOT / parts[-1]).is_dir() else module


def _target(module: str, name: str | None, modules: set[str]) -> str:
    """What an import reaches: `from inferd import strict_json` is the module inferd.strict_json."""
    return f"{module}.{name}" if name and f"{module}.{name}" in modules else module


def import_graph(node=lambda module: module) -> dict[str, set[str]]:
    """Who imports whom (at any depth, not for type checkers only), between modules or, with `node=_node`,
    between packages."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        for imported, name in _imported(path, typing=False):
            a, b = node(module), node(_target(imported, name, set(modules)))
            if a != b:
                graph.setdefault(a, set()).add(b)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one node: each a set that imports itself around a loop
    (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = {stack.pop()}
            while v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_two_packages_import_each_other():
    found = cycles(import_graph(_node))
    assert not found, "package cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


def test_no_two_modules_import_each_other():
    """Not even inside a function: a module that must import its own users late to load is two modules' worth."""
    found = cycles(import_graph())
    assert not found, "module cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


def test_the_cycle_check_sees_a_loop():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert cycles({"a": {"b"}, "b": set()}) == []


def _private(name: str | None) -> bool:
    return bool(name) and name.startswith("_") and not name.startswith("__")


def test_no_module_imports_another_modules_private_names():
    modules = {_module_name(p) for p in ROOT.rglob("*.py")}
    found = {
        f"{_module_name(path)} imports {imported}.{name}"
        for path in ROOT.rglob("*.py")
        for imported, name in _imported(path)
        if _private(name) and f"{imported}.{name}" not in modules
    }
    assert not found, "\n".join(sorted(found))
