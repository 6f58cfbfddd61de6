"""The package boundaries of docs/architecture.md ("Package boundaries"), checked on the source itself."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, child_env

PRODUCT = ("diloco", "floor", "islands", "outer_optimizer", "pytrees", "transport")
OURS = (*PRODUCT, "tests")
ALLOWED: dict[str, set[str]] = {
    "floor": {"floor"},
    "pytrees": {"pytrees", "floor"},
    "transport": {"transport", "floor"},
    "outer_optimizer": {"outer_optimizer", "floor"},
    "islands": {"islands", "outer_optimizer", "pytrees", "floor"},
    "diloco": {"diloco", "islands", "outer_optimizer", "pytrees", "transport", "floor"},
}
NO_JAX = ("jax", "jaxlib", "optax", "orbax")


def _imports(path: Path) -> set[str]:
    """Every module name a file imports, wherever the import stands: at the top, in a function or under
    TYPE_CHECKING (absolute imports; the product uses no relative ones). ``from a import b`` gives ``a`` and
    ``a.b`` (``b`` may be a module; `_graph` keeps only the names that are)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _product_modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PRODUCT for p in sorted((REPO / package).rglob("*.py"))}


def _graph() -> dict[str, set[str]]:
    """Module -> the product modules its imports run: the module named and every package above it (importing
    ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` first)."""
    modules = _product_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for imported in _imports(path):
            parts = imported.split(".")
            edges.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules)
        edges.discard(name)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; a circle lies in each."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _circle(graph: dict[str, set[str]], component: list[str]) -> str:
    """One circle through the component's first module, as ``a -> b -> a`` (breadth-first, so a shortest one)."""
    start, inside = component[0], set(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & inside):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return " -> ".join([start, *reversed(path[:-1]), start])
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    return " -> ".join(component)


@pytest.mark.parametrize("package", sorted(ALLOWED))
@pytest.mark.slow
def test_packages_import_only_downwards(package: str) -> None:
    wrong = []
    for path in sorted((REPO / package).rglob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            if top in OURS and top not in ALLOWED[package]:
                wrong.append(f"{path.relative_to(REPO)} imports {name}")
            if package != "diloco" or path.parent.name == "bench" or path.name == "cli.py":
                continue  # the CLI dispatches to the benchmarks; nothing else in the product may import them
            if name.startswith("diloco.bench"):
                wrong.append(f"{path.relative_to(REPO)} imports the benchmarks ({name})")
    assert sorted(set(wrong)) == []


@pytest.mark.slow
def test_no_import_circles() -> None:
    """No product module imports itself through others, counting every import (in functions and under
    TYPE_CHECKING too): a circle means a shared thing lives above one of the modules that need it."""
    graph = _graph()
    assert [_circle(graph, c) for c in _cycles(graph)] == []


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert _circle(graph, ["a", "b", "c"]) == "a -> b -> c -> a"


def _loaded_by(modules: list[str], forbidden: tuple[str, ...], setup: str = "") -> dict[str, list[str]]:
    """Import each module in turn in one fresh interpreter; the forbidden modules each one loaded first."""
    code = (
        "import importlib, json, sys\n"
        f"{setup}\n"
        "seen, out = set(), {}\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"    bad = sorted(m for m in {forbidden!r} if m in sys.modules and m not in seen)\n"
        "    seen.update(bad)\n"
        "    if bad:\n"
        "        out[name] = bad\n"
        "print(json.dumps(out))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout)


def test_the_floor_imports_neither_jax_nor_grpc() -> None:
    """floor/ is what every package may import, the wire and a config loader included (docs/architecture.md)."""
    floor = sorted(m for m in _product_modules() if m.split(".")[0] == "floor")
    assert "floor.codec" in floor and "floor.errors" in floor
    assert _loaded_by(floor, (*NO_JAX, "grpc")) == {}


def test_the_wire_imports_no_jax() -> None:
    """transport/ stands on the floor alone: a client that asks for Status never loads JAX."""
    wire = sorted(m for m in _product_modules() if m.split(".")[0] == "transport" and m != "transport.gen_stubs")
    assert _loaded_by(wire, NO_JAX) == {}


@pytest.mark.slow
def test_loading_a_config_imports_no_jax() -> None:
    """The CLI's loader reads and validates every section without JAX (each section's dataclass is JAX-free)."""
    setup = "from diloco.config import load_config\nload_config('configs/local.toml', ['outer.lr=0.5'])"
    assert _loaded_by(["diloco.config"], NO_JAX, setup) == {}


@pytest.mark.slow
def test_help_and_status_start_without_jax() -> None:
    code = (
        "import sys\n"
        "from diloco.cli import build_parser\n"
        "build_parser()\n"
        "import diloco.ops.status\n"
        "print(sorted(m for m in ('jax', 'optax', 'orbax') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


def test_post_training_data_tasks_and_rewards_import_no_jax() -> None:
    """The JSONL reader, the built-in tasks, rewards (a user's too) and `diloco data task` are NumPy only."""
    modules = [
        "islands.user_code",
        "islands.posttrain.data",
        "islands.posttrain.task",
        "islands.posttrain.rewards",
        "islands.posttrain.accuracy",
        "diloco.ops.task_data",
    ]
    assert _loaded_by(modules, NO_JAX) == {}
