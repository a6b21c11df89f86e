"""The import structure (issues 15 and 32): master and worker are sibling roles, the core imports no role.

An AST walk of the project's source and of the benchmarks (bench/; no module is imported):
every ``import`` and ``from … import`` naming one of the project's modules is an edge.  Rules:

* ``strata.master`` never imports ``strata.worker`` or ``strata.deploy``;
* ``strata.worker`` never imports ``strata.master`` or ``strata.deploy``;
* ``strata.deploy`` starts master and worker *processes* and imports neither;
* the core (``strata`` other than the CLI entry point, ``strata.chunking``,
  ``strata.rpc``) imports no role package (master, worker, deploy);
* the benchmarks (``bench``) may import any module, and no module of ``strata`` imports them;
* no private name (``_x``) is imported from another package;
* nothing but the entry point imports the CLI (shared errors live in ``strata.errors``);
* no import circles among the project's modules (imports inside functions count too:
  they knot the modules together just the same; imports under ``if TYPE_CHECKING`` do not run
  and do not count);
* an import of a project module inside a function is a hidden edge: it says why it is there,
  with a ``# deferred: <reason>`` comment on its line or on the comment line just above its
  block of imports (a heavy import kept out of ``strata --help``'s start-up, say), or is listed
  with its reason in :data:`DEFERRED_ELSEWHERE`.

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
    "bench": "bench",
}
ROLES = ("strata.master", "strata.worker", "strata.deploy")
#: the benchmarks: they may import any module; no module of ``strata`` imports them
BENCH = "bench"
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


def _targets(node: ast.AST, pkg: str) -> set[tuple[str, str | None]]:
    """The project modules an import statement names: {(module, imported name or None)}."""
    out: set[tuple[str, str | None]] = set()
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.name in MODULES:
                out.add((a.name, None))
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
                out.add((sub, None))
            elif mod in MODULES:
                out.add((mod, a.name))
    return out


def _edges() -> dict[str, set[tuple[str, str | None]]]:
    """module → {(imported module, imported name or None)}"""
    out: dict[str, set[tuple[str, str | None]]] = defaultdict(set)
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        pkg = _package_of(name)
        for node in _runtime_nodes(tree):
            out[name] |= _targets(node, pkg)
    return out


EDGES = _edges()


def _role(name: str) -> str:
    if name == BENCH or name.startswith(BENCH + "."):
        return BENCH
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
            "strata.groups.membership", "strata.rpc.codegen", "strata.cli", "bench.engine_micro"} <= set(MODULES)
    assert "strata.master.core" in {b for b, _ in EDGES["strata.master.server"]}
    assert "strata.worker.engine" in {b for b, _ in EDGES["bench.engine_micro"]}


def test_roles_import_no_sibling_and_the_core_no_role():
    bad = []
    for a, targets in EDGES.items():
        for b, _ in targets:
            ra, rb = _role(a), _role(b)
            if ra == rb or ra == BENCH:
                continue
            if rb == BENCH:  # nothing of strata imports the benchmarks
                bad.append((a, b))
            if ra == "strata.master" and rb in ("strata.worker", "strata.deploy"):
                bad.append((a, b))
            elif ra == "strata.worker" and rb in ("strata.master", "strata.deploy"):
                bad.append((a, b))
            elif ra == "strata.deploy" and rb in ("strata.master", "strata.worker"):  # it starts processes
                bad.append((a, b))
            elif ra == "core" and a not in CLI and rb in ROLES:
                bad.append((a, b))
    assert not bad, "imports across roles: " + ", ".join(f"{a} → {b}" for a, b in sorted(bad))


#: private names a module may import from another package, with the reason
PRIVATE_ALLOWED = {
    ("bench.load", "strata.tls", "_material"): "the load generator opens grpc.aio channels of its own; strata.tls "
                                               "has no public reader of a role's raw PEM material",
}


def test_no_private_name_is_imported_from_another_package():
    bad = []
    for a, targets in EDGES.items():
        for b, name in targets:
            private = (name is not None and name.startswith("_") and not name.startswith("__")) or \
                b.rsplit(".", 1)[-1].startswith("_") and not b.endswith("__init__") and \
                b.rsplit(".", 1)[-1] not in ("__main__",)
            if private and _top(a) != _top(b) and (a, b, name) not in PRIVATE_ALLOWED:
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


#: imports of project modules inside functions of files issue 32's change did not edit (they belong to
#: other work), each with the reason it stays there; "to move" says that nothing but that keeps it
#: there (cheap, no circle: the next edit of the file moves it to the top).  ``"*"``: every such
#: import of the module.
DEFERRED_ELSEWHERE: dict[tuple[str, str], str] = {
    ("strata.cli", "strata.sharing.explain"): "~5 ms for `strata --help`; only `explain` of two or more queries "
                                              "needs the sharing analysis",
    ("strata.worker.main", "strata.worker.server"): "`strata --help` loads this module; the worker's server pulls "
                                                    "pyarrow, grpc's server and the engine",
    ("strata.worker.spark", "strata.examples"): "build_archive only (`python -m strata.worker.spark "
                                                "--build-archive`): get_session's callers need none of it",
    ("strata.worker.spark", "strata.config"): "as strata.examples",
    ("strata.worker.spark", "strata.worker.engine"): "as strata.examples: the engine and pyarrow",
    ("strata.worker.spark", "strata.worker.warmup"): "as strata.worker.engine",
    ("bench.run", "*"): "the driver imports only the benchmarks it runs (each loads Spark, Ray or a cluster)",
    ("bench.report", "*"): "the scaling figure's code (matplotlib) only when the report draws it",
}


def _function_imports():
    """(module, import statement, its project modules, whether a ``# deferred:`` comment covers it)
    for every import inside a function (a method, a nested function) of the project's modules."""
    for name, path in MODULES.items():
        text = path.read_text()
        lines = text.splitlines()
        pkg = _package_of(name)

        def said(first: int, last: int) -> bool:
            return any("# deferred:" in lines[k - 1] for k in range(first, last + 1))

        def visit(node: ast.AST, in_function: bool):
            for field in ("body", "orelse", "finalbody", "handlers"):
                block = getattr(node, field, None)
                if not isinstance(block, list):
                    continue
                covered = False  # by a "# deferred:" comment line just above this run of imports
                for k, stmt in enumerate(block):
                    is_import = isinstance(stmt, (ast.Import, ast.ImportFrom))
                    if is_import and not (k and isinstance(block[k - 1], (ast.Import, ast.ImportFrom))):
                        above = lines[stmt.lineno - 2].strip() if stmt.lineno >= 2 else ""
                        covered = above.startswith("# deferred:")
                    if is_import and in_function:
                        targets = {b for b, _ in _targets(stmt, pkg)}
                        if targets:
                            yield name, stmt, targets, covered or said(stmt.lineno, stmt.end_lineno or stmt.lineno)
                    if not is_import:
                        yield from visit(stmt, in_function or isinstance(stmt, (ast.FunctionDef,
                                                                                 ast.AsyncFunctionDef)))

        yield from visit(ast.parse(text, str(path)), False)


def test_imports_inside_functions_say_why():
    """A project import inside a function is an edge no reader of the module's top sees; it stays
    only for a reason (a heavy import kept out of ``strata --help``'s start-up, say), given in a
    ``# deferred:`` comment or in DEFERRED_ELSEWHERE."""
    bad, used = [], set()
    for name, stmt, targets, covered in _function_imports():
        if covered:
            continue
        rest = {t for t in targets if (name, t) not in DEFERRED_ELSEWHERE and (name, "*") not in DEFERRED_ELSEWHERE}
        used |= {(name, t) for t in targets - rest} | ({(name, "*")} if targets - rest else set())
        if rest:
            bad.append(f"{MODULES[name].relative_to(ROOT)}:{stmt.lineno} ({', '.join(sorted(rest))})")
    assert not bad, "imports inside functions without a '# deferred: reason': " + "; ".join(bad)
    stale = sorted(set(DEFERRED_ELSEWHERE) - used)
    assert not stale, f"DEFERRED_ELSEWHERE lists imports that are gone or now commented: {stale}"


def test_the_deferred_rule_sees_a_hidden_edge():
    found = {(n, t) for n, _, targets, _ in _function_imports() for t in targets}
    assert ("strata.master.main", "strata.master.server") in found  # `strata master` defers its server
    assert ("strata.worker.engine", "strata.worker.evaluate") not in found  # a top-level import is no hidden edge


# ---- settings are read typed (issue 32) ---------------------------------------------------------------
#: modules that still read the configuration untyped, with the reason (owned by another change; each
#: entry goes when its module reads the typed field, and the test then says the entry is stale)
UNTYPED_SETTINGS_PENDING: dict[str, str] = {}


def _is_config(node: ast.AST) -> bool:
    """``config``/``cfg``, ``self.config``/``self.cfg``, or a ``getattr`` of one of them."""
    if isinstance(node, ast.Name):
        return node.id in ("config", "cfg")
    if isinstance(node, ast.Attribute):
        return node.attr in ("config", "cfg")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
        and bool(node.args) and _is_config(node.args[0])


def _untyped_setting_reads():
    """(module, line, what) of every ``.sections`` and ``getattr(config, ...)`` outside strata/config.py."""
    for name, path in MODULES.items():
        if name == "strata.config":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "sections":
                yield name, node.lineno, ".sections"
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                    and node.args and _is_config(node.args[0]):
                yield name, node.lineno, "getattr(config, ...)"


def test_settings_are_read_typed_outside_the_config_module():
    """strata/config.py parses and checks every setting once; everyone else reads its typed fields
    (``config.cluster.heartbeat_seconds``, ``config.group(level).spark``), never the raw tables
    (``config.sections``) nor a defensive ``getattr(config, ...)`` with a default of its own."""
    reads = list(_untyped_setting_reads())
    bad = [f"{MODULES[n].relative_to(ROOT)}:{line} ({what})" for n, line, what in reads
           if n not in UNTYPED_SETTINGS_PENDING]
    assert not bad, "untyped reads of the configuration: " + "; ".join(bad)
    stale = sorted(set(UNTYPED_SETTINGS_PENDING) - {n for n, _, _ in reads})
    assert not stale, f"UNTYPED_SETTINGS_PENDING lists modules that now read typed settings: {stale}"
