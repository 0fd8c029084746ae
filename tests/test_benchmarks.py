"""The measurement scripts behind docs/results (benchmarks/) stay runnable against today's library: each imports
(its work sits behind `if __name__ == "__main__"`) and takes only public names from flexdraft."""
import ast
import importlib.util
from pathlib import Path

import pytest

from conftest import REPO

SCRIPTS = sorted((REPO / "benchmarks").rglob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=[str(p.relative_to(REPO / "benchmarks")) for p in SCRIPTS])
def test_benchmark_script_imports_public_names_only(path: Path):
    tree = ast.parse(path.read_text())
    private = [f"{node.module}.{a.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and (node.module or "").startswith("flexdraft") for a in node.names if a.name.startswith("_")]
    assert not private, private
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # raises on a name the library no longer has
