"""The package boundaries of docs/architecture.md ("Package boundaries"), checked on the source itself."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, child_env

OURS = ("diloco", "islands", "outer_optimizer", "transport", "tests")
ALLOWED: dict[str, set[str]] = {
    "transport": {"transport"},
    "outer_optimizer": {"outer_optimizer"},
    "islands": {"islands", "transport", "outer_optimizer"},
    "diloco": {"diloco", "islands", "outer_optimizer", "transport"},
}


def _imports(path: Path) -> set[str]:
    """Every module name a file imports (absolute imports; the product uses no relative ones)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
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
    assert wrong == []


def test_help_and_status_start_without_jax() -> None:
    code = (
        "import sys\n"
        "from diloco.cli import build_parser\n"
        "build_parser()\n"
        "import diloco.status\n"
        "print(sorted(m for m in ('jax', 'optax', 'orbax') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"
