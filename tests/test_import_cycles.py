"""No import cycles between the package's modules (DESIGN.md section 3: "no import cycles between modules").

Found statically, without importing anything: every module of `lightning_roundpipe` is parsed with `ast`,
each import statement is resolved to the package's modules it loads, and the strongly connected components
of that graph with more than one module are the cycles. The oracle is the definition of a cycle: a module
`A` that (directly or through others) imports `B` while `B` imports `A`.

What counts as an import:
- `import a.b.c`, `from a.b import c`, and relative forms (`from . import x`, `from ..pkg.mod import y`),
  wherever they stand: at module level, inside a function or method (a deferred import still runs and still
  ties the two modules together: it only hides the cycle from the first import), inside `try`/`if`.
- `importlib.import_module("<literal>")` with a string literal naming one of the package's modules.
- Imports under `if TYPE_CHECKING:` count too: they never run, but a module that names another's types in its
  annotations while that one imports it back is the same tangle of concerns (and the first step of a runtime
  cycle when the annotation becomes an `isinstance`); type checkers and import linters follow them as well.
- Not counted: strings such as `_LAZY = {"Name": "lightning_roundpipe.x"}` tables (data, not import
  statements; the call that reads them, `import_module(table[name])`, has no literal to resolve).

How packages (`pkg/__init__.py`) count:
- `from pkg import name` names the module `pkg.name` when that file exists (an edge to the submodule only), and
  otherwise the package itself (`pkg/__init__.py`, where `name` is defined or re-exported).
- Importing `pkg.sub.mod` also runs `pkg/__init__.py` and `pkg/sub/__init__.py` first. From a module outside
  `pkg.sub` that is an edge to `pkg.sub` as well (its `__init__` runs then, and what it imports with it). From
  a module inside `pkg.sub` it is not: its own package's `__init__` has already run (or is running) before
  it, so a package importing its own submodules to re-export them is normal and no cycle.
- An import that names the package itself (`from pkg import Name` defined in `pkg/__init__`, `import pkg`,
  `from . import Name` inside `pkg`) is an edge to `pkg/__init__.py`; when that `__init__` imports the
  submodule back (to re-export it), the two form a cycle and are reported.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_roundpipe"


@dataclass(frozen=True)
class ImportEdge:
    """One import statement of `source` that loads the package's module `target` (dotted names)."""

    source: str
    target: str
    line: int
    text: str
    where: str  # "top-level", "deferred" (inside a function or method body) or "TYPE_CHECKING"
    implicit: bool = False  # `target` is a package whose `__init__` runs first because `text` imports a module in it


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every `.py` file under `package_dir` (`pkg/__init__.py` -> `pkg`)."""
    modules: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, where: str = "top-level"):
    """Yield (node, where) for every node below `node`; `where` is "deferred" inside a function or lambda,
    "TYPE_CHECKING" inside an `if TYPE_CHECKING:` body, else "top-level"."""
    for child in ast.iter_child_nodes(node):
        child_where = where
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            child_where = "deferred"
        if isinstance(child, ast.If) and _is_type_checking(child.test) and where == "top-level":
            yield child, where
            for statement in child.body:
                yield statement, "TYPE_CHECKING"
                yield from _walk(statement, "TYPE_CHECKING")
            for statement in child.orelse:
                yield statement, where
                yield from _walk(statement, where)
            continue
        yield child, child_where
        yield from _walk(child, child_where)


def import_edges(module: str, path: Path, modules: dict[str, Path]) -> list[ImportEdge]:
    """Every import in `path` (the module `module`) that resolves to one of `modules`, see the docstring above."""
    source_text = path.read_text()
    tree = ast.parse(source_text, filename=str(path))
    lines = source_text.splitlines()
    is_package = path.name == "__init__.py"
    edges: list[ImportEdge] = []
    seen: set[tuple[str, int]] = set()

    def add(target: str, node: ast.AST, where: str) -> None:
        parts = target.split(".")
        for end in range(1, len(parts) + 1):
            name = ".".join(parts[:end])
            implicit = end < len(parts)
            if implicit and (module == name or module.startswith(name + ".")):
                continue  # the importer's own package: its `__init__` has already run
            if name in modules and name != module and (name, node.lineno) not in seen:
                seen.add((name, node.lineno))
                edges.append(ImportEdge(module, name, node.lineno, lines[node.lineno - 1].strip(), where, implicit))

    def deepest_module(dotted: str) -> str | None:
        """The longest prefix of `dotted` that is one of the package's modules (`import a.b.c` loads `a.b.c`)."""
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in modules:
                return ".".join(parts[:end])
        return None

    for node, where in _walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = deepest_module(alias.name)
                if target is not None:
                    add(target, node, where)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = module.split(".") if is_package else module.split(".")[:-1]
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in modules:
                    add(submodule, node, where)
                else:
                    target = deepest_module(base)
                    if target is not None:
                        add(target, node, where)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id == "import_module"))):
            target = deepest_module(node.args[0].value)
            if target is not None:
                add(target, node, where)
    return edges


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); each component sorted, components in discovery order."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = lowlink[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = lowlink[successor] = counter
                    counter += 1
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    lowlink[node] = min(lowlink[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                lowlink[parent] = min(lowlink[parent], lowlink[node])
            if lowlink[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def import_cycles(package_dir: Path) -> list[tuple[list[str], list[ImportEdge]]]:
    """Each strongly connected component of more than one module, with the import statements inside it."""
    modules = module_files(package_dir)
    edges = [edge for name, path in modules.items() for edge in import_edges(name, path, modules)]
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for edge in edges:
        graph[edge.source].add(edge.target)
    cycles = []
    for component in strongly_connected_components(graph):
        if len(component) > 1:
            members = set(component)
            inside = [edge for edge in edges if edge.source in members and edge.target in members]
            cycles.append((component, sorted(inside, key=lambda edge: (edge.source, edge.line))))
    return cycles


def describe(cycles: list[tuple[list[str], list[ImportEdge]]]) -> str:
    prefix = PACKAGE + "."
    out = []
    for component, edges in cycles:
        out.append("cycle: " + " <-> ".join(name.removeprefix(prefix) for name in component))
        for edge in edges:
            where = edge.where + (", runs the package's __init__" if edge.implicit else "")
            out.append(f"  {edge.source.removeprefix(prefix)}:{edge.line} -> {edge.target.removeprefix(prefix)}"
                       f" ({where}): {edge.text}")
    return "\n".join(out)


def test_no_import_cycles_between_package_modules() -> None:
    cycles = import_cycles(ROOT / PACKAGE)
    assert not cycles, (f"{len(cycles)} import cycle(s) between modules of {PACKAGE} (DESIGN.md section 3); "
                        "HINT: move the definitions both modules need into the lower one (or a new small "
                        "module) so that imports run one way:\n" + describe(cycles))


def test_finder_sees_deferred_relative_and_package_cycles(tmp_path: Path) -> None:
    """The finder itself: a deferred relative import closing a cycle, a submodule importing its package's
    `__init__` that re-exports it, and a cycle closed under `if TYPE_CHECKING:` are found; a package
    re-exporting a submodule that does not import it back is not."""
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .leaf import VALUE\n")
    (package / "leaf.py").write_text("VALUE = 1\n")
    (package / "a.py").write_text("from .b import g\n\ndef f():\n    return 1\n")
    (package / "b.py").write_text("def g():\n    from .a import f  # deferred\n    return f()\n")
    (package / "sub" / "__init__.py").write_text("from .inner import X\nNAME = 'sub'\n")
    (package / "sub" / "inner.py").write_text("X = 2\n\ndef h():\n    from lightning_roundpipe.sub import NAME\n")
    (package / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nfrom .leaf import VALUE\nif TYPE_CHECKING:\n    from .only_types import T\n")
    (package / "only_types.py").write_text("from .typed import VALUE as T\n")
    (package / "other").mkdir()
    (package / "other" / "__init__.py").write_text("from ..user import Y\n")
    (package / "other" / "mod.py").write_text("Z = 3\n")
    (package / "user.py").write_text("from .other.mod import Z\nY = Z\n")
    cycles = {tuple(component): edges for component, edges in import_cycles(package)}
    assert set(cycles) == {(f"{PACKAGE}.a", f"{PACKAGE}.b"), (f"{PACKAGE}.sub", f"{PACKAGE}.sub.inner"),
                           (f"{PACKAGE}.only_types", f"{PACKAGE}.typed"), (f"{PACKAGE}.other", f"{PACKAGE}.user")}, describe(
        import_cycles(package))
    deferred = [edge for edge in cycles[(f"{PACKAGE}.a", f"{PACKAGE}.b")] if edge.source == f"{PACKAGE}.b"]
    assert [(edge.line, edge.where) for edge in deferred] == [(2, "deferred")]
