"""The package's layout: no import cycle among modules (module-level imports), and no upward import from the library
into the client algorithms or server strategies built on it (they are found by name, through the registry)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"clients": "fedrec_flwr.clients", "strategies": "fedrec_flwr.strategies"}


def _modules() -> dict[str, Path]:
    found = {}
    for pattern in ("fedrec_flwr/**/*.py", "clients/*.py", "strategies/*.py", "experiments/**/*.py"):
        for path in ROOT.glob(pattern):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[0] in MAPPED:
                parts = MAPPED[parts[0]].split(".") + parts[1:]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, *, module_level: bool) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if module_level else list(ast.walk(tree))
    out = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_modules():
    modules = _modules()
    graph = {
        name: {t for t in _imports(name, path, module_level=True) if t in modules and t != name}
        for name, path in modules.items()
    }
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_library_never_imports_the_clients_or_strategies_built_on_it():
    upward = []
    for name, path in _modules().items():
        if name.startswith(tuple(MAPPED.values())) or not name.startswith("fedrec_flwr"):
            continue
        for target in _imports(name, path, module_level=False):
            if target.startswith(tuple(MAPPED.values())):
                upward.append(f"{path.relative_to(ROOT)} imports {target}")
    assert upward == []


MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300


def _sizes(path: Path) -> tuple[int, list[tuple[str, int]]]:
    """``(module lines, [(class name, class lines)])`` of one source file (classes at any depth, decorators excluded)."""
    text = path.read_text(encoding="utf-8")
    classes = [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.ClassDef)
    ]
    return len(text.splitlines()), classes


def test_no_module_over_600_lines_and_no_class_over_300():
    too_big = []
    for pattern in ("fedrec_flwr/**/*.py", "clients/*.py", "strategies/*.py"):
        for path in sorted(ROOT.glob(pattern)):
            name = path.relative_to(ROOT).as_posix()
            lines, classes = _sizes(path)
            if lines > MAX_MODULE_LINES:
                too_big.append(f"{name}: {lines} lines (at most {MAX_MODULE_LINES})")
            too_big += [
                f"{name}: class {cls} {size} lines (at most {MAX_CLASS_LINES})"
                for cls, size in classes
                if size > MAX_CLASS_LINES
            ]
    assert too_big == []


def test_the_size_check_measures_modules_and_classes(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("class A:\n    x = 1\n\n    class B:\n        y = 2\n\n\nz = 3\n", encoding="utf-8")
    assert _sizes(source) == (8, [("A", 5), ("B", 2)])
