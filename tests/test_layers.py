"""The library's layers (pyproject's [tool.importlinter] contract: core -> models -> speculative -> drafter ->
engine -> mlmodel -> training, evaluation, serving, cluster -> tuning -> cli) hold, and the check is not vacuous: the
same package with one upward import breaks it."""
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO

LINT = str(Path(sys.executable).parent / "lint-imports")


def lint(package_parent: Path) -> subprocess.CompletedProcess:
    return subprocess.run([LINT, str(REPO / "pyproject.toml"), "--no-cache"], cwd=package_parent, text=True,
                          capture_output=True, env={"PYTHONPATH": str(package_parent), "PATH": ""}, timeout=120)


def test_every_module_imports_only_from_the_layers_below_it():
    result = lint(REPO / "platform")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "1 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    shutil.copytree(REPO / "platform" / "flexdraft", tmp_path / "flexdraft",
                    ignore=shutil.ignore_patterns("__pycache__"))
    errors = tmp_path / "flexdraft" / "core" / "errors.py"
    errors.write_text(errors.read_text() + "\nfrom flexdraft.engine.engine import Engine  # an upward import\n")
    result = lint(tmp_path)
    assert result.returncode == 1
    assert "flexdraft.core is not allowed to import flexdraft.engine" in result.stdout


RUFF = str(Path(sys.executable).parent / "ruff")


def test_ruff_finds_nothing_and_would_find_an_unused_name(tmp_path):
    """`ruff check` (pyproject's [tool.ruff]) passes on the whole repository, and the same configuration reports a
    file with an unused import and an undefined name (the check is not vacuous)."""
    result = subprocess.run([RUFF, "check", "--no-cache", "."], cwd=REPO, text=True, capture_output=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f():\n    return undefined_name\n")
    result = subprocess.run([RUFF, "check", "--no-cache", "--config", str(REPO / "pyproject.toml"), str(bad)],
                            text=True, capture_output=True, timeout=120)
    assert result.returncode == 1 and "F401" in result.stdout and "F821" in result.stdout
