"""The house rules, read from the code with `ast`: no import cycles between the project's modules,
each package's "Must not import:" line (in its `__init__` docstring) holds for every module in
it, and no module outside kernels/ passes 500 lines."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "runtime", "scheduler", "kernels", "benchmarks", "migrations")
MAX_MODULE_LINES = 500
RULE_PREFIX = "Must not import:"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def imported_names(path: Path) -> set[str]:
    """Every module named by an import anywhere in the file (top level, functions and
    TYPE_CHECKING blocks alike): `from a.b import c` names `a.b.c` and `a.b`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def project_module(name: str) -> str | None:
    """The project module a dotted name lives in (the longest prefix that is one)."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in modules().items():
        targets = {project_module(imported) for imported in imported_names(path)}
        graph[name] = {t for t in targets if t and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def package_rules() -> dict[str, tuple[str, ...]]:
    """package -> the names its docstring says it must not import."""
    rules = {}
    for name, path in modules().items():
        if path.name != "__init__.py":
            continue
        for line in (ast.get_docstring(ast.parse(path.read_text())) or "").splitlines():
            if line.startswith(RULE_PREFIX):
                forbidden = line.removeprefix(RULE_PREFIX).split(",")
                rules[name] = tuple(item.strip() for item in forbidden if item.strip())
    return rules


def is_under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_serving_package_states_its_rules():
    assert {"gateway", "runtime", "scheduler", "kernels"} <= set(package_rules())
    assert {"runtime.step", "runtime.sampling", "runtime.models", "runtime.structured"} <= set(
        package_rules()
    )
    assert {"gateway.openai", "gateway.tenancy", "gateway.audit", "gateway.admin"} <= set(
        package_rules()
    )


@pytest.mark.parametrize("package", sorted(package_rules()))
def test_package_imports_nothing_it_must_not(package: str):
    forbidden = package_rules()[package]
    broken = sorted(
        f"{name} imports {imported}"
        for name, path in modules().items()
        if is_under(name, package)
        for imported in imported_names(path)
        if any(is_under(imported, rule) for rule in forbidden)
    )
    assert broken == []


def test_no_module_outside_kernels_passes_the_size_limit():
    too_long = {
        name: len(path.read_text().splitlines())
        for name, path in modules().items()
        if not is_under(name, "kernels")
    }
    assert {name: n for name, n in too_long.items() if n > MAX_MODULE_LINES} == {}
