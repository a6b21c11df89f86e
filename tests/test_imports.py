"""The import structure (issue 15): master and worker are sibling roles, the core imports no role.

An AST walk of the project's source (no module is imported): every ``import`` and
``from … import`` naming one of the project's modules is an edge.  Rules:

* ``strata.master`` never imports ``strata.worker`` or ``strata.deploy``;
* ``strata.worker`` never imports ``strata.master`` or ``strata.deploy``;
* ``strata.deploy`` starts master and worker *processes* and imports neither;
* the core (``strata`` other than the CLI entry point, ``strata.chunking``,
  ``strata.rpc``) imports no role package (master, worker, deploy);
* no private name (``_x``) is imported from another package;
* nothing but the entry point imports the CLI (shared errors live in ``strata.errors``);
* no import circles among the project's modules (imports inside functions count too:
  they knot the modules together just the same; imports under ``if TYPE_CHECKING`` do not run
  and do not count).

The packages sit in top-level directories (master/, worker/, chunking/, deploy/,
proto/strata/rpc) and are installed as ``strata.<name>`` (pyproject.toml).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: directory → the package it is installed as
PACKAGES = {
    "strata": "strata",
    "master": "strata.master",
    "worker": "strata.worker",
    "chunking": "strata.chunking",
    "deploy": "strata.deploy",
    "proto/strata/rpc": "strata.rpc",
}
ROLES = ("strata.master", "strata.worker", "strata.deploy")
#: the one CLI: it registers every role's commands
CLI = {"strata.cli", "strata.__main__"}


def _modules() -> dict[str, Path]:
    mods = {}
    for d, pkg in PACKAGES.items():
        base = ROOT / d
        for f in base.rglob("*.py"):
            rel = f.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if d == "strata" and parts and parts[0] in ("master", "worker", "chunking", "deploy", "rpc"):
                continue  # not a real directory of strata/
            mods[name] = f
    return mods


MODULES = _modules()


def _package_of(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]


def _runtime_nodes(tree: ast.AST):
    """Every node, except inside ``if TYPE_CHECKING:`` (imports for annotations only never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _edges() -> dict[str, set[tuple[str, str | None]]]:
    """module → {(imported module, imported name or None)}"""
    out: dict[str, set[tuple[str, str | None]]] = defaultdict(set)
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        pkg = _package_of(name)
        for node in _runtime_nodes(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in MODULES:
                        out[name].add((a.name, None))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg
                    for _ in range(node.level - 1):
                        base = base.rsplit(".", 1)[0]
                    mod = f"{base}.{node.module}" if node.module else base
                else:
                    mod = node.module or ""
                for a in node.names:
                    sub = f"{mod}.{a.name}"
                    if sub in MODULES:
                        out[name].add((sub, None))
                    elif mod in MODULES:
                        out[name].add((mod, a.name))
    return out


EDGES = _edges()


def _role(name: str) -> str:
    for r in ROLES:
        if name == r or name.startswith(r + "."):
            return r
    return "core"


def _top(name: str) -> str:
    """The package a module belongs to for the privacy rule (strata.x.y → strata.x; strata.y → strata)."""
    for d, pkg in PACKAGES.items():
        if pkg != "strata" and (name == pkg or name.startswith(pkg + ".")):
            return pkg
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else "strata"


def test_the_walk_sees_the_project():
    assert {"strata.master.core", "strata.worker.engine", "strata.chunking.chunker", "strata.deploy.cli",
            "strata.groups.membership", "strata.rpc.codegen", "strata.cli"} <= set(MODULES)
    assert "strata.master.core" in {b for b, _ in EDGES["strata.master.server"]}


def test_roles_import_no_sibling_and_the_core_no_role():
    bad = []
    for a, targets in EDGES.items():
        for b, _ in targets:
            ra, rb = _role(a), _role(b)
            if ra == rb:
                continue
            if ra == "strata.master" and rb in ("strata.worker", "strata.deploy"):
                bad.append((a, b))
            elif ra == "strata.worker" and rb in ("strata.master", "strata.deploy"):
                bad.append((a, b))
            elif ra == "strata.deploy" and rb in ("strata.master", "strata.worker"):  # it starts processes
                bad.append((a, b))
            elif ra == "core" and a not in CLI and rb in ROLES:
                bad.append((a, b))
    assert not bad, "imports across roles: " + ", ".join(f"{a} → {b}" for a, b in sorted(bad))


def test_no_private_name_is_imported_from_another_package():
    bad = []
    for a, targets in EDGES.items():
        for b, name in targets:
            private = (name is not None and name.startswith("_") and not name.startswith("__")) or \
                b.rsplit(".", 1)[-1].startswith("_") and not b.endswith("__init__") and \
                b.rsplit(".", 1)[-1] not in ("__main__",)
            if private and _top(a) != _top(b):
                bad.append(f"{a} → {b}{'.' + name if name else ''}")
    assert not bad, "private names imported across packages: " + ", ".join(sorted(bad))


def test_no_import_circles():
    # a package's __init__ re-exporting its own submodules is not a circle between modules
    graph = {a: {b for b, _ in targets if not (MODULES[a].name == "__init__.py" and b.startswith(a + "."))}
             for a, targets in EDGES.items()}
    # Tarjan's strongly connected components: any component of 2+ modules is a circle
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(MODULES)))
    try:
        for v in sorted(MODULES):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    assert not comps, "import circles: " + "; ".join(" ⇄ ".join(c) for c in comps)


def test_nothing_but_the_entry_point_imports_the_cli():
    bad = sorted(a for a, targets in EDGES.items() if a not in CLI and any(b in CLI for b, _ in targets))
    assert not bad, "modules importing the CLI (errors live in strata.errors): " + ", ".join(bad)
